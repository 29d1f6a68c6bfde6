"""What the model computes across samples and across time, measured by perturbing one
input (mixing).

Kinds: `batch_mixing`, `causal_leak`.
"""

from isotrain.doctor.ground.kinds import Check
from isotrain.doctor.model.mixing import BATCH_MIXING, CAUSAL_LEAK

__all__ = ["CHECKS"]

CHECKS: tuple[Check, ...] = (BATCH_MIXING, CAUSAL_LEAK)
