"""lr_collapse: the learning rate optimizer.step() sees, judged over the run's length.

A schedule meant per epoch but stepped per batch (or per micro-batch) spends its whole length
in a fraction of the run. The schedulers your step calls are stepped on from where one call
of your step leaves them, as many times per call as your step steps them (on your own
objects, put back after), over the run: `total_steps` optimizer steps when declared, else
one epoch of a DataLoader, and never fewer than MIN_RUN calls. A learning rate that falls
below 1/100 of its peak before half the run (before 80% of the one epoch assumed when the
run is not declared: NOTE [the first epoch]) has spent its schedule (a cosine past T_max
starts over: a schedule cycling within the run); one that reaches 0 at the run's end has
not, nor one that restarts by design (warm restarts, cyclic) and comes back up. A learning
rate the step sets by hand is judged on the traced calls: no run wants it to fall 100x
within them. Under epoch=, per batch or per epoch as the epoch function steps them (NOTE
[schedules under epoch=]).
A ReduceLROnPlateau your step steps is judged on the metrics it hands it (plateau).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader

from isotrain.doctor.ground.context import Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.trace import Trace, trace_ok
from isotrain.doctor.state.plateau import PlateauRun, plateau_run, stepped_on

__all__ = ["LR_COLLAPSE", "check_lr"]

_Part = tuple[Any, float, float]  # a scheduler, its steps a unit (call, batch), its steps an epoch
COLLAPSE = 100.0
MIN_RUN = 40  # calls: the shortest run a schedule is judged over when nothing says more
HALF, FIRST_EPOCH = 0.5, 0.8  # of the run a collapse must come before: NOTE [the first epoch]
MAX_RUN = 20_000  # calls stepped on at most (a longer run is judged over these)
HORIZON = 10_000  # units stepped on to say when an undeclared run's schedule would collapse
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
    stepped on as the step steps its schedulers, before half the run (NOTE [the first
    epoch])."""
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
    if ctx.per_epoch:
        return _over_epochs(ctx, tr)
    plateau = plateau_run(ctx)
    if plateau is not None:
        return _plateau_collapse(ctx, tr, plateau)
    stepped = [(sched, one, 0.0) for sched, one, _ in _stepped(ctx, _steps_once(ctx))]
    if not stepped:
        return []
    run, said, share = _run_length(ctx, tr)
    how = ", ".join(f"{type(s).__name__}.step() x{n:g}" for s, n, _ in stepped) + " per call"
    named = _judged(ctx, tr, stepped, (run, None), f"calls of your step ({said})", how, share)
    if named or ctx.total_steps is not None:
        return named
    return _unjudged(ctx, tr, stepped, (run, said, share), "calls of your step", how)


def _judged(
    ctx: Context, tr: Trace, parts: list[_Part], run: tuple[int, int | None], unit: str,
    how: str, share: float = HALF,
) -> list[Finding]:  # fmt: skip
    """lr_collapse when the schedulers, stepped on over the run (`run`: its units, and the
    units an epoch holds when schedulers also step once an epoch), spend the lr before `share`
    of it."""
    units, every = run
    cycles = any(isinstance(s, _CYCLIC) for s, _, _ in parts)  # restarts are their design
    lrs, _ = _stepped_on(ctx, parts, min(units, MAX_RUN), every)
    found = _collapse(lrs, units * share, stays=cycles)
    if found is None:
        return []
    group, peak, low, at = found
    first = ", within the first epoch, which every run holds" if share == FIRST_EPOCH else ""
    return [Finding(
        "lr_collapse", "warning", _sched_line(tr),
        f"the learning rate of param group {group} falls below 1/100 of its peak ({peak:.3g} "
        f"-> {low:.3g}) after {at} of the run's {units} {unit}{first}, its schedulers stepped "
        f"as your {'epoch function' if ctx.per_epoch else 'step'} steps them ({how})",
        _FIX,
    )]  # fmt: skip


