"""The update path: a few calls of the user's step, watched for the order and the effect of
zero_grad, backward, clipping, GradScaler.scale/unscale_/step and optimizer.step.

NOTE [pending gradient]
A parameter an optimizer holds is *pending* from the moment a backward accumulates into its
.grad until an optimizer.step() (or GradScaler.step) that holds it runs: its gradient is then
*applied*. Pending state carries across calls (accumulation over calls), so the invariants
hold whatever the step's shape:
- a zero_grad that clears a pending gradient while no optimizer.step() has run and no parameter
  has moved since that backward (SAM's perturbation and LBFGS's line search move them: their
  gradients were read) throws a micro-batch away; it is reported when a later backward's
  gradient is then applied. A backward followed by a step was handed to that step, even one
  that moved nothing because the gradient reached none of its parameters (a GAN's generator
  step on D(fake.detach())): that is a starved step, not a discard;
- an optimizer is *starved* when none of its steps in the watched calls finds a gradient on a
  parameter it trains (no backward reached one since its last step, no .grad written by hand;
  what zero_grad, a clip or unscale_ write is no gradient), though a backward ran before one
  of them (since its last step or its own zero_grad): it applies nothing, the loss backwarded
  for it does not reach its parameters (a step with no backward before it is not judged);
- a clip acts on the applied gradient only over pending gradients, on tensors, after unscale_;
- the gradient step() receives is fitted as a * (what backward added since the last step) +
  b * (the gradient the last step applied): b = a when that gradient was never cleared
  (zero_grad missing, whatever the loss), b = 0 when it was.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from isotrain.doctor.ground.calls import call_site
from isotrain.doctor.ground.context import Context, params_of
from isotrain.doctor.ground.trace import TRACE_MAX, TRACE_MIN, nodes_below, patched

__all__ = ["Clip", "Discard", "Path", "Stale", "Starved", "path"]

_clip_grad = torch.nn.utils.clip_grad


@dataclass(frozen=True)
class Clip:
    """One clip_grad_norm_ / clip_grad_value_ call, and what its tensors held then."""

    call: int
    where: str
    given: int  # tensors it was given
    limit: float
    after_step: bool  # its gradients were applied by a step in this call, none pending since
    scale: float | None  # the GradScaler scale still in the pending gradients, if any


@dataclass(frozen=True)
class Discard:
    """A zero_grad that cleared pending gradients no step had applied."""

    call: int
    where: str
    params: int
    backwards: int  # the backward passes whose gradients it threw away


@dataclass(frozen=True)
class Stale:
    """A step whose gradient fits a * (added since the last step) + b * (applied then)."""

    call: int
    where: str
    a: float
    b: float
    residual: float
    left: float  # |b * applied then| / |received|


@dataclass(frozen=True)
class Starved:
    """An optimizer whose every watched step found no gradient on any parameter it trains."""

    index: int  # in examine's optimizers
    name: str  # its class
    where: str  # its first step after a backward
    params: list[str]  # the parameters with requires_grad it holds
    steps: int
    backward_at: str  # the last backward before that step
    reached: dict[int, list[str]]  # optimizer index -> its parameters that backward reached


@dataclass(frozen=True)
class _Step:
    """One optimizer.step() of a watched call, for the starved rule."""

    where: str
    fed: bool  # a parameter it trains got a gradient since its last step (backward, by hand)
    after_backward: bool  # a backward ran since its last step or its own zero_grad
    backward_at: str
    reached: frozenset[int]  # what that last backward reached


@dataclass
class Path:
    """What the watched calls did on the update path."""

    calls: int = 0
    clips: list[Clip] = field(default_factory=list)
    discards: list[Discard] = field(default_factory=list)  # followed by an applied gradient
    stale: list[Stale] = field(default_factory=list)
    starved: list[Starved] = field(default_factory=list)
    reached: set[str] = field(default_factory=set)  # held parameters any backward reached
    closure: bool = False
    error: str | None = None


def _norm2(ts: list[torch.Tensor]) -> float:
    return float(sum(t.double().pow(2).sum() for t in ts)) if ts else 0.0  # sync: the doctor's


def _dot(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> float:
    return float(sum((x.double() * y.double()).sum() for x, y in zip(xs, ys, strict=True)))


def _grad_state(p: torch.Tensor) -> tuple[int, int] | None:
    """Which .grad a parameter holds and its version: a write to it changes this."""
    return None if p.grad is None else (id(p.grad), p.grad._version)


class _Watch:
    """The hooks and patches of one watched run; they write into `path`."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.path = Path()
        self.call = 0
        self.owner = {id(p): o for o in ctx.optimizers for g in o.param_groups for p in g["params"]}
        self.params = {id(p): p for o in ctx.optimizers for g in o.param_groups
                       for p in g["params"]}  # fmt: skip
        self.pending: dict[int, tuple[int, int, int]] = {}  # id(param) -> (backward, moved, steps)
        self.applied_now: set[int] = set()  # applied by a step in this call, not pending since
        self.backwards = 0
        self.for_inputs: set[int] = set()  # backwards that also reach a leaf no optimizer holds
        self.steps = 0  # optimizer steps so far: a gradient pending across one was handed to it
        self.index = {id(o): i for i, o in enumerate(ctx.optimizers)}
        self.trains = [[id(p) for g in o.param_groups for p in g["params"] if p.requires_grad]
                       for o in ctx.optimizers]  # fmt: skip
        self.trained_by: dict[int, list[int]] = {}  # id(param) -> the optimizers training it
        for i, pids in enumerate(self.trains):
            for pid in dict.fromkeys(pids):
                self.trained_by.setdefault(pid, []).append(i)
        self.fed: set[int] = set()  # optimizers a gradient reached since their last step
        self.window: dict[int, int] = {}  # optimizer -> backwards at its last step or zero_grad
        self.last_backward: tuple[str, set[int]] = ("", set())  # its line, what it reached
        self.stepped: dict[int, list[_Step]] = {}
        self.reached: set[int] = set()  # every held parameter a backward reached
        self.grad_was = {pid: _grad_state(p) for pid, p in self.params.items()}  # at last step
        self.scale: float | None = None  # a scaled loss's scale, until the step applies it
        self.unscaled: set[int] = set()  # optimizers unscaled since their last step
        self.added: dict[int, torch.Tensor] = {}  # incoming gradients since the last step
        self.last: dict[int, torch.Tensor] = {}  # the gradient each param's last step applied
        self.thrown: dict[int, set[int]] = {}  # id(param) -> backward nos. thrown away
        self.thrown_at: list[tuple[int, str]] = []  # (call, zero_grad line) not yet followed up
        self.clipping = False  # inside a library's clip, whose own call is the one recorded

    def moved(self) -> int:
        """A count that changes whenever a held parameter is written in place."""
        return sum(p._version for p in self.params.values())

    # -- backward ------------------------------------------------------------------------
    def incoming(self, pid: int) -> Callable[[torch.Tensor], None]:
        def hook(g: torch.Tensor) -> None:
            prev = self.added.get(pid)
            g = g.detach()
            self.added[pid] = g.clone() if prev is None else prev + g

        return hook

    def accumulated(self, p: torch.Tensor) -> None:
        pid = id(p)
        self.pending[pid] = (self.backwards, self.moved(), self.steps)
        self.applied_now.discard(pid)
        self.fed.update(self.trained_by.get(pid, ()))
        self.last_backward[1].add(pid)
        self.reached.add(pid)

    def backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def patched(*args: Any, **kwargs: Any) -> Any:
            self.backwards += 1
            self.last_backward = (call_site()[0], set())
            roots = kwargs.get("tensors", args[0] if args else ())
            roots = [roots] if isinstance(roots, torch.Tensor) else list(roots)
            leaves = [getattr(n, "variable", None) for n in nodes_below(
                [getattr(t, "grad_fn", None) for t in roots]).values()]  # fmt: skip
            if any(v is not None and id(v) not in self.params for v in leaves):
                self.for_inputs.add(self.backwards)  # an input's gradient (FGSM, saliency)
            return original(*args, **kwargs)

        return patched

    def rewriting(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`original(...)`: what it writes into a .grad (zero_grad, a clip, unscale_) is no
        gradient an optimizer is fed (NOTE [pending gradient])."""
        states = {pid: _grad_state(p) for pid, p in self.params.items()}
        out = original(*args, **kwargs)
        for pid, p in self.params.items():
            if (state := _grad_state(p)) != states[pid]:
                self.grad_was[pid] = state
        return out

    # -- zero_grad -----------------------------------------------------------------------
    def zero_grad(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def patched(obj: Any, *args: Any, **kwargs: Any) -> Any:
            if id(obj) in self.index:
                self.window[self.index[id(obj)]] = self.backwards
            held = {pid: self.params[pid].grad for pid in self.pending}
            seen = {pid: (id(g), g._version) for pid, g in held.items() if g is not None}
            out = self.rewriting(original, obj, *args, **kwargs)
            now, thrown = self.moved(), False
            cleared = [
                pid for pid, (gid, version) in seen.items()
                if (g := self.params[pid].grad) is None or (id(g), g._version) != (gid, version)
            ]  # fmt: skip
            for pid in cleared:
                backward, moved, steps = self.pending.pop(pid)
                self.added.pop(pid, None)
                if moved == now and steps == self.steps and backward not in self.for_inputs:
                    self.thrown.setdefault(pid, set()).add(backward)
                    thrown = True
            if thrown:
                self.thrown_at.append((self.call, call_site()[0]))
            return out

        return patched

    # -- clipping ------------------------------------------------------------------------
    def clipped(self, params: Any, limit: Any) -> None:
        ps = [params] if isinstance(params, torch.Tensor) else list(params)
        ids = {id(p) for p in ps}
        pending = ids & self.pending.keys()
        after = not pending and bool(ids & self.applied_now)
        owners = {id(self.owner[i]) for i in pending if i in self.owner}
        scale = self.scale if pending and owners - self.unscaled else None
        self.path.clips.append(Clip(self.call, call_site()[0], len(ps), float(limit), after, scale))

    def clip_norm(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def patched(parameters: Any, max_norm: Any, *args: Any, **kwargs: Any) -> Any:
            parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            if not self.clipping:
                self.clipped(parameters, max_norm)
            return self.rewriting(original, parameters, max_norm, *args, **kwargs)

        return patched

    def library_clip(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """A library's clip_grad_norm_ (accelerate's): recorded as the user called it, since on
        an empty iterable it calls no torch clip at all."""

        def patched(owner: Any, parameters: Any, max_norm: Any, *args: Any, **kwargs: Any) -> Any:
            parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            self.clipped(parameters, max_norm)
            self.clipping = True
            try:
                return original(owner, parameters, max_norm, *args, **kwargs)
            finally:
                self.clipping = False

        return patched

    def clip_value(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def patched(parameters: Any, clip_value: Any, *args: Any, **kwargs: Any) -> Any:
            parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            self.clipped(parameters, clip_value)
            return self.rewriting(original, parameters, clip_value, *args, **kwargs)

        return patched

    # -- the scaler ----------------------------------------------------------------------
    def scaled(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def patched(scaler: Any, outputs: Any) -> Any:
            if scaler.is_enabled():
                self.scale = float(scaler.get_scale())  # sync: the doctor's measurement
            return original(scaler, outputs)

        return patched

    def unscale(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def patched(scaler: Any, optimizer: Any) -> Any:
            self.unscaled.add(id(optimizer))
            return self.rewriting(original, scaler, optimizer)

        return patched

    def scaler_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def patched(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(scaler, optimizer, *args, **kwargs)
            self.steps += 1
            self.applied(optimizer)  # a step skipped for inf/NaN still used up its gradient
            return out

        return patched

    # -- optimizer.step ------------------------------------------------------------------
    def pre_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        rest = args[1:] if args and args[0] is opt else args
        if any(map(callable, rest)) or callable(kwargs.get("closure")):
            self.path.closure = True
        self.steps += 1
        i = self.index.get(id(opt))
        if i is not None:  # a .grad written by hand since its last step (not by zero_grad)
            written = [p for p in self.trains[i] if _grad_state(self.params[p]) != self.grad_was[p]]
            self.reached.update(written)
            if written:
                self.fed.add(i)
        self.fit(opt)
        self.applied(opt)

    def applied(self, opt: Any) -> None:
        mine = [id(p) for g in opt.param_groups for p in g["params"]]
        used = [pid for pid in mine if pid in self.pending]
        if used and self.thrown_at:
            self.follow_up(used)
        for pid in used:
            del self.pending[pid]
            self.applied_now.add(pid)
        self.unscaled.discard(id(opt))
        if not self.pending:
            self.scale = None

    def follow_up(self, used: list[int]) -> None:
        """A step applies pending gradients after a zero_grad threw earlier ones away, and only
        what the backwards after it added (a gradient combined by hand read the thrown ones)."""
        thrown = [pid for pid in used if pid in self.thrown]
        if not thrown or not self.as_added(thrown):
            return
        backwards = len({n for pid in thrown for n in self.thrown[pid]})
        call, where = self.thrown_at[0]
        self.path.discards.append(Discard(call, where, len(thrown), backwards))
        for pid in thrown:
            del self.thrown[pid]
        self.thrown_at.clear()

    def as_added(self, pids: list[int]) -> bool:
        """Whether the parameters' .grads point where the backwards since their last step
        added (a clip or unscale_ only scales them; a gradient combined by hand with the thrown
        ones does not), or it cannot be told (no gradient seen arrive)."""
        got, new = [], []
        for pid in pids:
            grad, added = self.params[pid].grad, self.added.get(pid)
            if grad is not None and added is not None:
                got.append(grad.detach())
                new.append(added)
        norms = _norm2(got) * _norm2(new)
        return norms == 0 or _dot(got, new) >= 0.999 * math.sqrt(norms)

    def post_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        i = self.index.get(id(opt))
        if i is not None and self.trains[i]:
            line, reached = self.last_backward
            after = self.backwards > self.window.get(i, 0)
            step = _Step(call_site()[0], i in self.fed, after, line, frozenset(reached))
            self.stepped.setdefault(i, []).append(step)
            self.fed.discard(i)
            self.window[i] = self.backwards
            for pid in self.trains[i]:
                self.grad_was[pid] = _grad_state(self.params[pid])
        for g in opt.param_groups:
            for p in g["params"]:
                self.added.pop(id(p), None)
                if p.grad is not None:
                    self.last[id(p)] = p.grad.detach().clone()

    def starved(self) -> list[Starved]:
        """The optimizers whose every step found no gradient on what they train, though a
        backward ran before one of them (NOTE [pending gradient])."""
        names = {id(p): n for n, p in params_of(self.ctx.model).items()}
        out = []
        for i, steps in self.stepped.items():
            first = next((s for s in steps if s.after_backward), None)
            if first is None or any(s.fed for s in steps):
                continue
            reached = {
                j: [names.get(pid, "?") for pid in dict.fromkeys(pids) if pid in first.reached]
                for j, pids in enumerate(self.trains)
            }
            reached = {j: v for j, v in reached.items() if v}
            opt = self.ctx.optimizers[i]
            params = [names.get(pid, "?") for pid in dict.fromkeys(self.trains[i])]
            out.append(Starved(i, type(opt).__name__, first.where, params, len(steps),
                               first.backward_at, reached))  # fmt: skip
        return out

    def fit(self, opt: Any) -> None:
        """Fit the gradient step() receives (NOTE [pending gradient])."""
        ps = [p for g in opt.param_groups for p in g["params"]]
        use = [p for p in ps if p.grad is not None and id(p) in self.added and id(p) in self.last]
        if not use:
            return
        got = [p.grad.detach() for p in use]
        new = [self.added[id(p)] for p in use]
        old = [self.last[id(p)] for p in use]
        gg, nn_, oo, no = _norm2(got), _norm2(new), _norm2(old), _dot(new, old)
        gn, go = _dot(got, new), _dot(got, old)
        det = nn_ * oo - no * no
        if gg <= 0 or nn_ <= 0 or oo <= 0 or det <= 1e-9 * nn_ * oo:
            return
        a, b = (gn * oo - go * no) / det, (go * nn_ - gn * no) / det
        res = gg - 2 * (a * gn + b * go) + a * a * nn_ + 2 * a * b * no + b * b * oo
        residual = math.sqrt(max(res, 0.0) / gg)
        left = abs(b) * math.sqrt(oo / gg)
        where = call_site()[0]
        self.path.stale.append(Stale(self.call, where, a, b, residual, left))


def path(ctx: Context) -> Path:
    """The watched calls (cached on `ctx`): min(8, max(3, len(batches))) calls of the step."""
    if "update path" in ctx.cache:
        return ctx.cache["update path"]
    model, opt = ctx.fresh()
    w = _Watch(ctx)
    n = min(TRACE_MAX, max(TRACE_MIN, len(ctx.batches)))
    handles = []
    for pid, p in w.params.items():
        if p.requires_grad:
            handles.append(p.register_hook(w.incoming(pid)))
            handles.append(p.register_post_accumulate_grad_hook(w.accumulated))
    for o in ctx.optimizers:
        handles.append(o.register_step_pre_hook(w.pre_step))
        handles.append(o.register_step_post_hook(w.post_step))
    scaler = torch.amp.GradScaler
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(patched(torch.autograd, "backward", w.backward))
            stack.enter_context(patched(torch.optim.Optimizer, "zero_grad", w.zero_grad))
            stack.enter_context(patched(torch.nn.Module, "zero_grad", w.zero_grad))
            stack.enter_context(patched(_clip_grad, "_clip_grads_with_norm_", w.clip_norm))
            stack.enter_context(patched(torch.nn.utils, "clip_grads_with_norm_", w.clip_norm))
            if (accelerate := sys.modules.get("accelerate")) is not None:
                owner = accelerate.Accelerator
                stack.enter_context(patched(owner, "clip_grad_norm_", w.library_clip))
            for where in (_clip_grad, torch.nn.utils):
                stack.enter_context(patched(where, "clip_grad_value_", w.clip_value))
            stack.enter_context(patched(scaler, "scale", w.scaled))
            stack.enter_context(patched(scaler, "unscale_", w.unscale))
            stack.enter_context(patched(scaler, "step", w.scaler_step))
            for i in range(n):
                w.call = i
                w.applied_now.clear()
                ctx.run_step(model, opt, ctx.batches[i % len(ctx.batches)])
                w.path.calls += 1
    except Exception as e:  # the user's step failed: the checks that need it say so
        w.path.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        for h in handles:
            h.remove()
    w.path.starved = w.starved()
    w.path.reached = {n for n, p in params_of(ctx.model).items() if id(p) in w.reached}
    ctx.cache["update path"] = w.path
    return w.path
