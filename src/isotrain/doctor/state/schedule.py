"""lr_collapse: the learning rate optimizer.step() sees, call after call of the user's step.

A schedule meant per epoch but stepped per batch (or per micro-batch) spends its whole
length in a few steps; no schedule a run wants falls 100x within the handful of steps the
doctor examines.
"""

from __future__ import annotations

from isotrain.doctor.ground.context import Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.trace import trace_ok

__all__ = ["LR_COLLAPSE", "check_lr"]

COLLAPSE = 100.0


def check_lr(ctx: Context) -> list[Finding]:
    """lr_collapse: some group's learning rate falls more than 100x within the traced calls."""
    tr = trace_ok(ctx)
    seen = [s.lrs for s in tr.steps if s.lrs] + [tr.lrs_after]
    if len(seen) < 2:
        return []
    for group, first in enumerate(seen[0]):
        low = min(lrs[group] for lrs in seen)
        if first <= 0 or low * COLLAPSE >= first:
            continue
        fell = f"{first / low:.0f}x" if low > 0 else "to 0"
        scheds = tr.steps[0].schedulers
        where, (name, n) = next(iter(scheds.items()), ("your step", ("", 0)))
        stepped = (
            f"; {name}.step() ran {n} time(s) in each call, one optimizer step" if scheds else ""
        )
        return [Finding(
            "lr_collapse", "warning", where,
            f"the learning rate of param group {group} fell {fell} ({first:.3g} -> {low:.3g}) "
            f"within {len(tr.steps)} calls of your step{stepped}: a schedule meant per epoch "
            "stepped per batch (or per micro-batch)?",
            "step a per-epoch scheduler once per epoch, after the batch loop, or give it its "
            "length in optimizer steps (T_max, step_size, total_steps = epochs x batches per "
            "epoch); with gradient accumulation step it once per optimizer.step()",
        )]  # fmt: skip
    return []


LR_COLLAPSE = Check(
    "lr_collapse",
    (Kind("lr_collapse", "the learning rate falls more than 100x within the examined steps"),),
    check_lr,
)
