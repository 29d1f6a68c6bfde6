"""lr_collapse of a ReduceLROnPlateau stepped inside the training step: its patience then
counts batches, and a batch's loss is rarely a new best, so it cuts the learning rate again
and again within one epoch (NOTE [plateau per call]).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from isotrain.doctor.ground.context import Context

__all__ = ["PlateauRun", "plateau_run", "stepped_on"]

Plateau = torch.optim.lr_scheduler.ReduceLROnPlateau


# NOTE [plateau per call]
# ReduceLROnPlateau is meant to be stepped once per epoch with a validation metric. Stepped in
# the step, with each batch's loss, patience counts batches. The doctor records the metrics
# your step hands it over the examined batches and steps it on them, repeated, as often per
# call as your step does, over the run: an epoch's batch losses go up and down around a
# level rather than each beating the best, as the repeated ones do. A plateau stepped outside
# the step (after validation) is not seen here, and is not judged.
class PlateauRun:
    """What one plateau scheduler saw in the calls of the step, and its lr stepped on them."""

    def __init__(self, sched: Any, metrics: list[float], per_call: int) -> None:
        self.sched, self.metrics, self.per_call = sched, metrics, per_call

    def describe(self) -> str:
        s = self.sched
        return (
            f"ReduceLROnPlateau(patience={s.patience}, factor={s.factor:g}).step(metric) runs "
            f"{self.per_call} time(s) in each call of your step, so its patience counts "
            "batches; stepped on the metrics your step gave it over the examined batches"
        )


def plateau_run(ctx: Context) -> PlateauRun | None:
    """The first ReduceLROnPlateau bound to the optimizers that the user's step steps, with the
    metrics it was given over the examined batches; None when the step steps none."""
    scheds = [s for s in ctx.snapshot.scheduler_objects if isinstance(s, Plateau)]
    if not scheds:
        return None
    seen: dict[int, list[float]] = {id(s): [] for s in scheds}
    model, opt = ctx.fresh()
    for s in scheds:
        vars(s)["step"] = _recording(s, seen[id(s)])  # an instance attribute, deleted below
    try:
        for batch in ctx.batches:
            ctx.run_step(model, opt, batch)
    finally:
        for s in scheds:
            del vars(s)["step"]
        ctx.reset()
    found = next((s for s in scheds if seen[id(s)]), None)
    if found is None:
        return None
    metrics = seen[id(found)]
    return PlateauRun(found, metrics, max(1, len(metrics) // len(ctx.batches)))


def _recording(sched: Any, into: list[float]) -> Any:
    step = type(sched).step

    def recorded(metrics: Any, *args: Any, **kwargs: Any) -> Any:
        into.append(float(metrics))  # sync: the doctor's, not the step's
        return step(sched, metrics, *args, **kwargs)

    return recorded


def stepped_on(ctx: Context, run: PlateauRun, calls: int) -> list[list[float]]:
    """Each group's lr at the start and after each of `calls` calls, the plateau scheduler
    stepped on the recorded metrics, repeated (the optimizer itself untouched), put back."""
    ctx.reset()
    groups = [g for o in ctx.optimizers for g in o.param_groups]
    lrs = [[float(g["lr"]) for g in groups]]
    metrics = itertools.cycle(run.metrics)
    try:
        for _ in range(calls):
            for _ in range(run.per_call):
                run.sched.step(next(metrics))
            lrs.append([float(g["lr"]) for g in groups])
    finally:
        ctx.reset()
    return lrs
