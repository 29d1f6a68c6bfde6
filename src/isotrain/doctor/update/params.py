"""Parameters against the optimizers, and whether a step moves them at all.

Read-only checks compare the model's parameters with the optimizers' groups (by identity);
the probe step says which parameters a gradient reached, whether it was exactly zero, whether
the update still saw it, and which parameters changed; the watched calls of the update path
say which optimizers stepped with no gradient on anything they train.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from isotrain.doctor.ground.context import STAT_NORMS, CannotRun, Context, Probe, params_of
from isotrain.doctor.ground.finding import Finding, Severity
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.probe import probe, probe_ok
from isotrain.doctor.update.path import Starved, path
from isotrain.doctor.update.rule import LOW, rule

__all__ = ["LEARNING", "OPTIMIZER", "check_learning", "check_optimizer", "name_list"]

STEP_CALLS = 8  # calls of the step followed to the first that runs optimizer.step()
ZERO_STEPS = 4  # steps over which an exactly zero gradient must stay zero to be reported
_BIASED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def name_list(names: list[str]) -> str:
    """Up to three names, and how many more."""
    return ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")


def _held(ctx: Context) -> list[tuple[dict[str, Any], torch.Tensor]]:
    """(group, tensor) of every parameter the optimizers hold, duplicates included."""
    return [(g, p) for opt in ctx.optimizers for g in opt.param_groups for p in g["params"]]


def _twice_in(opt: torch.optim.Optimizer) -> set[int]:
    """The ids of tensors one optimizer lists more than once. A tensor two optimizers hold is
    judged by update_applied_twice, on whether both apply one gradient (update.applied)."""
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    return {i for i in ids if ids.count(i) > 1}


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
            "parameter_not_in_optimizer", "error", name_list(missing),
            f"{len(missing)} trainable parameter(s) are in no optimizer group: they never train",
            "build the optimizer after the last change to the model (a new head, a replaced "
            "layer, .to(device) of a copy), or optimizer.add_param_group({'params': [...]})",
        ))  # fmt: skip
    frozen = [name_of.get(id(p), "?") for _, p in held if not p.requires_grad]
    if frozen:
        out.append(_frozen(ctx, frozen))
    dup = sorted({name_of.get(i, "?") for opt in ctx.optimizers for i in _twice_in(opt)})
    if dup:
        out.append(Finding(
            "duplicate_parameter", "error", name_list(dup),
            f"{len(dup)} tensor(s) appear more than once in one optimizer's groups: each step "
            "updates them twice (and their weight decay differs by group)",
            "give each tensor to one group only (tied weights: list the shared tensor once)",
        ))  # fmt: skip
    decayed = [
        name_of.get(id(p), "?") for g, p in held if p.ndim < 2 and g.get("weight_decay", 0) > 0
    ]
    if decayed:
        out.append(Finding(
            "weight_decay_on_norm_or_bias", "info", name_list(decayed),
            f"weight decay applies to {len(decayed)} bias/norm parameter(s) (1-D tensors)",
            "put 1-D parameters in a group with weight_decay=0.0 (the usual GPT recipe)",
        ))  # fmt: skip
    return out


def _frozen(ctx: Context, frozen: list[str]) -> Finding:
    """frozen_parameter_in_optimizer: a warning when the step moves a frozen parameter
    (weight decay or momentum on a zero grad), info while its grad stays None (skipped)."""
    p = probe(ctx)
    moved = [n for n in frozen if n in p.changed]
    held = f"the optimizer holds {len(frozen)} parameter(s) with requires_grad=False"
    fix = (
        "build the optimizer from [p for p in model.parameters() if p.requires_grad]; "
        "isotrain.contexts.frozen freezes for a block and restores each flag"
    )
    if moved:
        return Finding(
            "frozen_parameter_in_optimizer", "warning", name_list(moved),
            f"{held}, and the step changed {len(moved)} of them: a zero gradient "
            "(zero_grad(set_to_none=False), or one left from before freezing) still gets "
            "weight decay and momentum",
            fix,
        )  # fmt: skip
    why = "their .grad stays None, so the optimizer skips them"
    if p.error is not None:
        why = f"whether a step moves them is unknown: your step raised {p.error}"
    where = name_list(frozen)
    return Finding("frozen_parameter_in_optimizer", "info", where, f"{held}; {why}", fix)


def check_learning(ctx: Context) -> list[Finding]:
    """unused_parameter and params_unchanged, from the probe step; unused_parameter is an
    error where an optimizer's every step found no gradient on what it trains (update.path)."""
    p = probe_ok(ctx)
    params = params_of(ctx.model)
    held = {id(t) for _, t in _held(ctx)}
    watched = path(ctx)
    out = [_starved(s, watched.calls) for s in watched.starved]
    named = {n for s in watched.starved for n in s.params}
    # a parameter trained every k-th call (a GAN's generator) is reached in another call
    used = p.got_grad | watched.reached | named
    unused = [n for n, t in params.items() if t.requires_grad and n not in used]
    if unused:
        # the watched calls follow what the optimizers hold; the probe's one call the rest
        calls = watched.calls if all(id(params[n]) in held for n in unused) else 1
        out.append(Finding(
            "unused_parameter", "warning", name_list(unused),
            f"{len(unused)} parameter(s) with requires_grad received no gradient in "
            f"{max(calls, 1)} call(s) of your step",
            "remove the unused module, or freeze it (requires_grad_(False)) if it is meant "
            "to stay; under DDP an unused parameter needs find_unused_parameters=True",
        ))  # fmt: skip
    return out + _unchanged(ctx, p, [n for n, t in params.items() if id(t) in held])


