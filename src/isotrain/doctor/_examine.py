"""`examine`: run the checks on the user's setup and collect their findings.

Each check runs on the user's own objects from the state examine found them in, and that
state (model, optimizers, schedulers, global flags, RNG) is put back after every check; a
check that raises becomes a `doctor_error` finding and one that cannot run here an info
finding of its kind.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from isotrain._shared import all_cuda_devices, capture_rng, restore_rng
from isotrain.doctor import (
    data,
    losses,
    model,
    monitor,
    numerics,
    performance,
    ranks,
    state,
    update,
)
from isotrain.doctor.ground.context import CannotRun, Context, StepFn
from isotrain.doctor.ground.finding import Diagnosis, Finding
from isotrain.doctor.ground.kinds import DOCTOR_ERROR, Check
from isotrain.doctor.ground.steps import epoch_step, loss_of, optimizers_in, plain_step
from isotrain.doctor.performance.compile import user_compiles
from isotrain.doctor.ranks.collectives import Collectives, checking_collectives
from isotrain.doctor.ranks.link import RankError, Ranks, distributed
from isotrain.doctor.ranks.text import merge_findings

__all__ = ["CHECKS", "FAMILIES", "KINDS", "examine"]

log = logging.getLogger(__name__)
MAX_BATCHES = 8
_TASKS = (None, "lm", "classification", "gan")

# The families examine runs, each a room that lists its checks and their kinds (ranks: only
# under a process group, and first: a DDP bug is seen before other checks step on its reducer)
FAMILIES = (state, update, losses, model, numerics, data, performance, ranks)
CHECKS: tuple[Check, ...] = tuple(c for family in FAMILIES for c in family.CHECKS)

# Every kind the doctor reports, with one line saying what it means: examine's, its own
# doctor_error, then those only the Monitor sees in a real run.
KINDS: dict[str, str] = {
    k.name: k.means for k in (*(k for c in CHECKS for k in c.kinds), DOCTOR_ERROR, *monitor.KINDS)
}
MONITOR_KINDS = tuple(k.name for k in monitor.KINDS)


def _selected(checks: str | Sequence[str]) -> tuple[list[Check], set[str]]:
    """The check families to run and the kinds to report."""
    if checks in ("all", "fast"):
        many = distributed()
        chosen = [c for c in CHECKS if (c.fast or checks == "all") and (many or not c.ranks)]
        return chosen, {k for c in chosen for k in c.names} | {"doctor_error"}
    if isinstance(checks, str) or not all(isinstance(k, str) for k in checks):
        raise ValueError(
            f'checks must be "all", "fast" or a list of kinds, got {checks!r}; '
            f"kinds: {', '.join(KINDS)}"
        )
    unknown = [k for k in checks if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown check kind(s) {unknown}; choose from: {', '.join(KINDS)}")
    of_runs = [k for k in checks if k in MONITOR_KINDS]
    if of_runs:
        raise ValueError(
            f"{', '.join(of_runs)}: reported by isotrain.doctor.Monitor during a real run, "
            "not by examine"
        )
    kinds = set(checks) | {"doctor_error"}
    return [c for c in CHECKS if kinds & set(c.names)], kinds


def _generators(batches: Any) -> list[torch.Generator]:
    """The torch.Generators a DataLoader draws its order from (iterating advances them)."""
    sampler = getattr(batches, "sampler", None)
    inner = getattr(getattr(batches, "batch_sampler", None), "sampler", None)
    found = [getattr(o, "generator", None) for o in (batches, sampler, inner)]
    return list({id(g): g for g in found if isinstance(g, torch.Generator)}.values())


def _batches(batches: Iterable[Any], rng: dict[str, Any]) -> list[Any]:
    """The first MAX_BATCHES batches of a list, a DataLoader or any iterable; the RNGs and a
    DataLoader's generators are put back, so the user's own epoch draws what it would have."""
    items = list(batches) if isinstance(batches, (list, tuple)) else None
    if items is None:
        generators = _generators(batches)
        states = [g.get_state() for g in generators]
        try:
            items = list(itertools.islice(iter(batches), MAX_BATCHES))
        finally:
            restore_rng(rng)
            for g, state in zip(generators, states, strict=True):
                g.set_state(state)
    if len(items) < 2:
        raise ValueError(
            f"examine needs at least 2 batches (got {len(items)}): several checks compare one "
            "batch with another, e.g. batches=[next(it), next(it)]"
        )
    return items[:MAX_BATCHES]


def _raised(where: str, e: Exception) -> Finding:
    """The doctor_error of a check that raised: its first line."""
    first = (str(e).splitlines() or [""])[0]
    return Finding(
        "doctor_error", "error", where, f"{type(e).__name__}: {first}",
        "the check could not finish on this setup; run the others with "
        "checks=[...] and report the error if it is the doctor's",
    )  # fmt: skip


def _run_one(check: Check, ctx: Context, kinds: set[str]) -> list[Finding]:
    """One family: its findings, or an info per kind if it cannot run, or a doctor_error."""
    started = time.perf_counter()
    eager = not check.traces and user_compiles(ctx)
    try:
        ctx.reset()
        with torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext():
            return check.run(ctx)
    except RankError:
        raise  # the ranks are no longer in step: examine stops comparing them
    except CannotRun as e:
        return [
            Finding(k, "info", check.name, f"not checked: {e}", "-")
            for k in check.names
            if k in kinds
        ]
    except Exception as e:
        log.debug("doctor check %s raised", check.name, exc_info=True)
        return [_raised(check.name, e)]
    finally:
        ctx.reset()
        log.debug("doctor check %s: %.2f s", check.name, time.perf_counter() - started)


def examine(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    batches: Iterable[Any],
    *,
    step: StepFn | None = None,
    epoch: Callable[[nn.Module, Any, Any], Any] | None = None,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    eval_fn: Callable[[nn.Module, Any], Any] | None = None,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    checks: str | Sequence[str] = "all",
    task: str | None = None,
    samples_interact: bool = False,
    loss_falls: bool | None = None,
    total_steps: int | None = None,
    save: Callable[[str], Any] | None = None,
    load: Callable[[str], Any] | None = None,
    rank_timeout: float = 120.0,
) -> Diagnosis:
    """Find the hidden side effects of a training setup; each a Finding with evidence and fix.

    Runs your step on your own `model` and `optimizer` (one, or a list: a GAN's two) and
    puts everything back after each check: parameters, grads, buffers, optimizer state,
    schedulers bound to it, what your step keeps in globals (a hidden state, a list of
    losses), the RNGs and every global flag are as before when it returns.
    `batches`: a list, a DataLoader or any iterable (its first 8). `step(model, optimizer,
    batch) -> loss` is your own training step; or `epoch(model, optimizer, loader)`, your own
    epoch function, run over one batch at a time (its model.train(), zero_grad placement and
    schedule as your loop runs them; `loader` holds that batch and your loader's attributes)
    and once over all of them (what runs once a batch, not once a call: syncs, schedulers);
    without either, `loss_fn(model, batch) -> loss` drives a plain step, and a dict batch
    needs none of them when the model returns `.loss` (`model(**batch).loss`, as Hugging Face
    models do).

    Checks that run a forward of their own call the model exactly as your step does for that
    batch (its arguments are recorded from your step, which stops there and is put back);
    `forward(model, batch) -> output` tells them how where your step calls only the model's
    parts (a GAN's two networks) or the model returns only its loss.

    Declarations for setups that are right but unusual: `samples_interact=True` when the
    samples along dim 0 are meant to affect each other (a graph's nodes, a set); `loss_falls
    =False` when the loss is not meant to fall (adversarial; the default judges it unless
    there are several optimizers or task="gan"). `total_steps`: the optimizer steps of your
    whole run, to judge the learning-rate schedule over it (else one epoch of a DataLoader).
    `save(path)` and `load(path)`: your own checkpoint code, writing and reading everything a
    resume needs at `path`; a run resumed by them is compared with one not interrupted.

    Under a process group, call it on every rank: the ranks are compared too (replicas,
    gradients, data, collectives), each exchange waiting at most `rank_timeout` seconds.

    Example: ``print(examine(model, opt, [b0, b1], step=train_step, eval_fn=evaluate))``
    """
    _refuse_bad_arguments(model, task, total_steps, (step, epoch), (save, load))
    optimizers = optimizers_in(optimizer)
    families, kinds = _selected(checks)
    started = time.perf_counter()
    rng = capture_rng(all_cuda_devices(initialized_only=True))
    items = _batches(batches, rng)
    ctx = Context(
        model, optimizer, optimizers, items, _driver(items, batches, step, epoch, loss_fn),
        eval_fn, task, step is None and epoch is None, rng, source=batches, forward=forward,
        samples_interact=samples_interact, loss_falls=loss_falls, total_steps=total_steps,
        asked=frozenset(kinds if not isinstance(checks, str) else ()),
        checkpoint=(save, load) if save is not None else None,
    )  # fmt: skip
    try:
        found = _run_all(ctx, families, kinds, rank_timeout)
    finally:
        ctx.reset()
    examined = sorted(kinds - {"doctor_error"}, key=list(KINDS).index)
    return Diagnosis(found, examined, time.perf_counter() - started)


def _refuse_bad_arguments(
    model: Any, task: str | None, total_steps: Any, drivers: tuple[Any, Any], io: tuple[Any, Any]
) -> None:
    """One line for an argument examine cannot take, before anything runs."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if task not in _TASKS:
        raise ValueError(f"task must be one of {', '.join(map(repr, _TASKS))}, got {task!r}")
    if total_steps is not None and (not isinstance(total_steps, int) or total_steps < 1):
        raise ValueError(f"total_steps must be a positive int, got {total_steps!r}")
    if None not in drivers:
        raise ValueError("pass step=your_step or epoch=your_epoch, not both")
    if (io[0] is None) != (io[1] is None):
        raise ValueError("pass save=your_save(path) and load=your_load(path) together")


def _driver(
    items: list[Any], batches: Any, step: StepFn | None, epoch: Any, loss_fn: Any
) -> StepFn:
    """What the checks call as the user's step: their step, their epoch over one batch, or a
    plain step around their loss_fn (or a Hugging Face model's own .loss)."""
    if step is not None:
        return step
    if epoch is not None:
        return epoch_step(epoch, batches)
    return plain_step(loss_of(items, loss_fn))


def _run_all(
    ctx: Context, families: list[Check], kinds: set[str], rank_timeout: float
) -> list[Finding]:
    """Every family in order; under a process group over the doctor's link, with the user's
    collectives checked, the ranks meeting after each family, every rank's findings merged."""
    link = ctx.ranks = Ranks(timeout=rank_timeout) if distributed() else None
    try:
        return _families(ctx, families, kinds, link)
    finally:
        if link is not None:
            link.close()


def _families(
    ctx: Context, families: list[Check], kinds: set[str], link: Ranks | None
) -> list[Finding]:
    found: list[Finding] = []
    checked = checking_collectives(link) if link is not None else contextlib.nullcontext()
    try:
        with checked as calls:
            ctx.cache["collectives"] = calls
            # the ranks first: a DDP bug is seen before other checks step on its reducer
            for check in sorted(families, key=lambda c: not c.ranks):
                found += [f for f in _run_one(check, ctx, kinds) if f.kind in kinds]
                if link is not None:
                    link.gather(f"the end of the {check.name} checks")
        found += _step_error(ctx)
        found += [f for f in ctx.unrestored() if f.kind in kinds]
        if link is not None:
            found = merge_findings(link.gather("every rank's findings", found))
    except RankError as e:  # one line naming the ranks; nothing more is compared
        kind = "collective_mismatch" if e.apart else "doctor_error"
        found.append(Finding(
            kind, "error", "across ranks", str(e),
            "make every rank run the same steps and collectives in the same order (no "
            "rank-dependent branches around forward, backward, optimizer.step or dist calls)",
        ))  # fmt: skip
    return found


def _step_error(ctx: Context) -> list[Finding]:
    """One doctor_error when the user's own step raised (the checks needing it said so); a
    collective mismatch is its own finding."""
    probe = ctx.cache.get("probe")
    calls: Collectives | None = ctx.cache.get("collectives")
    if probe is None or probe.error is None or (calls is not None and calls.mismatch):
        return []
    return [Finding(
        "doctor_error", "error", "your step", f"the step raised {probe.error}",
        "make one step run on its own: step(model, optimizer, batches[0])",
    )]  # fmt: skip
