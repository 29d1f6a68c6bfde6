"""Parameters against the optimizer, and whether training moves them at all.

Read-only checks compare the model's parameters with the optimizer's groups (by identity);
the probe step says which parameters a gradient reached and which changed; a few dozen
steps on one repeated batch say whether the loss can fall at all.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from isotrain.doctor._context import CannotRun, Context, as_loss, params_of
from isotrain.doctor._finding import Finding, Severity
from isotrain.doctor._probe import probe_ok

__all__ = ["check_learning", "check_loss_at_init", "check_optimizer", "check_overfit"]

OVERFIT_STEPS = 30


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")


def _held(ctx: Context) -> list[tuple[dict[str, Any], torch.Tensor]]:
    """(group, tensor) of every parameter the optimizers hold, duplicates included."""
    return [(g, p) for opt in ctx.optimizers for g in opt.param_groups for p in g["params"]]


def check_optimizer(ctx: Context) -> list[Finding]:
    """parameter_not_in_optimizer, frozen_parameter_in_optimizer, duplicate_parameter,
    weight_decay_on_norm_or_bias: the model's parameters against the optimizer's groups."""
    params = params_of(ctx.model)
    name_of = {id(p): n for n, p in params.items()}
    held = _held(ctx)
    ids = [id(p) for _, p in held]
    out = []
    missing = [n for n, p in params.items() if p.requires_grad and id(p) not in set(ids)]
    if missing:
        out.append(Finding(
            "parameter_not_in_optimizer", "error", _names(missing),
            f"{len(missing)} trainable parameter(s) are in no optimizer group: they never train",
            "build the optimizer after the last change to the model (a new head, a replaced "
            "layer, .to(device) of a copy), or optimizer.add_param_group({'params': [...]})",
        ))  # fmt: skip
    frozen = [name_of.get(id(p), "?") for _, p in held if not p.requires_grad]
    if frozen:
        out.append(Finding(
            "frozen_parameter_in_optimizer", "warning", _names(frozen),
            f"the optimizer holds {len(frozen)} parameter(s) with requires_grad=False",
            "build the optimizer from [p for p in model.parameters() if p.requires_grad]; "
            "isotrain.contexts.frozen freezes for a block and restores each flag",
        ))  # fmt: skip
    dup = sorted({name_of.get(i, "?") for i in ids if ids.count(i) > 1})
    if dup:
        out.append(Finding(
            "duplicate_parameter", "error", _names(dup),
            f"{len(dup)} tensor(s) appear more than once in the optimizer's groups: each step "
            "updates them twice (and their weight decay differs by group)",
            "give each tensor to one group only (tied weights: list the shared tensor once)",
        ))  # fmt: skip
    decayed = [
        name_of.get(id(p), "?") for g, p in held if p.ndim < 2 and g.get("weight_decay", 0) > 0
    ]
    if decayed:
        out.append(Finding(
            "weight_decay_on_norm_or_bias", "info", _names(decayed),
            f"weight decay applies to {len(decayed)} bias/norm parameter(s) (1-D tensors)",
            "put 1-D parameters in a group with weight_decay=0.0 (the usual GPT recipe)",
        ))  # fmt: skip
    return out


def check_learning(ctx: Context) -> list[Finding]:
    """unused_parameter and params_unchanged, from the probe step."""
    p = probe_ok(ctx)
    params = params_of(ctx.model)
    held = {id(t) for _, t in _held(ctx)}
    out = []
    unused = [n for n, t in params.items() if t.requires_grad and n not in p.got_grad]
    if unused:
        out.append(Finding(
            "unused_parameter", "warning", _names(unused),
            f"{len(unused)} parameter(s) with requires_grad received no gradient in a step",
            "remove the unused module, or freeze it (requires_grad_(False)) if it is meant "
            "to stay; under DDP an unused parameter needs find_unused_parameters=True",
        ))  # fmt: skip
    still = [
        n for n, t in params.items()
        if id(t) in held and n in p.got_grad and n not in p.changed
    ]  # fmt: skip
    if still:
        reached = len([n for n, t in params.items() if id(t) in held and n in p.got_grad])
        sev: Severity = "error" if len(still) == reached else "warning"
        out.append(Finding(
            "params_unchanged", sev, _names(still),
            f"{len(still)} of {reached} parameter(s) that got a gradient did not change in a "
            "step (gradients zeroed before optimizer.step()? learning rate 0?)",
            "call optimizer.zero_grad() before backward (or after optimizer.step()), never "
            "between backward and step; check the group's lr",
        ))  # fmt: skip
    return out


def check_overfit(ctx: Context) -> list[Finding]:
    """cannot_overfit: a few dozen steps on one repeated batch must lower its loss."""
    probe_ok(ctx)
    model, opt = ctx.fresh()
    losses = []
    for _ in range(OVERFIT_STEPS):
        value = as_loss(ctx.run_step(model, opt, ctx.batches[0]))
        if value is None:
            raise CannotRun("the step returns no loss tensor to follow")
        losses.append(float(value.detach().float().mean()))  # sync: the doctor, not the step
    first, last = losses[0], min(losses[-3:])
    if not math.isfinite(last) or last > 0.9 * first:
        return [Finding(
            "cannot_overfit", "warning", "your step",
            f"loss on one repeated batch went {first:.4g} -> {last:.4g} in {OVERFIT_STEPS} "
            "steps: a model that cannot memorise one batch will not learn the data",
            "check the learning rate (typo? a schedule at 0?), that the loss reaches the "
            "parameters, and that targets match inputs (no double softmax before the loss)",
        )]  # fmt: skip
    return []


def _classes(ctx: Context, model: nn.Module) -> int:
    args, kwargs = ctx.split(ctx.batches[0])
    with torch.no_grad():
        logits = ctx.outputs(model, args, kwargs)
    return int(logits.shape[-1])


def check_loss_at_init(ctx: Context) -> list[Finding]:
    """loss_at_init: for lm/classification, the first loss against ln(number of classes)."""
    if ctx.task not in ("lm", "classification"):
        raise CannotRun('needs task="lm" or task="classification" to know the expected loss')
    p = probe_ok(ctx)
    if p.loss is None:
        raise CannotRun("the step returns no loss tensor")
    model, _ = ctx.fresh()
    n = _classes(ctx, model)
    expected = math.log(n)
    if not math.isfinite(p.loss) or abs(p.loss - expected) > max(0.5, 0.25 * expected):
        return [Finding(
            "loss_at_init", "warning", "your step",
            f"first loss {p.loss:.4g}, expected about ln({n}) = {expected:.4g} for a model "
            "that starts out guessing uniformly",
            "initialise the output layer small (std ~0.02, or zeros), check the targets "
            "(shifted by one for a language model, class indices for classification)",
        )]  # fmt: skip
    return []
