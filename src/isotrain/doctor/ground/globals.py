"""The state a user's step keeps outside the model: the globals and closure cells it reads.

A loop that carries an RNN's hidden state in a module-level dict, appends losses to a list
or counts steps in a global changes them on every call; the doctor calls the step dozens of
times. `StepState` records, before examine starts, what the step function (and the functions
of the same module it calls, transitively) reads by name, and the object of a step that is a
bound method: tensors (their values too), plain values, containers and tuples, modules other
than the model (an EMA copy) and objects of the user's own classes (a trainer holding an EMA
helper holding its shadows and counter), followed as deep as they go within bounds (NOTE
[reachable state]), and puts them back after every check, so each check starts from the
user's state and examine leaves it as it was.
"""

from __future__ import annotations

import functools
import types
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from isotrain._torch_private import tensor_version

__all__ = ["StepState", "cell_full", "names_read"]

_PLAIN = (bool, int, float, complex, str, bytes, type(None))
_CONTAINERS = (dict, list, set, deque)


def _is_state(value: Any) -> bool:
    """A module the step updates beside the model (an EMA copy, a teacher), or an object of
    the user's own class holding state (an EMA helper's shadows and counter)."""
    if isinstance(value, (torch.nn.Module, torch.amp.GradScaler)):  # a scaler: its scale
        return True
    kind = type(value)
    return (
        hasattr(value, "__dict__")
        and kind.__module__.split(".")[0] not in ("builtins", "torch", "isotrain")
        and not isinstance(value, (type, types.ModuleType, types.FunctionType,
                                   types.MethodType, functools.partial))
    )  # fmt: skip


def _kept(value: Any, skip: set[int]) -> bool:
    if id(value) in skip:
        return False
    return isinstance(value, (torch.Tensor, *_PLAIN, *_CONTAINERS, tuple)) or _is_state(value)


# NOTE [reachable state]
# What a name holds is followed as deep as the user's objects go (a trainer holding an EMA
# helper holding its shadows and counter): every container, tuple and object of the user's own
# classes reached, within MAX_DEPTH levels and MAX_OBJECTS objects, is saved once (a cycle or a
# shared object is saved where it is first reached) and put back in place: the same objects
# bound to the same attributes and items, with their contents and tensor values as before.
# What lies past the bounds keeps its identity but not its contents; `left_out` names it.
MAX_DEPTH = 8
MAX_OBJECTS = 4096
_NAMED = 5  # paths named in left_out; the rest are counted
_GONE = object()


class _Saver:
    """One pass over what the step's names hold, each object saved once, within the bounds."""

    def __init__(self, skip: set[int]) -> None:
        self.skip = skip
        self.seen: set[int] = set()
        self.left_out: list[str] = []
        self.missed = 0  # objects past the bounds

    def save(self, value: Any, path: str, depth: int = 0) -> Any:
        """What restoring `value` needs (None for a plain value or one saved elsewhere)."""
        if isinstance(value, _PLAIN) or id(value) in self.seen or not _kept(value, self.skip):
            return None
        if depth > MAX_DEPTH or len(self.seen) >= MAX_OBJECTS:
            self.missed += 1
            if len(self.left_out) < _NAMED:
                self.left_out.append(path)
            return None
        self.seen.add(id(value))
        if isinstance(value, torch.Tensor):
            return [value.detach().clone(), tensor_version(value)]  # values, write count after
        if isinstance(value, torch.nn.Module):
            return {k: v.detach().clone() for k, v in value.state_dict(keep_vars=True).items()}
        if isinstance(value, (*_CONTAINERS, tuple)):
            keyed = value.items() if isinstance(value, dict) else enumerate(value)
            inner = [(v, self.save(v, f"{path}[{k!r}]", depth + 1)) for k, v in keyed]
            copied = None if isinstance(value, tuple) else value.copy()
            return copied, [(v, saved) for v, saved in inner if saved is not None]
        held = {k: v for k, v in vars(value).items() if _kept(v, self.skip)}
        attrs = {k: (v, self.save(v, f"{path}.{k}", depth + 1)) for k, v in held.items()}
        return attrs, frozenset(vars(value))


