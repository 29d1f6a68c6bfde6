"""The order of the update path (NOTE [pending gradient] in update.path): gradients a zero_grad
throws away before a step applies them, and clips that do not act on the applied gradient."""

from __future__ import annotations

import math

from isotrain.doctor.ground.context import CannotRun, Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.update.path import Clip, Path, path

__all__ = ["CLIPPING", "DISCARDED", "check_clipping", "check_discarded"]


def _watched(ctx: Context) -> Path:
    """The watched calls, or CannotRun when the user's step raised before finishing one."""
    p = path(ctx)
    if p.error is not None and not p.calls:
        raise CannotRun(f"your step raised {p.error}")
    return p


def check_discarded(ctx: Context) -> list[Finding]:
    """gradient_discarded: a zero_grad clears gradients no step applied, then a later
    backward's gradient is applied (zero_grad inside the accumulation loop)."""
    p = _watched(ctx)
    if not p.discards:
        return []
    d = p.discards[0]
    return [Finding(
        "gradient_discarded", "error", d.where,
        f"at call {d.call + 1} of your step, this zero_grad cleared the gradient of "
        f"{d.params} parameter(s) from {d.backwards} earlier backward pass(es) before any "
        "optimizer.step() applied it (no parameter moved in between), and the next step "
        "applied only what the backward passes after it added: with gradient accumulation, "
        "only the last micro-batch's gradient is applied",
        "call zero_grad once per optimizer step: right after optimizer.step() (or before the "
        "first micro-batch), not inside the micro-batch loop; inside Accelerate's "
        "accumulate(), call the prepared optimizer's zero_grad, not the model's",
    )]  # fmt: skip


def _clip_finding(c: Clip) -> Finding | None:
    """The finding of one misplaced clip, or None when it acts on the applied gradient."""
    if c.given == 0:
        why = (
            "was given no tensors at all: an iterable consumed before (model.parameters() "
            "or filter(...) kept in a variable and iterated once already), so nothing is clipped"
        )
        fix = (
            "pass a list: params = list(model.parameters()) (or list(filter(...))), or call "
            "model.parameters() again at the clip"
        )
    elif c.after_step:
        why = (
            "ran after optimizer.step() had applied the gradients it clips, with no backward "
            "since: the step applied them unclipped"
        )
        fix = "clip between backward and step: loss.backward(); clip_grad_norm_(...); opt.step()"
    elif c.scale is not None and c.scale != 1.0:
        why = (
            f"ran on gradients still multiplied by the GradScaler's scale ({c.scale:g}), before "
            f"scaler.unscale_(optimizer): the limit {c.limit:g} applies to scaled gradients, "
            "so once unscaled they are clipped far below it"
        )
        fix = (
            "call scaler.unscale_(optimizer) before clipping, then scaler.step(optimizer) "
            "(it does not unscale twice); Accelerate's accelerator.clip_grad_norm_ does both"
        )
    else:
        return None
    return Finding(
        "clip_misplaced", "error", c.where,
        f"at call {c.call + 1} of your step, the clip (limit {c.limit:g}) {why}", fix,
    )  # fmt: skip


def check_clipping(ctx: Context) -> list[Finding]:
    """clip_misplaced: a clip that cannot act on the gradient step() applies (after the
    step, over no tensors, or before unscale_); a clip with an infinite limit only measures."""
    p = _watched(ctx)
    found: dict[str, Finding] = {}
    for c in p.clips:
        f = None if math.isinf(c.limit) else _clip_finding(c)
        if f is not None and f.where not in found:
            found[f.where] = f
    return list(found.values())


DISCARDED = Check(
    "gradient_discarded",
    (
        Kind(
            "gradient_discarded",
            "zero_grad clears a backward's gradient before any step applies it",
        ),
    ),
    check_discarded,
)


CLIPPING = Check(
    "clip_misplaced",
    (
        Kind(
            "clip_misplaced",
            "a gradient clip misses the applied gradient: after step, no tensors, before unscale_",
        ),
    ),
    check_clipping,
)
