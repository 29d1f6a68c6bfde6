"""Numerics and precision: values that go non-finite or near the edge, steps that differ
from the same state (values), matmuls that leave an autocast region (autocast), and what
16-bit floats do to the loss, the gradient and the optimizer's step (precision, eps).

Kinds: `nonfinite_forward`, `overflow_risk`, `nondeterminism`, `autocast_not_applied`,
`loss_in_low_precision`, `grad_underflow`, `optimizer_eps_underflow`.
"""

from isotrain.doctor.ground.kinds import Check
from isotrain.doctor.numerics.autocast import AUTOCAST_NOT_APPLIED
from isotrain.doctor.numerics.eps import EPS_UNDERFLOW
from isotrain.doctor.numerics.precision import GRAD_UNDERFLOW, LOSS_PRECISION
from isotrain.doctor.numerics.values import NONDETERMINISM, NONFINITE, OVERFLOW

__all__ = ["CHECKS"]

CHECKS: tuple[Check, ...] = (
    NONFINITE,
    OVERFLOW,
    NONDETERMINISM,
    AUTOCAST_NOT_APPLIED,
    LOSS_PRECISION,
    GRAD_UNDERFLOW,
    EPS_UNDERFLOW,
)
