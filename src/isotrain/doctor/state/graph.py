"""graph_retained: tensors of one step, with their autograd graph, still alive in the next.

The doctor runs the user's step a few more times and, after each call, counts the autograd
nodes reachable from tensors the step made that are still alive (any op's output the call
watch saw), and from every tensor with a graph that the step's state holds: the model's
attributes, and what the step reads by name, followed through containers and objects (NOTE
[held state]). A count that grows call after call (and that a garbage collection does not
take back) is a graph kept across steps: a warning; one step's graph held until the next
replaces it is information; a second backward through a freed graph names the same bug.
"""

from __future__ import annotations

import gc
import types
import weakref
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import torch
from torch import nn

from isotrain.doctor.ground.calls import CallWatch, watching_calls
from isotrain.doctor.ground.context import CannotRun, Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.globals import names_read
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.trace import Trace, alive_roots, nodes_below, trace

__all__ = ["GRAPH_RETAINED", "check_graph_retained"]

_SECOND_BACKWARD = "backward through the graph a second time"
CALLS = 4  # calls of the step the graph is counted after
_FIX = (
    "keep what outlives the step detached: total_loss += loss.detach() (or loss.item() at "
    "log steps), history.append(loss.detach()), self.last_out = out.detach(), hidden = "
    "hidden.detach() for state carried across steps"
)


def check_graph_retained(ctx: Context) -> list[Finding]:
    """graph_retained: tensors (with their autograd graph) of one step alive into the next."""
    tr: Trace = trace(ctx)
    if tr.error is not None and _SECOND_BACKWARD in tr.error and tr.steps:
        last = tr.steps[-1]
        return [Finding(
            "graph_retained", "error", _common(last.retained) or last.backward_at,
            f"call {len(tr.steps) + 1} of your step raised {tr.error.split(' (')[0]}: its graph "
            "reaches into "
            "the previous step's, through a tensor carried across steps",
            _FIX + " (retain_graph=True only hides it: the graph then grows every step)",
        )]  # fmt: skip
    if tr.error is not None and not tr.steps:
        raise CannotRun(f"your step raised {tr.error}")
    seen = _counted(ctx)
    if len(seen.nodes) < 2 or seen.collected < seen.nodes[-1] or not seen.nodes[-1]:
        return []  # none alive, or a reference cycle held them: garbage, not retained
    shown = ", ".join(map(str, seen.nodes))
    held = seen.held_text()
    if all(b >= a for a, b in pairwise(seen.nodes)) and seen.nodes[-1] > seen.nodes[0]:
        per = (seen.nodes[-1] - seen.nodes[0]) / (len(seen.nodes) - 1)
        return [Finding(
            "graph_retained", "warning", seen.where(),
            f"after each of {len(seen.nodes)} calls of your step, tensors it made are still "
            f"alive with their autograd graph, and it grows: {shown} graph nodes (+{per:.0f} "
            f"per step){held}, so memory and time grow with every step",
            _FIX,
        )]  # fmt: skip
    copy = seen.module_attrs()
    if min(seen.nodes) == 0 or not copy:
        return []  # held now and then, or carried to the next step (a hidden state it detaches)
    return [Finding(
        "graph_retained", "info", seen.where(),
        f"after each of {len(seen.nodes)} calls of your step, {copy} holds a tensor with its "
        f"autograd graph ({shown} graph nodes, not growing: each step's replaces the last); "
        "copy.deepcopy(model) (an EMA or best-model copy) raises while it does (only graph "
        "leaves can be deep-copied)",
        _FIX,
    )]  # fmt: skip


@dataclass
class _Seen:
    """What the counted calls left alive: graph nodes after each call and after a garbage
    collection, and where the step's state holds tensors with a graph (path -> count)."""

    nodes: list[int] = field(default_factory=list)
    collected: int = 0
    held: dict[str, int] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    on_module: set[str] = field(default_factory=set)  # held as a module's own attribute

    def held_text(self) -> str:
        if not self.held:
            return ""
        paths = sorted(self.held, key=lambda p: -self.held[p])[:3]
        said = ", ".join(f"`{p}` ({self.held[p]})" for p in paths)
        return f", held after the last call by {said}"

    def where(self) -> str:
        return _common(self.lines) or next(iter(self.held), "your step")

    def module_attrs(self) -> str:
        return ", ".join(f"`{p}`" for p in sorted(self.on_module))


def _counted(ctx: Context) -> _Seen:
    """CALLS calls of the user's step from examine's state, the graph counted after each,
    put back after (a call that raises ends the count)."""
    model, opt = ctx.fresh()
    watch, seen = CallWatch(), _Seen()
    try:
        for i in range(CALLS):
            with watching_calls(watch):
                try:
                    out = ctx.run_step(model, opt, ctx.batches[i % len(ctx.batches)])
                except Exception:
                    break
                del out
            watch.last_loss = None  # the watch's own hold on the loss, not the step's
            seen.nodes.append(_count(ctx, watch, seen))
        gc.collect()
        seen.collected = _count(ctx, watch, _Seen())
    finally:
        ctx.reset()
    return seen


