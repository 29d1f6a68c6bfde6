"""The optimizer's own rule, replayed: one call of the user's step watched around each
optimizer.step(), and each step done again on float32 copies by a fresh optimizer of the same
class (NOTE [the rule's update]); `update.applied` judges what the parameters received.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from isotrain.doctor.ground.calls import call_site
from isotrain.doctor.ground.context import CannotRun, Context, params_of

__all__ = ["LOW", "Rule", "Stepped", "judged", "norm", "rule"]

STEP_CALLS = 8  # calls followed to the first that runs optimizer.step()
BUDGET = 1 << 22  # parameter elements judged (each kept a few times: tens of MB at most)
LOW = (torch.float16, torch.bfloat16)

# NOTE [the rule's update]
# In the first call of the user's step (from examine's state) that runs optimizer.step(), the
# doctor keeps, at each step()'s pre-hook, every held parameter that has a dense gradient: its
# value, the gradient step() receives (and that .grad object with its version), the
# optimizer's state for it and each group's settings; at the post-hook its new value; after
# the call its final value. It then replays each step() on detached float32 copies: a fresh
# instance of the optimizer's class built from copies of the group dicts (each tensor once),
# given a copy of the state. The copy's change is the rule's update u. Nothing of the user's
# is stepped twice: the replay touches only its copies.


@dataclass
class Stepped:
    """One optimizer.step() of the judged call: what it received and what it did, by id(param)."""

    opt: torch.optim.Optimizer
    where: str  # the line that called step()
    settings: list[dict[str, Any]]  # each group's settings (params left out), as step() read them
    members: list[list[int]]  # each group's judged parameters, as listed (twice if twice)
    pre: dict[int, torch.Tensor]
    grad: dict[int, torch.Tensor]  # a float32 copy of the gradient step() received
    given: dict[int, tuple[torch.Tensor, int]]  # that .grad object itself, and its version
    state: dict[int, dict[str, Any]]  # a copy of the optimizer's state before the step
    post: dict[int, torch.Tensor] = field(default_factory=dict)
    kept: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # state shaped like p, after
    rule: dict[int, torch.Tensor] = field(default_factory=dict)  # u, float32
    error: str | None = None  # why the rule could not be replayed


@dataclass
class Rule:
    """The judged call: its steps, each judged parameter at its start and end, and names."""

    call: int
    steps: list[Stepped]
    start: dict[int, torch.Tensor]
    final: dict[int, torch.Tensor]
    names: dict[int, str]
    closure: bool = False
    sparse: list[str] = field(default_factory=list)  # held parameters with a sparse gradient


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return copy.deepcopy(value)


class _Watch:
    """The step hooks of the judged run: each step() of a held optimizer becomes a Stepped."""

    def __init__(self, ctx: Context) -> None:
        self.held: dict[int, torch.Tensor] = {}
        size = 0
        for o in ctx.optimizers:
            for g in o.param_groups:
                for p in g["params"]:
                    if id(p) not in self.held and size + p.numel() <= BUDGET:
                        self.held[id(p)] = p
                        size += p.numel()
        self.steps: list[Stepped] = []
        self.open: dict[int, Stepped | None] = {}
        self.depth: dict[int, int] = {}  # a subclass's step() calling super().step() hooks twice
        self.closure = False
        self.sparse: set[int] = set()
        self.uncopied: str | None = None

    def pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        depth = self.depth.get(id(opt), 0)
        self.depth[id(opt)] = depth + 1
        if depth:
            return
        rest = args[1:] if args and args[0] is opt else args
        if any(map(callable, rest)) or callable(kwargs.get("closure")):
            self.closure = True
        judged = {}
        for g in opt.param_groups:
            for p in g["params"]:
                grad = p.grad
                if id(p) not in self.held or grad is None:
                    continue
                if grad.layout != torch.strided:
                    self.sparse.add(id(p))
                else:
                    judged[id(p)] = p
        try:
            self.open[id(opt)] = self.record(opt, judged)
        except Exception as e:  # the doctor's copy failed: not the user's step's failure
            self.open[id(opt)] = None
            self.uncopied = (
                f"{type(opt).__name__}'s groups or state could not be copied "
                f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:80]})"
            )

    @torch.no_grad()
    def record(self, opt: torch.optim.Optimizer, judged: dict[int, Any]) -> Stepped:
        """What step() is about to apply: values, gradients, state and settings, copied."""
        groups = opt.param_groups
        return Stepped(
            opt,
            call_site()[0],
            [_copied({k: v for k, v in g.items() if k != "params"}) for g in groups],
            [[id(p) for p in g["params"] if id(p) in judged] for g in groups],
            {i: p.detach().clone() for i, p in judged.items()},
            {i: p.grad.detach().to(torch.float32, copy=True) for i, p in judged.items()},
            {i: (p.grad, p.grad._version) for i, p in judged.items()},
            {
                i: {k: _copied(v) for k, v in opt.state.get(p, {}).items()}
                for i, p in judged.items()
            },
        )

    def post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.depth[id(opt)] -= 1
        s = self.open.pop(id(opt), None) if not self.depth[id(opt)] else None
        if s is None:
            return
        for i in s.pre:
            p = self.held[i]
            s.post[i] = p.detach().clone()
            if p.dtype in LOW:  # a compensation buffer (Kahan summation) would be shaped like p
                state = opt.state.get(p, {}).values()
                s.kept[i] = [_copied(t) for t in state
                             if isinstance(t, torch.Tensor) and t.shape == p.shape]  # fmt: skip
        self.steps.append(s)


def _rebuilt(cls: type, groups: list[dict[str, Any]], defaults: dict[str, Any]) -> Any:
    """A fresh optimizer of `cls` over `groups`: from the groups alone, else with the defaults
    its constructor names too."""
    try:
        return cls(groups)
    except Exception:
        named = inspect.signature(cls).parameters
        return cls(groups, **{k: v for k, v in defaults.items() if k in named})


def _as_float(value: Any, dtype: torch.dtype) -> Any:
    """A copy of one state entry; in float32 where it holds a low-precision parameter's dtype."""
    value = _copied(value)
    if dtype in LOW and isinstance(value, torch.Tensor) and value.dtype == dtype:
        return value.float()
    return value