def _restore(value: Any, saved: Any) -> None:
    """`value`'s contents put back from `saved` (the object itself stays the same)."""
    if saved is None:
        return
    if isinstance(value, torch.Tensor):
        values, version = saved
        if tensor_version(value) != version and value.shape == values.shape:
            with torch.no_grad():  # written in place since: its values back
                value.copy_(values)
            saved[1] = tensor_version(value)
    elif isinstance(value, torch.nn.Module):
        now = value.state_dict(keep_vars=True)
        with torch.no_grad():
            for k, v in saved.items():
                if k in now and now[k].shape == v.shape:
                    now[k].copy_(v)
    elif isinstance(value, (*_CONTAINERS, tuple)):
        items, inner = saved
        if isinstance(value, list):
            value[:] = items
        elif isinstance(value, deque):
            value.clear()
            value.extend(items)
        elif items is not None and not isinstance(value, tuple):  # a dict or a set
            value.clear()
            value.update(items)
        for item, item_saved in inner:
            _restore(item, item_saved)
    else:
        attrs, names = saved
        now = vars(value)
        for k in [k for k in now if k not in names]:  # set by the step since
            delattr(value, k)
        for k, (old, inner) in attrs.items():
            if now.get(k, _GONE) is not old:  # (a frozen dataclass is never set again)
                setattr(value, k, old)
            _restore(old, inner)


def step_functions(*fns: Any) -> list[types.FunctionType]:
    """The functions `fns`, the functions their closures hold, and the functions of their own
    module they reach by global name, transitively."""
    seen: dict[int, types.FunctionType] = {}
    todo = [getattr(f, "__wrapped__", f) for f in fns]
    while todo:
        f = todo.pop()
        f = f.__func__ if isinstance(f, types.MethodType) else f
        if not isinstance(f, types.FunctionType) or id(f) in seen:
            continue
        seen[id(f)] = f
        for name in f.__code__.co_names:
            g = f.__globals__.get(name)
            if isinstance(g, types.FunctionType) and g.__globals__ is f.__globals__:
                todo.append(g)
        todo += [c.cell_contents for c in f.__closure__ or () if cell_full(c)]
    return list(seen.values())


def names_read(*fns: Any) -> Iterator[tuple[Any, str, str, Any]]:
    """(space, attribute, name, value) for every global and closure cell that `fns` and the
    functions they reach (`step_functions`) read by name: a globals dict and its key, or a
    cell and "cell_contents" under the variable's name."""
    for f in step_functions(*fns):
        for name in f.__code__.co_names:
            if name in f.__globals__:
                yield f.__globals__, name, name, f.__globals__[name]
        for var, cell in zip(f.__code__.co_freevars, f.__closure__ or (), strict=True):
            if cell_full(cell):
                yield cell, "cell_contents", var, cell.cell_contents


def cell_full(cell: Any) -> bool:
    """Whether a closure cell holds a value (an empty one raises on reading)."""
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


def _bound(space: Any, name: str, held: Any) -> Any:
    """What `name` holds now in `space` (a globals dict or a cell; None: `held` itself)."""
    if space is None:
        return held
    return space[name] if isinstance(space, dict) else getattr(space, name)


class StepState:
    """The globals and closure cells the user's functions read, as they were when this was
    made (functions that are None are left out; objects in `skip`, the model examine restores
    itself, are not kept), and the contents of `objects` the step is handed (an optimizer
    wrapper's own call counter)."""

    def __init__(
        self,
        *fns: Callable[..., Any] | None,
        skip: Iterable[Any] = (),
        objects: Iterable[Any] = (),
    ) -> None:
        self.skip = {id(o) for o in skip}
        self.slots: list[tuple[Any, str, Any, Any]] = []  # (namespace, name, value, saved)
        saver = _Saver(self.skip)
        for f in fns:  # a bound method's object (a Trainer's train_step): its attributes
            owner = getattr(getattr(f, "__wrapped__", f), "__self__", None)
            if owner is not None and _kept(owner, self.skip) and not isinstance(owner, type):
                self.slots.append((None, "self", owner, saver.save(owner, "self")))
        for o in objects:  # handed to the step, itself for good: its contents put back
            if _kept(o, self.skip):
                self.slots.append((None, "handed", o, saver.save(o, "handed")))
        for space, attr, name, value in names_read(*[f for f in fns if f is not None]):
            if _kept(value, self.skip):
                self._keep(space, attr, saver, name)
        self.left_out, self.missed = saver.left_out, saver.missed

    def _keep(self, space: Any, name: str, saver: _Saver, path: str) -> None:
        value = space[name] if isinstance(space, dict) else getattr(space, name)
        if not any(s is space and n == name for s, n, _, _ in self.slots):
            self.slots.append((space, name, value, saver.save(value, path)))

    def now(self) -> StepState:
        """The same names with what they hold now: a point to put them back to later."""
        later = StepState(skip=())
        later.skip = self.skip
        saver = _Saver(self.skip)
        for space, name, held, _ in self.slots:
            value = _bound(space, name, held)
            later.slots.append((space, name, value, saver.save(value, name)))
        later.left_out, later.missed = saver.left_out, saver.missed
        return later

    def restore(self) -> None:
        """Every name bound to its old object again, and that object's contents put back."""
        for space, name, value, saved in self.slots:
            if isinstance(space, dict):
                space[name] = value
            elif space is not None:  # (None: a bound method's object, itself for good)
                setattr(space, name, value)
            _restore(value, saved)
