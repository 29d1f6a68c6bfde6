"""Precision on the precision run (numerics.halfstep): a loss computed and returned in a 16-bit
dtype, and gradients float16 rounds away where no GradScaler scales the loss."""

from __future__ import annotations

import math

import torch

from isotrain.doctor.ground.context import CannotRun, Context
from isotrain.doctor.ground.finding import Finding, Severity
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.numerics.halfstep import GradError, HalfStep, LossSeen, half_step_ok

__all__ = ["GRAD_UNDERFLOW", "LOSS_PRECISION", "check_grad_underflow", "check_loss_precision"]

_BITS = {torch.float16: 11, torch.bfloat16: 8}  # significant bits
_OFF, _WRONG = 0.05, 0.25  # a parameter's gradient off by this much: warning, error
_FLUSHED = 0.01  # or this share of its nonzero elements flushed to 0: warning


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _loss_finding(loss: LossSeen, n: int) -> Finding:
    dt = _short(loss.dtype)
    gap = abs(loss.value - loss.reference) / max(abs(loss.reference), 1e-12)
    against = (
        f"; the same call on float32 inputs gives {loss.reference:.6g} ({gap:.2%} apart)"
        if math.isfinite(loss.reference)
        else ""
    )
    region = " inside an autocast region that does not cast it" if loss.in_autocast else ""
    return Finding(
        "loss_in_low_precision", "warning", loss.where,
        f"{n} call(s) per step: F.{loss.name} returned a {dt} loss ({loss.value:.6g}{against})"
        f"{region}: the loss and the gradient it sends back keep {_BITS[loss.dtype]} "
        f"significant bits (a softmax near 1 rounds to 1, so the target's gradient vanishes)",
        f"cast the model's output to float32 before the loss: F.{loss.name}(logits.float(), "
        "targets); the model itself can stay in low precision",
    )  # fmt: skip


def check_loss_precision(ctx: Context) -> list[Finding]:
    """loss_in_low_precision: a loss function returned a float16 or bfloat16 value."""
    seen = half_step_ok(ctx)
    firsts: dict[tuple[str, str], tuple[LossSeen, int]] = {}
    for loss in seen.losses:
        first, n = firsts.get((loss.where, loss.name), (loss, 0))
        firsts[(loss.where, loss.name)] = (first, n + 1)
    return [_loss_finding(loss, n) for loss, n in firsts.values()]


def _underflow_fix(seen: HalfStep) -> str:
    if seen.half_params:
        return (
            "keep the parameters in float32 and run the forward under torch.autocast(device_type,"
            " dtype=torch.float16) with a torch.amp.GradScaler (it refuses float16 gradients), "
            "or train in bfloat16, which needs no scaling"
        )
    return (
        "scale the loss: scaler = torch.amp.GradScaler(); scaler.scale(loss).backward(); "
        "scaler.step(optimizer); scaler.update(); or autocast to torch.bfloat16, which needs "
        "no scaling"
    )


def _lost(g: GradError) -> bool:
    return g.relative >= _OFF or (g.nonzero > 0 and g.flushed >= _FLUSHED * g.nonzero)


def check_grad_underflow(ctx: Context) -> list[Finding]:
    """grad_underflow: the step's float16 gradient against the same gradient of the loss times
    a power of two, divided back (NOTE [scaled twin] in numerics.halfstep)."""
    seen = half_step_ok(ctx)
    if seen.scaled or not (seen.half or seen.half_params):
        return []
    if seen.grads is None:
        raise CannotRun(seen.not_measured or "no backward of a scalar loss in your step")
    if not seen.grads:
        return []
    worst = max(seen.grads, key=lambda g: g.relative)
    what = (
        f"{worst.name}: off by {worst.relative:.1%}, {worst.flushed} of its {worst.nonzero} "
        "nonzero elements 0 only unscaled"
    )
    lost = [g for g in seen.grads if _lost(g)]
    if not lost:
        return [Finding(
            "grad_underflow", "info", seen.backward_at,
            f"the backward computes in float16 and no GradScaler scales the loss; at this state "
            f"no gradient loses {_OFF:.0%} against the loss times {seen.scale:g} (worst "
            f"{what}); later in training gradients shrink, and the small ones are lost",
            _underflow_fix(seen),
        )]  # fmt: skip
    sev: Severity = "error" if worst.relative >= _WRONG else "warning"
    return [Finding(
        "grad_underflow", sev, seen.backward_at,
        f"the backward computes in float16 and no GradScaler scales the loss: {len(lost)} of "
        f"{len(seen.grads)} parameters' gradients differ from the gradient of the loss times "
        f"{seen.scale:g}, divided back, by {_OFF:.0%} or more (worst {what}): float16 rounds "
        "away gradients below 6e-5 and flushes those below 6e-8 to 0",
        _underflow_fix(seen),
    )]  # fmt: skip


LOSS_PRECISION = Check(
    "loss_in_low_precision",
    (Kind("loss_in_low_precision", "a loss function computes and returns a float16/bfloat16 "
          "value (its input never cast to float32)"),),
    check_loss_precision,
)  # fmt: skip


GRAD_UNDERFLOW = Check(
    "grad_underflow",
    (Kind("grad_underflow", "float16 gradients lose small values that the same loss, scaled, "
          "keeps (no GradScaler)"),),
    check_grad_underflow,
)  # fmt: skip
