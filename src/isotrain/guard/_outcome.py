"""What a guarded step decides and reports: skip reasons, the outcome record, the host decision.

Shared by :class:`isotrain.guard.StepGuard`'s device and host paths (and re-exported by
:mod:`isotrain.guard`). Imports only torch and the standard library.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from math import copysign, inf, isfinite
from typing import Any

import torch

from isotrain.guard._spikes import HostSpikeDetector

__all__ = ["SkipReason", "StepOutcome", "count_table"]


class SkipReason(enum.IntEnum):
    """Why a guarded step was skipped (``OK``: it was applied).

    Example: ``SkipReason(int(outcome.reason)).name  # "NONFINITE_LOSS"``
    """

    OK = 0
    NONFINITE_LOSS = 1
    NONFINITE_GRAD = 2
    LOSS_SPIKE = 3
    GRAD_SPIKE = 4
    SCALER_OVERFLOW = 5


@dataclass(frozen=True)
class StepOutcome:
    """One guarded step as device tensors (read-only); read them only at log steps (reading syncs).

    Example: ``outcome = guard.step(loss.detach()); if log_step: print(outcome.to_dict())``
    """

    applied: torch.Tensor  # () bool
    reason: torch.Tensor  # () int64, a SkipReason value
    grad_norm: torch.Tensor  # () float32, before clipping (rank-averaged when distributed)
    loss: torch.Tensor  # () float32 (rank-averaged when distributed)
    loss_scale: torch.Tensor  # () float32, the GradScaler scale this step used (1.0 without)

    def to_dict(self) -> dict[str, Any]:
        """Host values for a log line."""
        fields = [self.applied, self.reason, self.grad_norm, self.loss, self.loss_scale]
        a, r, g, loss, s = torch.stack([f.double() for f in fields]).tolist()  # sync: log step
        return {"applied": bool(a), "reason": SkipReason(int(r)).name, "grad_norm": g,
                "loss": loss, "loss_scale": s}  # fmt: skip


class HostOutcome(StepOutcome):
    """The host mode's StepOutcome: `loss` becomes a tensor when first read.

    The host decision has the loss as a float already; most steps never read the outcome's
    loss, so it is not copied into a tensor each step (NOTE [host outcome] in guard._step).
    """

    def __init__(
        self,
        applied: torch.Tensor,
        reason: torch.Tensor,
        grad_norm: torch.Tensor,
        loss: float | torch.Tensor,
        loss_scale: torch.Tensor,
        device: torch.device | None = None,
    ) -> None:
        d = self.__dict__  # frozen: set once, here, without one call per field
        d["applied"], d["reason"], d["grad_norm"], d["loss_scale"] = (
            applied, reason, grad_norm, loss_scale
        )  # fmt: skip
        if isinstance(loss, torch.Tensor):  # dataclasses.replace passes the tensor it read
            d["_loss"] = loss
        else:
            d["_loss_value"], d["_device"] = loss, device or grad_norm.device

    @property  # a read-only field, made on first read
    def loss(self) -> torch.Tensor:
        d = self.__dict__
        if "_loss" not in d:
            d["_loss"] = torch.tensor(d["_loss_value"], dtype=torch.float32, device=d["_device"])
        return d["_loss"]


# The skip flags in priority order (the first set one is the reason).
_FLAG_CODES: tuple[int, ...] = tuple(int(c) for c in (  # plain ints: cheap on the host path
    SkipReason.NONFINITE_LOSS, SkipReason.SCALER_OVERFLOW, SkipReason.NONFINITE_GRAD,
    SkipReason.LOSS_SPIKE, SkipReason.GRAD_SPIKE))  # fmt: skip
_NONFINITE_LOSS, _SCALER_OVERFLOW, _NONFINITE_GRAD = _FLAG_CODES[:3]
_SPIKE_CODES = (0, int(SkipReason.LOSS_SPIKE), int(SkipReason.GRAD_SPIKE))  # observe()'s


_F32 = struct.Struct("f")


def _round_f32(value: float) -> float:
    """`value` rounded to float32 as a tensor cast rounds it (beyond float32's range: +-inf)."""
    try:
        return _F32.unpack(_F32.pack(value))[0]
    except OverflowError:
        return copysign(inf, value)


def _host_reason(
    loss: float, overflow: float, norm: float, spikes: HostSpikeDetector | None
) -> int:
    """The first of `_FLAG_CODES` that holds for host values; 0: apply, and the spike window
    took the values (the whole host decision: two Python calls with a window, one without)."""
    if not isfinite(loss):
        return _NONFINITE_LOSS
    if overflow > 0:
        return _SCALER_OVERFLOW
    if not isfinite(norm):
        return _NONFINITE_GRAD
    return 0 if spikes is None else _SPIKE_CODES[spikes.observe(loss, norm)]


def _clip_is_one(max_norm: float, norm: torch.Tensor, norm_f: float) -> bool:
    """Whether clip_grads_with_norm_ would multiply by exactly 1.0 (skipping it is bitwise equal).

    It multiplies by min(1, max_norm / (norm + 1e-6)) in the norm's dtype; in float32/64 a norm
    this far below max_norm gives a factor > 1 despite rounding (~1e-7), clamped to 1.0.
    """
    wide = norm.dtype in (torch.float32, torch.float64)
    return wide and norm_f + 1e-6 <= max_norm * (1 - 1e-5)


def count_table() -> torch.Tensor:
    """(reasons, 2, counters) int64: row r holds the multiplier and the increment for reason r.

    Counters are [applied, *by_reason, consecutive]; consecutive is reset by a 0 multiplier
    (ints: no NaN * 0 issue), so one update is `counts * mul + inc`.
    """
    n = len(SkipReason)
    table = torch.zeros(n, 2, n + 2, dtype=torch.int64)
    table[:, 0] = 1
    for r in range(n):
        table[r, 0, -1] = int(r != SkipReason.OK)  # consecutive: reset when applied
        table[r, 1, 0] = int(r == SkipReason.OK)  # applied
        table[r, 1, 1 + r] = 1  # by_reason
        table[r, 1, -1] = int(r != SkipReason.OK)  # consecutive: +1 when skipped
    return table