# NOTE [schedules under epoch=]
# The doctor's steps run the user's epoch function over one batch, so a scheduler it steps
# once a call may be stepped once a batch (inside the batch loop) or once an epoch (after it).
# The function runs once more over all k examined batches: a scheduler stepped k times as
# often there steps per batch, one stepped as often steps per epoch. Per-batch steps are
# judged over the run in batches, as a step's are; per-epoch steps need the run's length
# (total_steps=) and an epoch's (a DataLoader's length), and are judged over its epochs.
def _over_epochs(ctx: Context, tr: Trace) -> list[Finding]:
    """lr_collapse under epoch=: NOTE [schedules under epoch=]."""
    k = len(ctx.batches)
    once = _stepped(ctx, _steps_once(ctx))
    counted = {id(s): n for s, n, _ in _stepped(ctx, _steps_once(ctx, ctx.batches))}
    parts = []
    for sched, one, _ in once:
        per_batch = max(counted.get(id(sched), one) - one, 0.0) / (k - 1)
        parts.append((sched, per_batch, max(one - per_batch, 0.0)))
    batches, said, share = _run_length(ctx, tr)
    epoch = _epoch_length(ctx.source)
    judged = ctx.total_steps is not None and epoch is not None  # the run's epochs are known
    if any(b > 0 for _, b, _ in parts):  # in batches, per-epoch steps at each epoch's end
        steps = [(s, b, e if judged else 0.0) for s, b, e in parts if b > 0 or judged]
        run: tuple[int, int | None] = (batches, epoch if judged else None)
        unit = f"batches ({said})"
    elif judged and parts:  # in epochs
        steps = [(s, e, 0.0) for s, _, e in parts]
        run = (math.ceil(batches / epoch), None)  # type: ignore[operator]
        unit = f"epochs ({said}, {epoch} batches an epoch)"
    elif parts:  # once an epoch, over a run whose epochs are not known
        how = ", ".join(_how(s, 0.0, e) for s, _, e in parts)
        return _unjudged(ctx, tr, [(s, e, 0.0) for s, _, e in parts], None, "epochs", how)
    else:
        return []
    chosen = {id(s) for s, _, _ in steps}
    how = ", ".join(_how(s, b, e if judged else 0.0) for s, b, e in parts if id(s) in chosen)
    found = _judged(ctx, tr, steps, run, unit, how, share if run[1] is None else HALF)
    if found or judged or ctx.total_steps is not None:
        return found
    return _unjudged(ctx, tr, steps, (batches, said, share), "batches", how)


# NOTE [a run of unknown length]
# Without total_steps= the run is judged over what the doctor can assume: one epoch of the
# user's DataLoader, at least MIN_RUN calls (under epoch=, a schedule stepped once an epoch
# over nothing). A schedule that spends the lr later than that still spends it in any run
# long enough: stepped on further (up to HORIZON units), the unit where it first falls below
# 1/COLLAPSE of its peak is said as information, with the run length from which that is a
# collapse, not as a warning: the same schedule is right for a run that short. A schedule
# that ends there (OneCycleLR raises past its total_steps) bounds the run itself; restarts
# (warm restarts, cyclic) are their design; neither is said.
def _unjudged(
    ctx: Context, tr: Trace, parts: list[_Part], judged: tuple[int, str, float] | None, unit: str,
    how: str,
) -> list[Finding]:  # fmt: skip
    """lr_collapse's information for a run of unknown length (NOTE [a run of unknown length])."""
    if any(isinstance(s, _CYCLIC) for s, _, _ in parts):
        return []
    lrs, ended = _stepped_on(ctx, parts, HORIZON, None, stop=True)
    found = _collapse(lrs, len(lrs), stays=False)
    if found is None or ended:
        return []
    if _stepped_on(ctx, parts, 2 * found[3] + 1, None)[1]:
        return []  # it ends before any run is long enough for that to be a collapse
    group, peak, low, at = found
    over = (
        f"later than the first {judged[0] * judged[2]:.0f} of the {judged[0]} {unit} judged "
        f"({judged[1].split(';')[0]})"
        if judged else f"and your run's {unit} are not known"
    )  # fmt: skip
    return [Finding(
        "lr_collapse", "info", _sched_line(tr),
        f"not judged: the learning rate of param group {group} falls below 1/100 of its peak "
        f"({peak:.3g} -> {low:.3g}) after {at} {unit} ({how}), {over}; in a run longer than "
        f"{2 * at} {unit} that is a collapse: pass total_steps= (the run's optimizer steps)"
        + (" and batches as your DataLoader (an epoch's length)" if unit == "epochs" else ""),
        _FIX,
    )]  # fmt: skip


def _how(sched: Any, per_batch: float, per_epoch: float) -> str:
    """How the epoch function steps `sched`: "StepLR.step() x1 per epoch"."""
    said = [f"x{n:g} per {unit}" for n, unit in ((per_batch, "batch"), (per_epoch, "epoch")) if n]
    return f"{type(sched).__name__}.step() {' and '.join(said)}"


def _epoch_length(source: Any) -> int | None:
    """The batches in one epoch of the user's DataLoader, None when it has no length."""
    if not isinstance(source, DataLoader):
        return None
    try:
        return len(source) or None
    except TypeError:  # an iterable dataset without a length
        return None


