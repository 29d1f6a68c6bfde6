"""Karpathy's recipe checks: the loss at init, and whether the model can memorise one batch.

cannot_overfit runs a few dozen steps on one repeated batch at the user's learning rate and,
where the loss barely falls, again at ten times that rate (an optimizer hook scales each
group's lr for the update only, so the user's schedule runs as written): a model that learns
at 10x is fine, one that learns at neither cannot learn. A loss that is not meant to fall (a
GAN's adversarial losses, several optimizers) is not judged.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise
from typing import Any

import torch
from torch import nn

from isotrain.doctor.ground.context import CannotRun, Context, as_loss, params_of
from isotrain.doctor.ground.finding import Finding, Severity
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.probe import probe_ok
from isotrain.doctor.ground.trace import trace

__all__ = ["LOSS_AT_INIT", "OVERFIT", "check_loss_at_init", "check_overfit"]

OVERFIT_STEPS = 30
BOOST = 10.0  # the second try's learning-rate factor
_FELL = 0.9  # a loss that ends below 90% of where it started has fallen
_NOISY = 0.05  # a loss that moves 5% with the RNG alone at the same weights is not judged


@contextmanager
def _lr_scaled(optimizers: list[torch.optim.Optimizer], factor: float) -> Iterator[None]:
    """Each update runs with every group's lr times `factor`, and at least the schedule's peak
    (`initial_lr`) when factor > 1 (a warmup keeps the lr near 0 for the steps examined); the
    lr is put back after it."""
    saved: list[list[Any]] = []

    def before(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        saved.append([g["lr"] for g in opt.param_groups])
        for g in opt.param_groups:
            peak = g.get("initial_lr", 0.0) if factor > 1 else 0.0
            g["lr"] = max(g["lr"] * factor, peak)

    def after(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for g, lr in zip(opt.param_groups, saved.pop(), strict=True):
            g["lr"] = lr

    handles = [h for o in optimizers for h in (o.register_step_pre_hook(before),
                                               o.register_step_post_hook(after))]  # fmt: skip
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _loss_of(value: Any) -> float:
    loss = as_loss(value)
    if loss is None:
        raise CannotRun("the step returns no loss tensor to follow")
    return float(loss.detach().float().mean())  # sync: the doctor, not the step


def _losses(ctx: Context, factor: float) -> tuple[list[float], bool]:
    """The losses of OVERFIT_STEPS steps on batch 0, and whether any parameter moved."""
    model, opt = ctx.fresh()
    start = [p.detach().clone() for p in params_of(model).values()]
    with _lr_scaled(ctx.optimizers, factor):
        losses = [_loss_of(ctx.run_step(model, opt, ctx.batches[0])) for _ in range(OVERFIT_STEPS)]
    now = params_of(model).values()
    return losses, any(not torch.equal(a, b) for a, b in zip(start, now, strict=True))


def _rng_spread(ctx: Context, first: float) -> float:
    """How far the first loss moves when the step draws other random numbers (a diffusion
    loss's timestep and noise, dropout), at the same weights: relative to the loss."""
    model, opt = ctx.fresh()
    torch.manual_seed(torch.initial_seed() + 1)  # examine puts the RNG back after the check
    return abs(_loss_of(ctx.run_step(model, opt, ctx.batches[0])) - first) / max(abs(first), 1e-12)


def _fell(losses: list[float]) -> bool:
    """A clear fall (below 90%), or a significant one: the last third's mean below the first
    third's by 1% at least and by three standard errors of the step-to-step noise (a summed
    loss with a large floor, a slow fine-tune, a loss drawn with fresh noise each call)."""
    first, last = losses[0], min(losses[-3:])
    if not math.isfinite(last):
        return False
    if last <= _FELL * first:
        return True
    n = len(losses) // 3
    early, late = statistics.fmean(losses[:n]), statistics.fmean(losses[-n:])
    noise = statistics.pstdev([b - a for a, b in pairwise(losses)]) / math.sqrt(2)
    drop = early - late
    return drop > 0.01 * abs(early) and drop > 3 * noise * math.sqrt(2 / n)


def check_overfit(ctx: Context) -> list[Finding]:
    """cannot_overfit: a few dozen steps on one repeated batch must lower its loss, at the
    user's learning rate or at ten times it (at least the schedule's peak)."""
    probe_ok(ctx)
    if ctx.loss_falls is False:
        raise CannotRun("declared loss_falls=False (a loss that is not meant to fall)")
    if ctx.loss_falls is None and (ctx.task == "gan" or len(ctx.optimizers) > 1):
        raise CannotRun(
            "several optimizers (or task='gan'): adversarial losses need not fall; pass "
            "loss_falls=True to check anyway"
        )
    mine, moved = _losses(ctx, 1.0)
    if moved and _fell(mine):  # weights that never move learn nothing, whatever noise says
        return []
    spread = _rng_spread(ctx, mine[0])
    if moved and spread > _NOISY:  # learning, seen through noise: the loss cannot tell
        raise CannotRun(
            f"the loss moves {spread:.0%} with the random numbers the step draws at the same "
            "weights (new noise or timesteps each call): one batch cannot be memorised"
        )
    boosted, boosted_moved = _losses(ctx, BOOST)
    seen = (
        f"loss on one repeated batch went {mine[0]:.4g} -> {min(mine[-3:]):.4g} in "
        f"{OVERFIT_STEPS} steps at your learning rate, {boosted[0]:.4g} -> "
        f"{min(boosted[-3:]):.4g} at {BOOST:g}x (at least the schedule's peak)"
    )
    if not (moved or boosted_moved):
        seen += "; no parameter moved in any of those steps"
    if boosted_moved and _fell(boosted):
        return [Finding(
            "cannot_overfit", "info", "your step",
            seen + ": the model learns; your rate is gentle for memorising one batch",
            "nothing to fix for a fine-tuning rate; a typo'd rate (1e-6 for 1e-3) looks so too",
        )]  # fmt: skip
    return [Finding(
        "cannot_overfit", "warning", "your step",
        seen + ": a model that cannot memorise one batch will not learn the data",
        "check that the loss reaches the parameters, that targets match inputs (no double "
        "softmax before the loss), and the learning rate (a schedule at 0?)",
    )]  # fmt: skip


def _classes(ctx: Context, model: nn.Module) -> int:
    call = ctx.call(ctx.batches[0])
    with torch.no_grad():
        logits = ctx.outputs(model, call)
    return int(logits.shape[-1])


def _first_loss(ctx: Context) -> float:
    """The first step's first mean cross-entropy (what a step returns may be scaled for
    accumulation or hold other terms), else the loss the step returned."""
    p = probe_ok(ctx)
    tr = trace(ctx)
    calls = [] if tr.error is not None else tr.watch.calls
    for c in calls:
        if c.step == 0 and c.name in ("cross_entropy", "nll_loss") and c.value is not None:
            return c.value
    if p.loss is None:
        raise CannotRun("the step returns no loss tensor")
    return p.loss


def check_loss_at_init(ctx: Context) -> list[Finding]:
    """loss_at_init: for lm/classification, the first loss against ln(number of classes): a
    warning beyond twice it (or below half: a leak?), info when moderately off."""
    if ctx.task not in ("lm", "classification"):
        raise CannotRun('needs task="lm" or task="classification" to know the expected loss')
    first = _first_loss(ctx)
    model, _ = ctx.fresh()
    n = _classes(ctx, model)
    expected = math.log(n)
    if math.isfinite(first) and abs(first - expected) <= max(0.5, 0.25 * expected):
        return []
    far = not math.isfinite(first) or not 0.5 * expected <= first <= 2 * expected
    sev: Severity = "warning" if far else "info"
    fix = (
        "initialise the output layer small (std ~0.02, or zeros), check the targets "
        "(shifted by one for a language model, class indices for classification)"
        if far
        else "optional: an output layer initialised small (std ~0.02) skips the first steps' fall"
    )
    return [Finding(
        "loss_at_init", sev, "your step",
        f"first loss {first:.4g}, expected about ln({n}) = {expected:.4g} for a model "
        "that starts out guessing uniformly",
        fix,
    )]  # fmt: skip


OVERFIT = Check(
    "overfit",
    (
        Kind(
            "cannot_overfit",
            "the loss on one repeated batch falls neither at your LR nor at 10x",
        ),
    ),
    check_overfit,
    fast=False,
)


LOSS_AT_INIT = Check(
    "loss_at_init",
    (Kind("loss_at_init", "the first loss is far from ln(number of classes)"),),
    check_loss_at_init,
)