def _starved(s: Starved, calls: int) -> Finding:
    """unused_parameter at its error: an optimizer whose steps apply nothing."""
    held = (
        f"optimizer {s.index} ({s.name} over {name_list(s.params)}: {len(s.params)} "
        "parameter(s) with requires_grad)"
    )
    to = "; ".join(
        f"{len(v)} parameter(s) of optimizer {j} ({name_list(v)})" for j, v in s.reached.items()
    )
    seen = f"sent gradient to {to} and to none of these" if to else "reached no parameter at all"
    return Finding(
        "unused_parameter", "error", s.where,
        f"{held} ran step() {s.steps} time(s) in {calls} call(s) of your step, and no backward "
        "since its previous step gave any of them a gradient (.grad None or unchanged at each "
        f"step): it applied nothing, so they never train. The backward before its step (at "
        f"{s.backward_at}) {seen}: the loss it backwarded does not reach them",
        "find what cuts the path between these parameters and that loss, and remove it: a "
        ".detach() (a GAN's generator loss needs D(fake), not D(fake.detach())), a forward "
        "under torch.no_grad(), or a tensor rebuilt from .data, .item(), .tolist() or "
        "torch.tensor(...); loss.requires_grad_(True) only hides the same cut",
    )  # fmt: skip


def _unchanged(ctx: Context, p: Probe, held: list[str]) -> list[Finding]:
    """params_unchanged: a held parameter a gradient reached that the step did not move, by
    cause: its gradient cleared before the update, no learning rate, or an exact zero."""
    reached = [n for n in held if n in p.got_grad]
    still = [n for n in reached if n not in p.changed]
    lost = [n for n in still if n in p.lost_grad]
    kept = [n for n in still if n not in lost]
    normed = _bias_before_norm(ctx, ctx.fresh()[0]) if kept else {}
    redundant = [n for n in kept if n in normed]
    zero = [n for n in kept if n in p.zero_grad and n not in normed]
    rounded = _rounded(ctx) if kept else set()
    rest = [n for n in kept if n not in p.zero_grad and n not in normed and n not in rounded]
    out = []
    if redundant:
        out.append(Finding(
            "params_unchanged", "info", name_list(redundant),
            f"{len(redundant)} bias(es) feed a batch-statistics norm ({normed[redundant[0]]}), "
            "which subtracts each channel's mean: their gradient is zero by design (up to "
            "rounding), so they do not move",
            "redundant: build the layer with bias=False (the norm's own bias does the work)",
        ))  # fmt: skip

    def sev(names: list[str]) -> Severity:
        return "error" if len(names) == len(reached) else "warning"

    if lost:
        out.append(Finding(
            "params_unchanged", sev(lost), name_list(lost),
            f"{len(lost)} of {len(reached)} parameter(s) got a nonzero gradient in backward, "
            "but it was gone (None or zero) when optimizer.step() ran: nothing was applied",
            "call optimizer.zero_grad() before backward (or after optimizer.step()), never "
            "between backward and step",
        ))  # fmt: skip
    if rest:
        out += _not_moved(ctx, rest, sev(rest))
    return out + (_structural_zeros(ctx, zero) if zero else [])


def _rounded(ctx: Context) -> set[str]:
    """float16/bfloat16 parameters the optimizer's rule moves (update.rule): whether their
    update survives rounding is update_lost_to_rounding's to judge (a stochastic rounding
    leaves some of them where they were in one step, by design)."""
    try:
        r = rule(ctx)
    except CannotRun:
        return set()
    return {
        r.names.get(i, "?") for s in r.steps for i, u in s.rule.items()
        if s.pre[i].dtype in LOW and bool(u.count_nonzero())
    }  # fmt: skip


