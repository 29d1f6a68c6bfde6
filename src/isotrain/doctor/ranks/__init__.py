"""The view across ranks: the doctor's own link between ranks (link), replicas, gradients
and data compared (replicas), the applied gradient's scale against one process's (scale),
from what each backward of a step ran on (backwards), each rank's epoch of samples (shards),
the user's collectives checked before they run (collectives), and one merged text for every
rank's findings (text).

Kinds: `replica_divergence`, `gradient_not_synchronized`, `same_data_on_ranks`,
`gradient_scaled_by_world`, `collective_mismatch`, `data_split_across_ranks`.
"""

from isotrain.doctor.ground.kinds import Check
from isotrain.doctor.ranks.replicas import RANKS
from isotrain.doctor.ranks.shards import SHARDS

__all__ = ["CHECKS"]

CHECKS: tuple[Check, ...] = (RANKS, SHARDS)
