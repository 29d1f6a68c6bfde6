"""The gradient optimizer.step() applies, against the doctor's own fresh gradient of the same
samples (NOTE [reference gradient] in ground.trace): stale gradients and accumulation scale."""

from __future__ import annotations

from isotrain.doctor.ground.context import CannotRun, Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.trace import StepTrace, trace_ok
from isotrain.doctor.update.path import path

__all__ = ["ACCUMULATION_SCALE", "STALE_GRADIENT", "check_accumulation", "check_stale"]

_FIT = 0.1  # the largest relative residual of a fit that concludes anything


def _fitted(ctx: Context) -> list[StepTrace]:
    """The calls whose gradient the doctor could judge, or CannotRun saying why none."""
    tr = trace_ok(ctx)
    steps = tr.steps
    if tr.reference_error is not None:
        raise CannotRun(f"the doctor cannot differentiate the loss itself: {tr.reference_error}")
    if any(s.closure for s in steps):
        raise CannotRun("optimizer.step(closure) evaluates the loss itself")
    counts = sorted({s.optimizer_steps for s in steps})
    if counts != [1]:
        raise CannotRun(
            f"your step calls optimizer.step() {' or '.join(map(str, counts))} time(s) per "
            "call (accumulation across calls is yours to judge)"
        )
    if not any(s.references for s in steps):
        raise CannotRun(
            "no mean-reduced loss-function call (cross_entropy, nll_loss, mse_loss, l1_loss, "
            "smooth_l1_loss, huber_loss) feeds your backward"
        )
    return [s for s in steps if s.fit is not None and s.fit.residual < _FIT]


def check_stale(ctx: Context) -> list[Finding]:
    """stale_gradient: step() receives the fresh gradient plus what an earlier step left;
    judged on the update path's own fit where no loss call gives a reference."""
    try:
        fitted = _fitted(ctx)
    except CannotRun as e:
        return _stale_on_path(ctx, e)
    for s in fitted:
        f = s.fit
        if s.index == 0 or f is None or f.before_norm < 0.05 or abs(f.b - 1) > 0.2:
            continue
        return [Finding(
            "stale_gradient", "error", s.step_at,
            f"at call {s.index + 1} of your step, optimizer.step() received the fresh gradient "
            f"of its batch plus {f.b:.2f} x the gradient left in .grad by the step before "
            f"(|left| = {f.before_norm:.2g} x |fresh|, fit residual {f.residual:.1%}): "
            "gradients add up across steps",
            "call optimizer.zero_grad() once per optimizer step, before the forward or right "
            "after optimizer.step(); with gradient accumulation, after the step that ends it",
        )]  # fmt: skip
    return []


def _stale_on_path(ctx: Context, why: CannotRun) -> list[Finding]:
    """stale_gradient from the update path (NOTE [pending gradient] in update.path): the
    gradient step() received holds the one the step before applied with the weight of the new
    one (b = a), whatever the loss; CannotRun(why) when no step could be fitted."""
    p = path(ctx)
    fits = [s for s in p.stale if s.residual < _FIT]
    if p.closure or not fits:
        raise why
    for s in fits:
        if s.a <= 0 or abs(s.b / s.a - 1) > 0.2 or s.left < 0.05:
            continue
        return [Finding(
            "stale_gradient", "error", s.where,
            f"at call {s.call + 1} of your step, optimizer.step() received what backward added "
            f"since the step before plus {s.b / s.a:.2f} x the gradient that step applied "
            f"(|left| = {s.left:.2g} x |received|, fit residual {s.residual:.1%}): gradients "
            "add up across steps",
            "call optimizer.zero_grad() once per optimizer step, before the forward or right "
            "after optimizer.step(); with gradient accumulation, after the step that ends it",
        )]  # fmt: skip
    return []


def check_accumulation(ctx: Context) -> list[Finding]:
    """accumulation_scale: with k micro-batches, the applied gradient is k (or 1/k) times their
    mean gradient."""
    for s in _fitted(ctx):
        k, f = s.references, s.fit
        if k < 2 or f is None:
            continue
        a = f.a / s.scale
        if abs(a / k - 1) < 0.25:
            how = "each micro-batch's loss.backward() adds its full mean gradient"
            fix = (
                "divide each micro-batch loss by the number of micro-batches: (loss / k).backward()"
            )
        elif abs(a * k - 1) < 0.25:
            how = "the loss is divided by the number of micro-batches twice"
            fix = (
                "divide once: drop your own division when a library divides too (HF Trainer "
                "gradient_accumulation_steps, Accelerate's accumulate, Lightning "
                "accumulate_grad_batches)"
            )
        else:
            continue
        return [Finding(
            "accumulation_scale", "error", s.backward_at,
            f"{k} micro-batches per optimizer step: the gradient accumulated for step() is "
            f"{a:.3g} x the mean gradient of the same {k} micro-batches (the doctor's own "
            f"gradient of each micro-batch's loss), not 1: {how}",
            fix,
        )]  # fmt: skip
    return []


STALE_GRADIENT = Check(
    "stale_gradient",
    (
        Kind(
            "stale_gradient",
            "optimizer.step() receives earlier steps' gradients too (no zero_grad)",
        ),
    ),
    check_stale,
)


ACCUMULATION_SCALE = Check(
    "accumulation_scale",
    (
        Kind(
            "accumulation_scale",
            "with k micro-batches the applied gradient is k (or 1/k) times the mean",
        ),
    ),
    check_accumulation,
)
