"""Numerics and precision: values that go non-finite or near the edge, steps that differ
from the same state (values), and matmuls that leave an autocast region (autocast).

Kinds: `nonfinite_forward`, `overflow_risk`, `nondeterminism`, `autocast_not_applied`.
"""

from isotrain.doctor.ground.kinds import Check
from isotrain.doctor.numerics.autocast import AUTOCAST_NOT_APPLIED
from isotrain.doctor.numerics.values import NONDETERMINISM, NONFINITE, OVERFLOW

__all__ = ["CHECKS"]

CHECKS: tuple[Check, ...] = (NONFINITE, OVERFLOW, NONDETERMINISM, AUTOCAST_NOT_APPLIED)
