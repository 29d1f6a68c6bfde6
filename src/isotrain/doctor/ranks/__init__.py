"""The view across ranks: the doctor's own link between ranks (link), replicas, gradients
and data compared (replicas), the user's collectives checked before they run (collectives),
and one merged text for every rank's findings (text).

Kinds: `replica_divergence`, `gradient_not_synchronized`, `same_data_on_ranks`,
`collective_mismatch`.
"""

from isotrain.doctor.ground.kinds import Check
from isotrain.doctor.ranks.replicas import RANKS

__all__ = ["CHECKS"]

CHECKS: tuple[Check, ...] = (RANKS,)