def _not_moved(ctx: Context, names: list[str], severity: Severity) -> list[Finding]:
    """params_unchanged for parameters with a nonzero gradient that the step left as they
    were, judged at the first call that runs optimizer.step() (NOTE [steps every k calls])."""
    found = _stepping_call(ctx)
    if found is None:
        return [Finding(
            "params_unchanged", "info", name_list(names),
            f"not checked: none of {STEP_CALLS} calls of your step from examine's state ran "
            "optimizer.step() (gradient accumulation over more calls?)",
            "-",
        )]  # fmt: skip
    call, changed = found
    still = [n for n in names if n not in changed]
    if not still:
        return []
    at = "optimizer.step()" if call == 1 else f"the optimizer.step() of call {call}"
    return [Finding(
        "params_unchanged", severity, name_list(still),
        f"{len(still)} parameter(s) had a nonzero gradient at {at} and did not change",
        "check the group's learning rate (0, or a schedule that starts at 0)",
    )]  # fmt: skip


# NOTE [steps every k calls]
# A loop that accumulates gradients over calls of its step (a call counter, Accelerate's
# accumulate) runs optimizer.step() on every k-th call only: the first call moves nothing, by
# design. The parameters are judged at the first call, from examine's state, that steps.
def _stepping_call(ctx: Context) -> tuple[int, set[str]] | None:
    """(the 1-based number of the first call that ran optimizer.step(), the parameters that
    call changed), over up to STEP_CALLS calls; None when no call stepped."""
    model, opt = ctx.fresh()
    params = params_of(model)
    stepped: list[bool] = []
    handles = [o.register_step_post_hook(lambda *_: stepped.append(True)) for o in ctx.optimizers]
    try:
        for i in range(STEP_CALLS):
            before = {n: p.detach().clone() for n, p in params.items()}
            ctx.run_step(model, opt, ctx.batches[i % len(ctx.batches)])
            if stepped:
                return i + 1, {n for n, p in params.items() if not torch.equal(p, before[n])}
    finally:
        for h in handles:
            h.remove()
    return None


def _structural_zeros(ctx: Context, names: list[str]) -> list[Finding]:
    """Parameters whose gradient was exactly zero: follow them over a few more steps (LoRA's
    A moves once B has); those that never move are reported."""
    model, opt = ctx.fresh()
    params = params_of(model)
    start = {n: params[n].detach().clone() for n in names}
    for i in range(ZERO_STEPS):
        ctx.run_step(model, opt, ctx.batches[i % len(ctx.batches)])
    stuck = [n for n in names if torch.equal(params[n].detach(), start[n])]
    if not stuck:
        return []
    return [Finding(
        "params_unchanged", "warning", name_list(stuck),
        f"{len(stuck)} parameter(s) got an exactly zero gradient in each of {ZERO_STEPS} "
        "steps over the examined batches: nothing reaches them through the loss",
        "look at what sits between them and the loss: a mask or multiply by 0, ReLUs that "
        "never fire, an expert no sample is routed to",
    )]  # fmt: skip


def _bias_before_norm(ctx: Context, model: nn.Module) -> dict[str, str]:
    """`{bias name: norm name}` for each Linear/Conv bias whose output feeds a BatchNorm or
    InstanceNorm directly (one forward with hooks)."""
    made: dict[int, tuple[str, torch.Tensor]] = {}  # id(output) -> (bias name, output kept alive)
    found: dict[str, str] = {}
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, _BIASED) and m.bias is not None:
            label = f"{name}.bias"

            def made_by(mod: nn.Module, a: Any, out: Any, label: str = label) -> None:
                made[id(out)] = (label, out)

            handles.append(m.register_forward_hook(made_by))
        elif isinstance(m, STAT_NORMS):

            def fed(mod: nn.Module, a: Any, label: str = name) -> None:
                if a and id(a[0]) in made:
                    found[made[id(a[0])][0]] = label

            handles.append(m.register_forward_pre_hook(fed))
    ctx.forward_once(model, handles)
    return found


OPTIMIZER = Check(
    "optimizer",
    (
        Kind("parameter_not_in_optimizer", "a trainable parameter the optimizer does not hold"),
        Kind("frozen_parameter_in_optimizer", "a step moves a parameter with requires_grad=False"),
        Kind("duplicate_parameter", "one tensor appears twice in the optimizer's groups"),
        Kind(
            "weight_decay_on_norm_or_bias",
            "weight decay applies to norm weights or biases (info)",
        ),
    ),
    check_optimizer,
)


LEARNING = Check(
    "learning",
    (
        Kind("unused_parameter", "a parameter with requires_grad receives no gradient"),
        Kind("params_unchanged", "a parameter the optimizer holds does not change in a step"),
    ),
    check_learning,
)