def _plateau_collapse(ctx: Context, tr: Trace, plateau: PlateauRun) -> list[Finding]:
    """lr_collapse of a ReduceLROnPlateau your step steps (NOTE [plateau per call])."""
    run, said, share = _run_length(ctx, tr)
    found = _collapse(stepped_on(ctx, plateau, min(run, MAX_RUN)), run * share, stays=False)
    if found is None:  # (never said beyond the run: its cuts follow metrics not seen yet)
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


# NOTE [the first epoch]
# A declared run (total_steps=) is judged over its first half. Without one the run is at least
# one epoch of the user's DataLoader, and a schedule that spends the lr before FIRST_EPOCH of
# that epoch collapses whatever the run's length: a decay meant for a one-epoch run (linear or
# cosine to 0, a decay over its last fifth) reaches 1/100 of its peak only after it. With no
# DataLoader the run is assumed MIN_RUN calls, judged over its first half.
def _run_length(ctx: Context, tr: Trace) -> tuple[int, str, float]:
    """The calls of the user's step in the run (batches, under epoch=), what said so, and the
    share of it a collapse must come before (NOTE [the first epoch])."""
    per_call = sum(s.optimizer_steps for s in tr.steps) / max(len(tr.steps), 1) or 1.0
    if ctx.total_steps is not None:
        steps = max(1, math.ceil(ctx.total_steps / per_call))
        return steps, f"total_steps={ctx.total_steps}", HALF
    epoch = _epoch_length(ctx.source) or 0
    if epoch > MIN_RUN:
        return epoch, "one epoch of your DataLoader; pass total_steps= for the run's", FIRST_EPOCH
    return MIN_RUN, f"at least {MIN_RUN}; pass total_steps= for the run's", HALF


def _steps_once(ctx: Context, batches: Sequence[Any] | None = None) -> Callable[..., Any]:
    """One call of the user's step on the first batch, or of their epoch function over
    `batches`."""
    if batches is None:
        return lambda model, opt: ctx.run_step(model, opt, ctx.batches[0])
    return lambda model, opt: ctx.run_epoch(model, opt, batches)


def _stepped(ctx: Context, run: Callable[..., Any]) -> list[_Part]:
    """The schedulers one `run` steps (not those stepped by another, as a SequentialLR's),
    each with how many times, from the user's state and put back."""
    scheds = [
        s for s in ctx.snapshot.scheduler_objects
        if not isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau)
    ]  # fmt: skip
    if not scheds:
        return []
    model, opt = ctx.fresh()
    before = [s.last_epoch for s in scheds]
    try:
        run(model, opt)
        counts = [s.last_epoch - b for s, b in zip(scheds, before, strict=True)]
    finally:
        ctx.reset()
    inner = {id(c) for s in scheds for c in getattr(s, "_schedulers", ())}
    return [(s, float(n), 0.0) for s, n in zip(scheds, counts, strict=True)
            if n > 0 and id(s) not in inner]  # fmt: skip


def _stepped_on(
    ctx: Context, parts: list[_Part], units: int, every: int | None, *, stop: bool = False
) -> tuple[list[list[float]], bool]:
    """Each group's lr at the start and after each of `units` units, each scheduler stepped
    its steps a unit and its steps an epoch after every `every` units (the optimizer itself
    untouched), put back after; with `stop`, only until some group's lr falls below
    1/COLLAPSE of its peak. True with them when a scheduler ended (raised past its end)."""
    groups = [g for o in ctx.optimizers for g in o.param_groups]
    lrs = [[float(g["lr"]) for g in groups]]
    peaks = list(lrs[0])
    owed = [0.0] * len(parts)
    ended = False
    try:
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()"
            warnings.simplefilter("ignore")
            for u in range(units):
                ends = every is not None and (u + 1) % every == 0
                for i, (s, per_unit, per_epoch) in enumerate(parts):
                    owed[i] += per_unit + (per_epoch if ends else 0.0)
                    while owed[i] >= 1 - 1e-9:
                        s.step()
                        owed[i] -= 1
                lrs.append([float(g["lr"]) for g in groups])
                peaks = [max(p, lr) for p, lr in zip(peaks, lrs[-1], strict=True)]
                if stop and any(lr * COLLAPSE < p for p, lr in zip(peaks, lrs[-1], strict=True)):
                    break
    except (ValueError, IndexError, ZeroDivisionError):  # stepped past its end (OneCycleLR)
        ended = True
    finally:
        ctx.reset()
    return lrs, ended


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
            "the learning rate falls below 1/100 of its peak before half the run (80% of its "
            "first epoch, or 8 steps)",
        ),
    ),
    check_lr,
)
