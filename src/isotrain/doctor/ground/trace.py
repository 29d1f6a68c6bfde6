"""The trace: a few calls of the user's own step, watched for what crosses from one to the next.

Each call is watched by the call watch (loss calls, graphs, autocast), an optimizer step
pre-hook (the gradient `step()` sees, the learning rate), `torch.autograd.backward` (how many
micro-batches, and the doctor's own reference gradient of each micro-batch's loss), the LR
schedulers' `step` and `GradScaler.scale`; after each call the autograd graph still alive is
counted. NOTE [reference gradient] says how the gradient is judged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from isotrain.doctor.ground.calls import CallWatch, call_site, watching_calls
from isotrain.doctor.ground.context import CannotRun, Context

__all__ = [
    "Fit",
    "StepTrace",
    "Trace",
    "graph_alive",
    "nodes_below",
    "patched",
    "trace",
    "trace_ok",
]

# NOTE [reference gradient]
# Before each backward of the user's step the doctor differentiates the loss the step just
# computed (the last mean-reduced loss-function output, e.g. F.cross_entropy's) itself, with
# torch.autograd.grad (retain_graph=True; nothing accumulates into .grad). Their mean over the
# micro-batches of one optimizer step is the fresh mean gradient of those samples, g_ref. The
# gradient the user accumulated at the end of the last backward, g_acc (before any clipping or
# unscaling), is then fitted as a * g_ref + b * g_before, g_before being the .grad the call
# started from: a = 1, b = 0 for a correct step; b = 1 when the previous step's gradient is
# still in .grad (zero_grad missing); a = k or 1/k when k micro-batch losses are not divided
# by k, or divided twice. A GradScaler's scale is divided out of a; a poor fit (other terms in
# the loss, a gradient hook) concludes nothing. The first two calls get a reference: the
# second is the first to start from a step's leftover .grad.

TRACE_MIN, TRACE_MAX = 3, 8
REFERENCE_CALLS = 2  # the calls with a reference gradient: the first, and one after a step


@dataclass(frozen=True)
class Fit:
    """g_acc ~ a * g_ref + b * g_before, and the relative residual of that fit."""

    a: float
    b: float
    residual: float
    before_norm: float  # |g_before| / |g_ref|


@dataclass
class StepTrace:
    """What one call of the user's step did."""

    index: int
    optimizer_steps: int = 0
    closure: bool = False
    lrs: list[float] = field(default_factory=list)  # each group's lr at the first step()
    references: int = 0  # backward calls whose loss the doctor differentiated
    scale: float = 1.0  # the GradScaler scale of its backward, if any
    fit: Fit | None = None
    graph_nodes: int = 0  # autograd nodes reachable from tensors alive after the call
    retained: list[str] = field(default_factory=list)  # lines that made those tensors
    schedulers: dict[str, tuple[str, int]] = field(default_factory=dict)  # line -> (class, n)
    step_at: str = "your step"  # the line that called optimizer.step()
    backward_at: str = "your step"  # the line of the last backward


@dataclass
class Trace:
    """The calls of the trace, their call watch, the learning rate after the last one."""

    steps: list[StepTrace]
    watch: CallWatch
    error: str | None
    lrs_after: list[float]
    reference_error: str | None = None


