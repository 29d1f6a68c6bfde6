"""lr_collapse: the learning rate optimizer.step() sees, judged over the run's length.

A schedule meant per epoch but stepped per batch (or per micro-batch) spends its whole length
in a fraction of the run. The schedulers your step calls are stepped on from where one call
of your step leaves them, as many times per call as your step steps them (on your own
objects, put back after), over the run: `total_steps` optimizer steps when declared, else
one epoch of a DataLoader, and never fewer than MIN_RUN calls. A learning rate that falls
below 1/100 of its peak before half the run has spent its schedule (a cosine past T_max
starts over: a schedule cycling within the run); one that reaches 0 at the run's end has
not, nor one that restarts by design (warm restarts, cyclic) and comes back up. A learning
rate the step sets by hand is judged on the traced calls: no run wants it to fall 100x
within them. A ReduceLROnPlateau your step steps is judged on the metrics it hands it (plateau).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader

from isotrain.doctor.ground.context import Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.trace import Trace, trace_ok
from isotrain.doctor.state.plateau import PlateauRun, plateau_run, stepped_on

__all__ = ["LR_COLLAPSE", "check_lr"]

COLLAPSE = 100.0
MIN_RUN = 40  # calls: the shortest run a schedule is judged over when nothing says more
MAX_RUN = 20_000  # calls stepped on at most (a longer run is judged over these)
_CYCLIC = (
    torch.optim.lr_scheduler.CosineAnnealingWarmRestarts,
    torch.optim.lr_scheduler.CyclicLR,
)
_FIX = (
    "step a per-epoch scheduler once per epoch, after the batch loop, or give it its length "
    "in optimizer steps (T_max, step_size, total_steps = epochs x batches per epoch); with "
    "gradient accumulation step it once per optimizer.step(); if the run really is this "
    "short, say so with examine(..., total_steps=N)"
)


def check_lr(ctx: Context) -> list[Finding]:
    """lr_collapse: some group's learning rate spends itself within the traced calls, or,
    stepped on as the step steps its schedulers, before half the run."""
    tr = trace_ok(ctx)
    seen = [s.lrs for s in tr.steps if s.lrs] + [tr.lrs_after]
    found = _collapse(seen, len(seen), stays=False) if len(seen) >= 2 else None
    if found is not None:
        group, peak, low, _ = found
        fell = f"{peak / low:.0f}x" if low > 0 else "to 0"
        return [Finding(
            "lr_collapse", "warning", _sched_line(tr),
            f"the learning rate of param group {group} fell {fell} ({peak:.3g} -> {low:.3g}) "
            f"within {len(tr.steps)} calls of your step",
            _FIX,
        )]  # fmt: skip
    if _per_epoch(ctx):
        return []
    plateau = plateau_run(ctx)
    if plateau is not None:
        return _plateau_collapse(ctx, tr, plateau)
    stepped = _stepped(ctx)
    if not stepped:
        return []
    run, said = _run_length(ctx, tr)
    cycles = any(isinstance(s, _CYCLIC) for s, _ in stepped)  # restarts are their design
    found = _collapse(_stepped_on(ctx, stepped, min(run, MAX_RUN)), run / 2, stays=cycles)
    if found is None:
        return []
    group, peak, low, at = found
    how = ", ".join(f"{type(s).__name__}.step() x{n}" for s, n in stepped)
    return [Finding(
        "lr_collapse", "warning", _sched_line(tr),
        f"the learning rate of param group {group} falls below 1/100 of its peak ({peak:.3g} "
        f"-> {low:.3g}) after {at} of the run's {run} calls of your step ({said}), its "
        f"schedulers stepped as your step steps them ({how} per call)",
        _FIX,
    )]  # fmt: skip


def _plateau_collapse(ctx: Context, tr: Trace, plateau: PlateauRun) -> list[Finding]:
    """lr_collapse of a ReduceLROnPlateau your step steps (NOTE [plateau per call])."""
    run, said = _run_length(ctx, tr)
    found = _collapse(stepped_on(ctx, plateau, min(run, MAX_RUN)), run / 2, stays=False)
    if found is None:
        return []
    group, peak, low, at = found
    return [Finding(
        "lr_collapse", "warning", _sched_line(tr),
        f"{plateau.describe()}, repeated, the learning rate of param group {group} falls "
        f"below 1/100 of its peak ({peak:.3g} -> {low:.3g}) after {at} of the run's {run} "
        f"calls of your step ({said})",
        "step ReduceLROnPlateau once per epoch, after validation, with the validation metric: "
        "scheduler.step(val_loss)",
    )]  # fmt: skip


def _per_epoch(ctx: Context) -> bool:
    """Each call runs the user's epoch function (examine's epoch=): a scheduler it steps once
    a call may be a per-epoch one, so the run's length in calls is not known."""
    return getattr(ctx.step, "__qualname__", "").startswith("epoch_step.")


