"""The network itself: what it computes across samples, across time and across padding
(measured by perturbing one input at a time), and whether it owns and runs what it was built
from.

Kinds: `batch_mixing`, `causal_leak`, `padding_leak`, `unregistered_parameter`,
`inplace_overwrite`.
"""

from isotrain.doctor.ground.kinds import Check
from isotrain.doctor.model.inplace import INPLACE_OVERWRITE
from isotrain.doctor.model.mixing import BATCH_MIXING, CAUSAL_LEAK
from isotrain.doctor.model.padding import PADDING_LEAK
from isotrain.doctor.model.registered import UNREGISTERED

__all__ = ["CHECKS"]

CHECKS: tuple[Check, ...] = (
    BATCH_MIXING,
    CAUSAL_LEAK,
    PADDING_LEAK,
    UNREGISTERED,
    INPLACE_OVERWRITE,
)
