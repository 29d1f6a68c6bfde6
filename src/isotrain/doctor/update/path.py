"""The update path: a few calls of the user's step, watched for the order and the effect of
zero_grad, backward, clipping, GradScaler.scale/unscale_/step and optimizer.step.

NOTE [pending gradient]
A parameter an optimizer holds is *pending* from the moment a backward accumulates into its
.grad until an optimizer.step() (or GradScaler.step) that holds it runs: its gradient is then
*applied*. Pending state carries across calls (accumulation over calls), so the invariants
hold whatever the step's shape:
- a zero_grad that clears a pending gradient while no parameter has moved since that backward
  (SAM's perturbation and LBFGS's line search move them: their gradients were read) throws a
  micro-batch away; it is reported when a later backward's gradient is then applied;
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
from isotrain.doctor.ground.context import Context
from isotrain.doctor.ground.trace import TRACE_MAX, TRACE_MIN, patched

__all__ = ["Clip", "Discard", "Path", "Stale", "path"]

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


@dataclass
class Path:
    """What the watched calls did on the update path."""

    calls: int = 0
    clips: list[Clip] = field(default_factory=list)
    discards: list[Discard] = field(default_factory=list)  # followed by an applied gradient
    stale: list[Stale] = field(default_factory=list)
    closure: bool = False
    error: str | None = None


def _norm2(ts: list[torch.Tensor]) -> float:
    return float(sum(t.double().pow(2).sum() for t in ts)) if ts else 0.0  # sync: the doctor's


def _dot(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> float:
    return float(sum((x.double() * y.double()).sum() for x, y in zip(xs, ys, strict=True)))


class _Watch:
    """The hooks and patches of one watched run; they write into `path`."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.path = Path()
        self.call = 0
        self.owner = {id(p): o for o in ctx.optimizers for g in o.param_groups for p in g["params"]}
        self.params = {id(p): p for o in ctx.optimizers for g in o.param_groups
                       for p in g["params"]}  # fmt: skip
        self.pending: dict[int, tuple[int, int]] = {}  # id(param) -> (backward no., moved)
        self.applied_now: set[int] = set()  # applied by a step in this call, not pending since
        self.backwards = 0
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
        self.pending[pid] = (self.backwards, self.moved())
        self.applied_now.discard(pid)

    def backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def patched(*args: Any, **kwargs: Any) -> Any:
            self.backwards += 1
            return original(*args, **kwargs)

        return patched

    # -- zero_grad -----------------------------------------------------------------------
    def zero_grad(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def patched(obj: Any, *args: Any, **kwargs: Any) -> Any:
            held = {pid: self.params[pid].grad for pid in self.pending}
            seen = {pid: (id(g), g._version) for pid, g in held.items() if g is not None}
            out = original(obj, *args, **kwargs)
            now, thrown = self.moved(), False
            cleared = [
                pid for pid, (gid, version) in seen.items()
                if (g := self.params[pid].grad) is None or (id(g), g._version) != (gid, version)
            ]  # fmt: skip
            for pid in cleared:
                backward, moved = self.pending.pop(pid)
                self.added.pop(pid, None)
                if moved == now:
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
            return original(parameters, max_norm, *args, **kwargs)

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
            return original(parameters, clip_value, *args, **kwargs)

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
            return original(scaler, optimizer)

        return patched

    def scaler_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def patched(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(scaler, optimizer, *args, **kwargs)
            self.applied(optimizer)  # a step skipped for inf/NaN still used up its gradient
            return out

        return patched

    # -- optimizer.step ------------------------------------------------------------------
    def pre_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        rest = args[1:] if args and args[0] is opt else args
        if any(map(callable, rest)) or callable(kwargs.get("closure")):
            self.path.closure = True
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
        """A step applies pending gradients after a zero_grad threw earlier ones away."""
        thrown = [pid for pid in used if pid in self.thrown]
        if not thrown:
            return
        backwards = len({n for pid in thrown for n in self.thrown[pid]})
        call, where = self.thrown_at[0]
        self.path.discards.append(Discard(call, where, len(thrown), backwards))
        for pid in thrown:
            del self.thrown[pid]
        self.thrown_at.clear()

    def post_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        for g in opt.param_groups:
            for p in g["params"]:
                self.added.pop(id(p), None)
                if p.grad is not None:
                    self.last[id(p)] = p.grad.detach().clone()

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
    ctx.cache["update path"] = w.path
    return w.path
