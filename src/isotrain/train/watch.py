"""The doctor inside a run: the ranks compared before the first step, a Monitor during the run,
and a stop (never a silent continue) once they disagree.

`start` runs examine's cross-rank checks under torchrun, on the run's own model and optimizer
with the trainer's own step (an update rule and counters of its own, so the run's stay as
they are; examine puts the model and optimizer back), then builds the Monitor that `after_step`
consults every `--doctor.every` steps. `save` is the loop's snapshot: NOTE [the last
consistent step] says why it checks first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from isotrain.doctor import Finding, Monitor, examine
from isotrain.train.model.gpt import GPT
from isotrain.train.rundir.resume import save_run
from isotrain.train.rundir.snapshot import find_snapshots
from isotrain.train.state import Batches, Run, TrainState
from isotrain.train.step import train_step
from isotrain.train.update.optim import lr_at
from isotrain.train.update.updater import build_updater

__all__ = ["ACROSS", "Diverged", "OneBatch", "after_step", "run_on", "save", "start"]

log = logging.getLogger(__name__)
ACROSS = ("replica_divergence", "gradient_not_synchronized", "same_data_on_ranks",
          "collective_mismatch")  # fmt: skip
STOPS = (*ACROSS, "lost_update")  # the ranks disagree: training on would train garbage

# NOTE [the last consistent step]
# Which rank is right once the replicas differ is unknowable, so nothing after the divergence
# is saved. Every snapshot is written only after a check at its own step found the ranks
# equal (`save` checks first unless the monitor just did), so on a divergence the newest
# snapshot in the run directory is the last step known to be consistent, and the run stops
# with one line that names it. Keeping a copy in memory at every check would cost a full
# copy of the model and optimizer every N steps; a snapshot is written anyway.


class Diverged(Exception):
    """The ranks disagree (replicas, gradients, data, collectives): the run stopped; its message
    is one line naming the parameters, the ranks and the last consistent snapshot."""


@dataclass(frozen=True)
class OneBatch:
    """Stands in for `Batches` (train_step calls only `get`): every training micro-batch is
    the one the doctor hands over."""

    x: torch.Tensor
    y: torch.Tensor

    def get(self, split: str, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x, self.y, self.y.numel()


def run_on(run: Run, model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> Run:
    """The run's config around the doctor's model and one batch, at the peak learning rate,
    with an update rule and counters of its own (the run's guard state stays the run's)."""
    updater = build_updater(run.cfg, model, optimizer, run.dist)
    state = TrainState(step=run.cfg.optim.warmup_steps)
    one = cast(Batches, OneBatch(*batch))
    return dataclasses.replace(
        run, batches=one, model=cast(GPT, model), train_model=model, optimizer=optimizer,
        updater=updater, state=state,
    )  # fmt: skip


def _loss(outcome: Any) -> torch.Tensor:
    return outcome["loss"] if isinstance(outcome, dict) else outcome.loss


def start(run: Run, stack: contextlib.ExitStack | None) -> Run:
    """Compare the ranks once (under torchrun), then give the run its Monitor (`run.monitor`,
    None with --doctor.every 0), whose hook goes with `stack`; returns the run."""
    cfg = run.cfg
    if not cfg.doctor.every:
        return run
    if run.dist.distributed:
        _compare_ranks(run)
    monitor = Monitor(
        run.train_model, run.optimizer, every=cfg.doctor.every, start_step=run.state.step,
        schedule=lambda s: lr_at(s, cfg.optim, cfg.steps) * run.updater.lr_factor(s),
        on_finding=lambda f: _said(run, f), logger=None,
    )  # fmt: skip
    if stack is not None:
        stack.callback(monitor.close)
    run.monitor = monitor
    return run


def _compare_ranks(run: Run) -> None:
    """examine's cross-rank kinds on the run's own objects and its next two batches."""
    batches = [run.batches.get("train", run.state.step + i)[:2] for i in range(2)]

    def step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        return _loss(train_step(run_on(run, model, optimizer, batch)))

    found = examine(run.train_model, run.optimizer, batches, step=step, checks=list(ACROSS))
    for f in found.findings:
        if f.severity == "error":
            raise Diverged(_line(run, f, before_first=True))
        _said(run, f)


def _said(run: Run, f: Finding) -> None:
    """A finding that does not stop the run: a log line from rank 0."""
    if f.kind in STOPS and f.severity == "error":
        return  # after_step / save raise it
    level = {"error": logging.ERROR, "warning": logging.WARNING}.get(f.severity, logging.INFO)
    if run.dist.is_main:
        log.log(level, "doctor: %s at step %d: %s: %s", f.kind, run.state.step, f.where, f.evidence)


def after_step(run: Run, outcome: Any) -> Any:
    """The monitor's step count, and at its check steps the check (Diverged if the ranks
    disagree); returns the step's `outcome`."""
    if run.monitor is not None:
        _stop_on(run, run.monitor.after_step())
    return outcome


def save(run: Run) -> Path | None:
    """`save_run`, after a check at this step found the ranks equal (NOTE [the last
    consistent step]); Diverged, and no snapshot, when they are not."""
    monitor = run.monitor
    if monitor is not None and monitor.ranks is not None and monitor.checked_at != run.state.step:
        _stop_on(run, monitor.check_now())
    return save_run(run)


def _stop_on(run: Run, found: list[Finding]) -> None:
    stop = [f for f in found if f.kind in STOPS and f.severity == "error"]
    if stop:
        raise Diverged(_line(run, stop[0]))


def _line(run: Run, f: Finding, *, before_first: bool = False) -> str:
    """`replica_divergence at step 40: fc.weight (ranks 0 and 1 differ; max |difference| 3e-05);
    stopped without a snapshot of it: the newest, .../step_0000030, is the last consistent`."""
    detail = re.search(r"\((ranks? [^;()]+(?:;[^()]*)?)\)", f.evidence)
    what = f"{f.where} ({detail.group(1)})" if detail else f"{f.where}: {f.evidence}"
    if before_first:
        return (
            f"{f.kind} before step {run.state.step + 1}: {what}; nothing was trained: fix it "
            "(isotrain doctor under torchrun shows the whole finding)"
        )
    snaps = find_snapshots(run.cfg.out_dir)
    last = (
        f"the newest snapshot, {snaps[-1]}, is the last consistent step: fix the cause, then "
        "resume from it"
        if snaps
        else "no snapshot was written before it, so the run's start is the last consistent step"
    )
    return f"{f.kind} at step {run.state.step}: {what}; stopped without saving it, {last}"