def _replay(s: Stepped) -> None:
    """Fill s.rule (or s.error): the same step on float32 copies, by the rule of s.opt's class."""
    copies = {i: t.float().clone() for i, t in s.pre.items()}
    groups = []
    for settings, members in zip(s.settings, s.members, strict=True):
        ids = list(dict.fromkeys(members))  # each tensor once: the rule, applied once
        if ids:
            groups.append({**_copied(settings), "params": [copies[i] for i in ids]})
    cls = type(s.opt)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fresh = _rebuilt(cls, groups, s.opt.defaults)
            for i, c in copies.items():
                c.grad = s.grad[i].clone()
                fresh.state[c] = {k: _as_float(v, s.pre[i].dtype) for k, v in s.state[i].items()}
            fresh.step()
    except Exception as e:
        first = (str(e).splitlines() or [""])[0][:100]
        s.error = (
            f"{cls.__name__} could not be rebuilt and stepped from its param_groups "
            f"({type(e).__name__}: {first})"
        )
        return
    s.rule = {i: c.detach() - s.pre[i].float() for i, c in copies.items()}


def rule(ctx: Context) -> Rule:
    """The judged call (cached on `ctx`), its steps replayed; CannotRun when no call of the
    first STEP_CALLS ran optimizer.step(), or the step raised before one did."""
    if "update rule" in ctx.cache:
        found = ctx.cache["update rule"]
        if isinstance(found, str):
            raise CannotRun(found)
        return found
    try:
        result = _judged_call(ctx)
    except CannotRun as e:
        ctx.cache["update rule"] = str(e)
        raise
    for s in result.steps:
        _replay(s)
    ctx.cache["update rule"] = result
    return result


def _judged_call(ctx: Context) -> Rule:
    model, opt = ctx.fresh()
    w = _Watch(ctx)
    handles = [o.register_step_pre_hook(w.pre) for o in ctx.optimizers]
    handles += [o.register_step_post_hook(w.post) for o in ctx.optimizers]
    try:
        for call in range(STEP_CALLS):
            start = {i: p.detach().clone() for i, p in w.held.items()}
            ctx.run_step(model, opt, ctx.batches[call % len(ctx.batches)])
            if w.steps or w.closure:
                break
    except Exception as e:  # the user's step failed: the call cannot be judged
        first = (str(e).splitlines() or [""])[0]
        raise CannotRun(f"your step raised {type(e).__name__}: {first}") from e
    finally:
        for h in handles:
            h.remove()
    if not w.steps and w.uncopied is not None:
        raise CannotRun(w.uncopied)
    if not w.steps and not w.closure:
        raise CannotRun(f"none of {STEP_CALLS} calls of your step from examine's state ran "
                        "optimizer.step() (gradient accumulation over more calls?)")  # fmt: skip
    names = {id(p): n for n, p in params_of(ctx.model).items()}
    final = {i: p.detach().clone() for i, p in w.held.items()}
    sparse = [names.get(i, "?") for i in w.sparse]
    return Rule(call, w.steps, start, final, names, w.closure, sparse)


def judged(ctx: Context) -> Rule:
    """The judged call, or CannotRun where it has nothing to compare: a closure, no gradient."""
    r = rule(ctx)
    if r.closure:
        raise CannotRun("optimizer.step(closure) evaluates the loss itself (LBFGS): its update "
                        "is its own line search, not one rule on one gradient")  # fmt: skip
    if not any(s.pre for s in r.steps):
        why = "every gradient step() received was sparse" if r.sparse else "no gradient"
        raise CannotRun(f"optimizer.step() ran with {why}: nothing to compare")
    return r


def norm(t: torch.Tensor) -> float:
    """|t|, in float64."""
    return float(t.double().norm())  # sync: the doctor's measurement