def _run_length(ctx: Context, tr: Trace) -> tuple[int, str]:
    """The calls of the user's step in the run, and what said so."""
    per_call = sum(s.optimizer_steps for s in tr.steps) / max(len(tr.steps), 1) or 1.0
    if ctx.total_steps is not None:
        return max(1, math.ceil(ctx.total_steps / per_call)), f"total_steps={ctx.total_steps}"
    source = ctx.source
    if isinstance(source, DataLoader):
        try:
            epoch = len(source)
        except TypeError:  # an iterable dataset without a length
            epoch = 0
        if epoch > MIN_RUN:
            return epoch, "one epoch of your DataLoader; pass total_steps= for the run's"
    return MIN_RUN, f"at least {MIN_RUN}; pass total_steps= for the run's"


def _stepped(ctx: Context) -> list[tuple[Any, int]]:
    """The schedulers one call of the user's step steps (not those stepped by another, as a
    SequentialLR's), each with how many times."""
    scheds = [
        s for s in ctx.snapshot.scheduler_objects
        if not isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau)
    ]  # fmt: skip
    if not scheds:
        return []
    model, opt = ctx.fresh()
    before = [s.last_epoch for s in scheds]
    try:
        ctx.run_step(model, opt, ctx.batches[0])
        counts = [s.last_epoch - b for s, b in zip(scheds, before, strict=True)]
    finally:
        ctx.reset()
    inner = {id(c) for s in scheds for c in getattr(s, "_schedulers", ())}
    return [(s, n) for s, n in zip(scheds, counts, strict=True) if n > 0 and id(s) not in inner]


def _stepped_on(ctx: Context, stepped: list[tuple[Any, int]], calls: int) -> list[list[float]]:
    """Each group's lr at the start and after each of `calls` calls, the schedulers stepped
    as the step steps them (the optimizer itself untouched), put back after."""
    groups = [g for o in ctx.optimizers for g in o.param_groups]
    lrs = [[float(g["lr"]) for g in groups]]
    try:
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()"
            warnings.simplefilter("ignore")
            for _ in range(calls):
                for s, n in stepped:
                    for _ in range(n):
                        s.step()
                lrs.append([float(g["lr"]) for g in groups])
    except (ValueError, IndexError, ZeroDivisionError):  # stepped past its end (OneCycleLR)
        pass
    finally:
        ctx.reset()
    return lrs


def _collapse(
    lrs: Sequence[Sequence[float]], before: float, *, stays: bool
) -> tuple[int, float, float, int] | None:
    """(group, peak, lowest, call) of the first group whose lr falls below 1/COLLAPSE of its
    peak before call `before` (and, with `stays`, never comes back up to it)."""
    for group in range(len(lrs[0])):
        series = [row[group] for row in lrs]
        peak = 0.0
        for at, lr in enumerate(series):
            peak = max(peak, lr)
            if at >= before:
                break
            if peak > 0 and lr * COLLAPSE < peak:
                if stays and any(x * COLLAPSE >= peak for x in series[at:]):
                    continue
                return group, peak, min(series[at:]), at
    return None


def _sched_line(tr: Trace) -> str:
    """The line of the user's step that stepped a scheduler, else "your step"."""
    return next(iter(tr.steps[0].schedulers), "your step") if tr.steps else "your step"


LR_COLLAPSE = Check(
    "lr_collapse",
    (
        Kind(
            "lr_collapse",
            "the learning rate falls below 1/100 of its peak before half the run (or 8 steps)",
        ),
    ),
    check_lr,
)
