"""What each loss term of the user's step reaches: a few calls of the step, watched for the
torch.nn.functional losses a backward differentiates, the parameters each one's gradient
lands on, and whether a step then applied it (NOTE [loss terms]).

NOTE [loss terms]
Every loss-function call's output is recorded with the autograd node that made it. At each
backward, a term flows into it when the backward's graph holds that node; the parameters it
reaches are the AccumulateGrad leaves below the node (the graph is read, no extra backward
runs). A term with no graph (its inputs cut before the call: a .detach(), torch.no_grad(),
frozen parameters) is followed through the ops that use it, to the node of the first result
that has one. What a backward adds to a parameter is *applied* when a step of an optimizer
holding it runs before a zero_grad clears it; *lost* when a zero_grad clears it after some
step ran since that backward (the step was handed the gradient and did not hold the
parameter); *undecided* when a zero_grad clears it before any step (a SAM or PCGrad step read
it by hand; a discarded micro-batch is gradient_discarded's) or it is still pending when the
calls end. A term is *dead* in a backward that applied something else when every parameter
it reaches lost its gradient there, or it has no graph at all. It is not judged where it also
reaches a tensor no optimizer holds (an input whose .grad is read, a parameter in no
optimizer: parameter_not_in_optimizer's), passes a reentrant checkpoint (whose backward
reaches parameters its graph does not show), or its backward runs inside a step (LBFGS's
closure) or with inputs=. A backward that applied nothing is unused_parameter's to judge.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from isotrain.doctor.ground.calls import LOSS_FUNCTIONS, call_site
from isotrain.doctor.ground.context import Context, params_of
from isotrain.doctor.ground.trace import TRACE_MAX, TRACE_MIN, nodes_below, patched
from isotrain.doctor.ground.watch import DOCTOR_DIR, STDLIB_DIR, TORCH_DIR, short_path

__all__ = ["Backward", "Reach", "Term", "Use", "reach"]

_MAX_CONSTANTS = 4096  # no-graph tensors followed per call
_OPAQUE = "CheckpointFunctionBackward"  # a reentrant checkpoint: its parameters are hidden


@dataclass(frozen=True, eq=False)
class Term:
    """One loss-function call of a watched call."""

    name: str  # the loss function
    where: str  # the user's line
    chain: tuple[str, ...]  # the user's lines it was called through, innermost first
    graph: bool  # its output had an autograd graph


@dataclass
class Backward:
    """One backward of the watched calls and what became of what it added."""

    where: str
    steps: int  # optimizer steps before it
    judged: bool  # not inside a step's closure, no inputs=
    applied: set[int] = field(default_factory=set)  # id(param): a holder's step applied it
    lost: dict[int, tuple[str, int]] = field(default_factory=dict)  # -> (zero_grad, steps then)
    undecided: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class Use:
    """A term flowing into a backward, and the held parameters its gradient reaches."""

    term: Term
    backward: int
    held: frozenset[int]
    judged: bool  # no leaf outside the optimizers, no reentrant checkpoint


@dataclass
class Reach:
    """The watched calls' terms, backwards and steps."""

    calls: int = 0
    uses: list[Use] = field(default_factory=list)
    backwards: list[Backward] = field(default_factory=list)
    steps: list[tuple[int, str]] = field(default_factory=list)  # (optimizer, line) in order
    names: dict[int, str] = field(default_factory=dict)  # id(param) -> its name
    owners: dict[int, list[int]] = field(default_factory=dict)  # id(param) -> optimizers
    error: str | None = None


def _user_lines() -> tuple[str, ...]:
    """The user's frames above this call, innermost first, up to the doctor's own."""
    lines: list[str] = []
    frame: Any = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(DOCTOR_DIR):
        frame = frame.f_back  # the watch's own frames
    while frame is not None and len(lines) < 4:
        path = frame.f_code.co_filename
        if path.startswith(DOCTOR_DIR):
            break
        library = ("site-packages" in path or "dist-packages" in path) and (
            f"{os.sep}isotrain{os.sep}" not in path
        )
        if not (path.startswith((TORCH_DIR, STDLIB_DIR, "<frozen")) or library):
            lines.append(f"{short_path(path)}:{frame.f_lineno}")
        frame = frame.f_back
    return tuple(lines)