def _dot(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> float:
    """sum_i <a_i, b_i> over the tensors both lists hold (float32 dots, summed on the device)."""
    dots = [
        torch.dot(x.detach().reshape(-1).float(), y.detach().reshape(-1).float())
        for x, y in zip(a, b, strict=True) if x is not None and y is not None
    ]  # fmt: skip
    return float(torch.stack(dots).double().sum()) if dots else 0.0  # sync: the doctor's


class _Grads:
    """The gradient bookkeeping of one call (NOTE [reference gradient])."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.before = [None if p.grad is None else p.grad.detach().clone() for p in params]
        self.ref: list[torch.Tensor | None] = [None] * len(params)
        self.n = 0
        self.fit: Fit | None = None

    def add_reference(self, loss: torch.Tensor) -> None:
        wanted = [p for p in self.params if p.requires_grad]
        got = iter(torch.autograd.grad(loss, wanted, retain_graph=True, allow_unused=True))
        for i, p in enumerate(self.params):
            g = next(got) if p.requires_grad else None
            r = self.ref[i]
            if g is not None:
                self.ref[i] = g.detach() if r is None else r + g.detach()
        self.n += 1

    def measure(self) -> None:
        """Fit the gradient accumulated now against the reference and the starting .grad."""
        if not self.n:
            return
        acc = [p.grad for p in self.params]
        ref = [None if r is None else r / self.n for r in self.ref]
        rr, bb, rb = _dot(ref, ref), _dot(self.before, self.before), _dot(ref, self.before)
        ar, ab, aa = _dot(acc, ref), _dot(acc, self.before), _dot(acc, acc)
        if rr <= 0 or aa <= 0:
            return
        det = rr * bb - rb * rb
        if bb > 1e-12 * rr and det > 1e-9 * rr * bb:
            a, b = (ar * bb - ab * rb) / det, (ab * rr - ar * rb) / det
        else:
            a, b = ar / rr, 0.0
        res = aa - 2 * (a * ar + b * ab) + a * a * rr + 2 * a * b * rb + b * b * bb
        self.fit = Fit(a, b, (max(res, 0.0) / aa) ** 0.5, (bb / rr) ** 0.5)


def graph_alive(watch: CallWatch) -> tuple[int, list[str]]:
    """Autograd nodes reachable from the tensors the step made that are still alive, and the
    lines that made them."""
    roots, lines = alive_roots(watch)
    return len(nodes_below(roots)), lines


def alive_roots(watch: CallWatch) -> tuple[list[Any], list[str]]:
    """The grad_fn of each tensor the call watch saw made that is still alive with a graph,
    and the line that made it (the dead ones forgotten)."""
    roots, lines = [], []
    for key, (ref, line) in list(watch.graphs.items()):
        t = ref()
        if t is None or t.grad_fn is None:
            del watch.graphs[key]
            continue
        roots.append(t.grad_fn)
        lines.append(line)
    return roots, lines


def nodes_below(roots: list[Any]) -> dict[int, Any]:
    """Every autograd node reachable from the nodes `roots` (None ones skipped), by id: held in
    the dict until counted, so ids stay unique."""
    seen: dict[int, Any] = {}
    todo = [r for r in roots if r is not None]
    while todo:
        node = todo.pop()
        if id(node) not in seen:
            seen[id(node)] = node
            todo.extend(n for n, _ in node.next_functions if n is not None)
    return seen


@contextlib.contextmanager
def patched(owner: Any, name: str, make: Callable[[Any], Any]) -> Iterator[None]:
    """`owner.name` replaced by `make(original)` inside the block, put back after it (a class's
    own attribute: a subclass that does not define `name` is patched through its base)."""
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _scheduler_classes() -> list[type]:
    out: list[type] = []
    todo: list[type] = [torch.optim.lr_scheduler.LRScheduler]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if "step" in cls.__dict__:
            out.append(cls)
    return out


class _Tracer:
    """Runs the calls; the hooks write into the StepTrace of the call in progress."""

    def __init__(self, ctx: Context, model: torch.nn.Module, opt: Any) -> None:
        self.ctx, self.model, self.opt = ctx, model, opt  # opt: what the step is given
        groups = [g for o in ctx.optimizers for g in o.param_groups]
        self.groups = groups
        self.params = list({id(p): p for g in groups for p in g["params"]}.values())
        self.watch = CallWatch()
        self.now = StepTrace(0)
        self.grads = _Grads(self.params)
        self.reference_error: str | None = None

    def pre_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        s = self.now
        s.optimizer_steps += 1
        rest = args[1:] if args and args[0] is opt else args  # the hook gets step's self too
        s.closure = s.closure or any(map(callable, rest)) or callable(kwargs.get("closure"))
        if s.optimizer_steps == 1:
            s.lrs = [float(g["lr"]) for g in self.groups]
            s.step_at = call_site()[0]

    def backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def patched(*args: Any, **kwargs: Any) -> Any:
            loss, self.watch.last_loss = self.watch.last_loss, None
            wanted = self.now.index < REFERENCE_CALLS and self.now.optimizer_steps == 0
            if loss is not None and wanted and self.reference_error is None:
                try:
                    self.grads.add_reference(loss)
                except RuntimeError as e:  # e.g. reentrant checkpointing refuses .grad()
                    self.reference_error = str(e).splitlines()[0]
            del loss
            out = original(*args, **kwargs)
            self.now.backward_at = call_site()[0]
            self.now.references = self.grads.n
            if self.now.optimizer_steps == 0 and self.reference_error is None:
                self.grads.measure()
            return out

        return patched

    def scheduler_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def patched(sched: Any, *args: Any, **kwargs: Any) -> Any:
            line = call_site()[0]
            n = self.now.schedulers.get(line, ("", 0))[1]
            self.now.schedulers[line] = (type(sched).__name__, n + 1)
            return original(sched, *args, **kwargs)

        return patched

    def scaled(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def patched(scaler: Any, outputs: Any) -> Any:
            if scaler.is_enabled():
                self.now.scale = float(scaler.get_scale())  # sync: the doctor's measurement
            return original(scaler, outputs)

        return patched

    def call(self, index: int) -> StepTrace:
        self.now, self.grads = StepTrace(index), _Grads(self.params)
        self.watch.step = index
        self.watch.softmax_at.clear()
        batch = self.ctx.batches[index % len(self.ctx.batches)]
        with watching_calls(self.watch, precision=index == 0):
            out = self.ctx.run_step(self.model, self.opt, batch)
            del out
        self.watch.last_loss = None
        self.now.fit = self.grads.fit
        self.now.graph_nodes, self.now.retained = graph_alive(self.watch)
        return self.now


def trace(ctx: Context) -> Trace:
    """The traced calls (cached on `ctx`): min(8, max(3, len(batches))) calls of the step."""
    if "trace" in ctx.cache:
        return ctx.cache["trace"]
    model, opt = ctx.fresh()
    t = _Tracer(ctx, model, opt)
    steps: list[StepTrace] = []
    error = None
    n = min(TRACE_MAX, max(TRACE_MIN, len(ctx.batches)))
    handles = [o.register_step_pre_hook(t.pre_step) for o in ctx.optimizers]
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(patched(torch.autograd, "backward", t.backward))
            stack.enter_context(patched(torch.amp.GradScaler, "scale", t.scaled))
            for cls in _scheduler_classes():
                stack.enter_context(patched(cls, "step", t.scheduler_step))
            for i in range(n):
                steps.append(t.call(i))
    except Exception as e:  # the user's step failed: the checks that need it say so
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        for h in handles:
            h.remove()
    lrs = [float(g["lr"]) for g in t.groups]
    result = Trace(steps, t.watch, error, lrs, t.reference_error)
    ctx.cache["trace"] = result
    return result


def trace_ok(ctx: Context) -> Trace:
    """The trace, or CannotRun when the user's step raised in it."""
    tr = trace(ctx)
    if tr.error is not None and not tr.steps:
        raise CannotRun(f"your step raised {tr.error}")
    return tr