def _count(ctx: Context, watch: CallWatch, seen: _Seen) -> int:
    """Autograd nodes reachable from the tensors the call watch saw made that are still
    alive and from those the step's state holds; `seen` gets where they are held."""
    roots, lines = alive_roots(watch)
    held: dict[str, int] = {}
    walk = _Walk()
    for path, t in _held(ctx, walk):
        roots.append(t.grad_fn)
        held[path] = held.get(path, 0) + 1
        if id(t) in watch.graphs:
            lines.append(watch.graphs[id(t)][1])
    seen.held, seen.lines, seen.on_module = held, lines, walk.on_module
    return len(nodes_below(roots))


# NOTE [held state]
# Where a step keeps a tensor across steps is what the user's code can reach after it: the
# model's own attributes (`self.last_out = out`; parameters, buffers and the attributes a
# legacy weight_norm/spectral_norm hook sets are not the user's), and what the step and the
# functions of its module it calls read by name (globals, closure cells, a bound method's
# object), followed through dicts, lists, tuples, sets, deques and the attributes of objects of the
# user's own classes (a metrics tracker, a dataclass), within MAX_DEPTH levels and MAX_OBJECTS
# objects. A list's or a deque's items are named by the list; a dict's by the dict, or by
# their key when it is a string.
MAX_DEPTH, MAX_OBJECTS = 8, 4096
_MODULE_OWN = frozenset(vars(nn.Module()))


def _held(ctx: Context, walk: _Walk) -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor with an autograd graph the step's state holds."""
    yield from walk.module(ctx.model, "model", 0)
    owner = getattr(getattr(ctx.step, "__wrapped__", ctx.step), "__self__", None)
    if owner is not None:  # a bound method's object (a Trainer's train_step)
        yield from walk.value(owner, "self", 0)
    for _, _, name, value in names_read(ctx.step):  # what the step (and what it calls) reads
        yield from walk.value(value, name, 0)


class _Walk:
    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.on_module: set[str] = set()  # paths of a module's own attributes

    def _enter(self, value: Any, depth: int) -> bool:
        if id(value) in self.seen or depth > MAX_DEPTH or len(self.seen) >= MAX_OBJECTS:
            return False
        self.seen.add(id(value))
        return True

    def module(self, mod: nn.Module, path: str, depth: int) -> Iterator[tuple[str, Any]]:
        if not self._enter(mod, depth):
            return
        hooked = {getattr(h, "name", None) for h in mod._forward_pre_hooks.values()}
        for k, v in vars(mod).items():
            if k not in _MODULE_OWN and k not in hooked:
                if isinstance(v, torch.Tensor) and v.grad_fn is not None:
                    self.on_module.add(f"{path}.{k}")
                yield from self.value(v, f"{path}.{k}", depth + 1)
        for k, child in mod._modules.items():
            if child is not None:
                yield from self.module(child, f"{path}.{k}", depth + 1)

    def value(self, v: Any, path: str, depth: int) -> Iterator[tuple[str, Any]]:
        if isinstance(v, torch.Tensor):
            if v.grad_fn is not None:
                yield path, v
        elif isinstance(v, nn.Module):
            yield from self.module(v, path, depth)
        elif isinstance(v, dict):
            if self._enter(v, depth):
                for k, item in list(v.items()):
                    at = f"{path}[{k!r}]" if isinstance(k, str) else path
                    yield from self.value(item, at, depth + 1)
        elif isinstance(v, (list, tuple, set, frozenset, deque)):
            if self._enter(v, depth):
                for item in list(v):
                    yield from self.value(item, path, depth + 1)
        elif _users(v) and self._enter(v, depth):
            names = list(getattr(v, "__dict__", {}))
            names += [s for c in type(v).__mro__ for s in getattr(c, "__slots__", ())]
            for k in names:
                yield from self.value(getattr(v, k, None), f"{path}.{k}", depth + 1)


def _users(v: Any) -> bool:
    """An object of the user's own classes (not torch's, the standard library's or ours)."""
    kind = type(v)
    return (
        kind.__module__.split(".")[0] not in ("builtins", "torch", "isotrain", "collections")
        and (hasattr(v, "__dict__") or hasattr(kind, "__slots__"))
        and not isinstance(v, (type, types.ModuleType, types.FunctionType, types.MethodType,
                               weakref.ref))
    )  # fmt: skip


def _common(lines: list[str]) -> str | None:
    return Counter(lines).most_common(1)[0][0] if lines else None


GRAPH_RETAINED = Check(
    "graph_retained",
    (
        Kind(
            "graph_retained",
            "tensors with their autograd graph outlive the step; the graph grows",
        ),
    ),
    check_graph_retained,
)