def _tensors(args: Any, kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors among a call's arguments, and in its list or tuple arguments."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


class _Watch(TorchFunctionMode):
    """The loss calls of the watched calls, and the hooks that follow their gradients."""

    def __init__(self, ctx: Context) -> None:
        super().__init__()
        self.ctx = ctx
        self.out = Reach()
        self.index = {id(o): i for i, o in enumerate(ctx.optimizers)}
        self.held = {id(p): p for o in ctx.optimizers for g in o.param_groups for p in g["params"]}
        for i, o in enumerate(ctx.optimizers):
            for pid in dict.fromkeys(id(p) for g in o.param_groups for p in g["params"]):
                self.out.owners.setdefault(pid, []).append(i)
        self.terms: list[tuple[Term, Any]] = []  # this call's, with their node
        self.constants: dict[int, tuple[torch.Tensor, list[Term]]] = {}  # no-graph tensors
        self.absorbed: dict[int, tuple[Any, list[Term]]] = {}  # node id -> the terms it took
        self.contrib: dict[int, set[int]] = {}  # id(param) -> backwards pending on it
        self.open = False  # inside a watched backward
        self.in_step = 0

    # -- the loss calls ------------------------------------------------------------------
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            if func in LOSS_FUNCTIONS:
                self.loss(LOSS_FUNCTIONS[func], out)
            elif self.constants:
                self.carry(args, kwargs, out)
        return out

    def loss(self, name: str, out: torch.Tensor) -> None:
        node = out.grad_fn
        if node is None and out.requires_grad:
            return
        term = Term(name, call_site()[0], _user_lines(), node is not None)
        self.terms.append((term, node))
        if node is None and len(self.constants) < _MAX_CONSTANTS:
            self.constants[id(out)] = (out, [term])

    def carry(self, args: Any, kwargs: dict[str, Any], out: torch.Tensor) -> None:
        """Follow a no-graph term into what is computed from it."""
        found = [
            self.constants[id(t)][1] for t in _tensors(args, kwargs)
            if id(t) in self.constants and self.constants[id(t)][0] is t
        ]  # fmt: skip
        if not found:
            return
        terms = list(dict.fromkeys(t for ts in found for t in ts))
        if out.grad_fn is not None:
            self.absorbed[id(out.grad_fn)] = (out.grad_fn, terms)
        elif len(self.constants) < _MAX_CONSTANTS:
            self.constants[id(out)] = (out, terms)  # a leaf given requires_grad included

    # -- backward ------------------------------------------------------------------------
    def backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def patched(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            with torch._C.DisableTorchFunction():
                self.flows(tensors, kwargs.get("inputs", args[4] if len(args) > 4 else None))
            self.open = True
            try:
                return original(tensors, *args, **kwargs)
            finally:
                self.open = False

        return patched

    def flows(self, tensors: Any, inputs: Any) -> None:
        """Which terms flow into this backward, and what each reaches."""
        roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        b = Backward(call_site()[0], len(self.out.steps), inputs is None and not self.in_step)
        self.out.backwards.append(b)
        index = len(self.out.backwards) - 1
        nodes = nodes_below([r.grad_fn for r in roots if isinstance(r, torch.Tensor)])
        leaves = [r for r in roots if isinstance(r, torch.Tensor) and r.grad_fn is None]
        leaves += [n.variable for n in nodes.values() if hasattr(n, "variable")]
        dead = {t for v in leaves if id(v) in self.constants for t in self.constants[id(v)][1]}
        dead |= {t for i, (_, ts) in self.absorbed.items() if i in nodes for t in ts}
        for term, node in self.terms:
            if node is not None and id(node) in nodes:
                held, judged = self.reached(node)
                self.out.uses.append(Use(term, index, held, judged and b.judged))
            elif node is None and term in dead:
                self.out.uses.append(Use(term, index, frozenset(), b.judged))

    def reached(self, node: Any) -> tuple[frozenset[int], bool]:
        """The held parameters below `node`, and whether nothing else receives its gradient."""
        held: set[int] = set()
        judged = True
        for n in nodes_below([node]).values():
            if hasattr(n, "variable"):
                pid = id(n.variable)
                if pid in self.held:
                    held.add(pid)
                else:
                    judged = False
            judged = judged and _OPAQUE not in type(n).__name__
        return frozenset(held), judged and bool(held)

    def accumulated(self, p: torch.Tensor) -> None:
        if self.open:
            self.contrib.setdefault(id(p), set()).add(len(self.out.backwards) - 1)

    # -- steps and zero_grad -------------------------------------------------------------
    def apply(self, i: int, line: str) -> None:
        self.out.steps.append((i, line))
        for g in self.ctx.optimizers[i].param_groups:
            for p in g["params"]:
                for b in self.contrib.pop(id(p), ()):
                    self.out.backwards[b].applied.add(id(p))

    def pre_step(self, i: int, opt: Any, args: Any, kwargs: Any) -> None:
        with torch._C.DisableTorchFunction():
            self.apply(i, call_site()[0])
        self.in_step += 1

    def post_step(self, i: int, opt: Any, args: Any, kwargs: Any) -> None:
        self.in_step = max(self.in_step - 1, 0)

    def scaler_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def patched(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            steps = len(self.out.steps)
            out = original(scaler, optimizer, *args, **kwargs)
            i = self.index.get(id(optimizer))
            if len(self.out.steps) == steps and i is not None:  # skipped for inf/NaN
                with torch._C.DisableTorchFunction():
                    self.apply(i, call_site()[0])
            return out

        return patched

    def zero_grad(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def patched(obj: Any, *args: Any, **kwargs: Any) -> Any:
            with torch._C.DisableTorchFunction():
                before = {pid: _grad_state(self.held[pid]) for pid in self.contrib}
            out = original(obj, *args, **kwargs)
            with torch._C.DisableTorchFunction():
                line = call_site()[0]
                for pid, state in before.items():
                    if _grad_state(self.held[pid]) != state:
                        self.clear(pid, line)
            return out

        return patched

    def clear(self, pid: int, line: str) -> None:
        steps = len(self.out.steps)
        for b in self.contrib.pop(pid, ()):
            back = self.out.backwards[b]
            if steps > back.steps:
                back.lost[pid] = (line, steps)
            else:
                back.undecided.add(pid)

    def end_call(self) -> None:
        self.terms.clear()
        self.constants.clear()
        self.absorbed.clear()

    def finish(self) -> Reach:
        for pid, bs in self.contrib.items():
            for b in bs:
                self.out.backwards[b].undecided.add(pid)
        self.contrib.clear()
        return self.out


def _grad_state(p: torch.Tensor) -> tuple[int, int] | None:
    return None if p.grad is None else (id(p.grad), p.grad._version)


@contextlib.contextmanager
def _watching(w: _Watch) -> Iterator[None]:
    handles = [p.register_post_accumulate_grad_hook(w.accumulated)
               for p in w.held.values() if p.requires_grad]  # fmt: skip
    for i, o in enumerate(w.ctx.optimizers):  # the index bound: a wrapper may share the hooks
        handles.append(o.register_step_pre_hook(functools.partial(w.pre_step, i)))
        handles.append(o.register_step_post_hook(functools.partial(w.post_step, i)))
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(patched(torch.autograd, "backward", w.backward))
            stack.enter_context(patched(torch.optim.Optimizer, "zero_grad", w.zero_grad))
            stack.enter_context(patched(torch.nn.Module, "zero_grad", w.zero_grad))
            stack.enter_context(patched(torch.amp.GradScaler, "step", w.scaler_step))
            yield
    finally:
        for h in handles:
            h.remove()


def reach(ctx: Context) -> Reach:
    """The watched calls (cached on `ctx`): min(8, max(3, len(batches))) calls of the step."""
    if "loss terms" in ctx.cache:
        return ctx.cache["loss terms"]
    model, opt = ctx.fresh()
    w = _Watch(ctx)
    w.out.names = {id(p): n for n, p in params_of(model).items()}
    n = min(TRACE_MAX, max(TRACE_MIN, len(ctx.batches)))
    try:
        with _watching(w):
            for i in range(n):
                try:
                    with w:
                        ctx.run_step(model, opt, ctx.batches[i % len(ctx.batches)])
                finally:
                    w.end_call()
                w.out.calls += 1
    except Exception as e:  # the user's step failed: the check says so
        w.out.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    ctx.cache["loss terms"] = w.finish()
    return ctx.cache["loss terms"]
