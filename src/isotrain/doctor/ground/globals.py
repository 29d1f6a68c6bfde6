"""The state a user's step keeps outside the model: the globals and closure cells it reads.

A loop that carries an RNN's hidden state in a module-level dict, appends losses to a list
or counts steps in a global changes them on every call; the doctor calls the step dozens of
times. `StepState` records, before examine starts, what the step function (and the functions
of the same module it calls, transitively) reads by name: tensors (their values too), plain
values, the builtin containers (dict, list, set) one level deep, modules other than the model
(an EMA copy) and objects of the user's own classes (an EMA helper's shadows and counter), and
puts them back after every check, so each check starts from the user's state and examine
leaves it as it was.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch

from isotrain._torch_private import tensor_version

__all__ = ["StepState"]

_PLAIN = (bool, int, float, complex, str, bytes, type(None))
_CONTAINERS = (dict, list, set)


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
    return (
        isinstance(value, (torch.Tensor, *_PLAIN))
        or type(value) in _CONTAINERS
        or (_is_state(value))
    )


def _saved(value: Any, skip: set[int]) -> Any:
    """What restoring `value` needs: a tensor's values, a container's items (and the values
    of the tensors among them), a module's state dict, an object's attributes one level deep."""
    if isinstance(value, torch.Tensor):
        return [value.detach().clone(), tensor_version(value)]  # values, write count after
    if isinstance(value, torch.nn.Module):
        return {k: v.detach().clone() for k, v in value.state_dict(keep_vars=True).items()}
    if type(value) in _CONTAINERS:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        tensors = {k: _saved(v, skip) for k, v in items if isinstance(v, torch.Tensor)}
        return value.copy(), tensors
    if _is_state(value):  # one level deep: its tensors, values, containers and modules
        kept = {k: v for k, v in vars(value).items() if _kept(v, skip) and not _nested(v)}
        return {k: (v, _saved(v, skip)) for k, v in kept.items()}
    return None


def _nested(value: Any) -> bool:
    """An object of the user's own class inside another: left as it is (no cycles, no depth)."""
    return _is_state(value) and not isinstance(value, torch.nn.Module)


def _restore(value: Any, saved: Any) -> None:
    """`value`'s contents put back from `saved` (the object itself stays the same)."""
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
    elif type(value) in _CONTAINERS:
        items, tensors = saved
        if isinstance(value, list):
            value[:] = items
        else:
            value.clear()
            value.update(items)
        for k, tensor_saved in tensors.items():
            _restore(items[k], tensor_saved)
    elif _is_state(value):
        for k, (old, inner) in saved.items():
            setattr(value, k, old)
            _restore(old, inner)


def _functions(*fns: Any) -> list[types.FunctionType]:
    """The functions `fns`, the functions their closures hold, and the functions of their own
    module they reach by global name, transitively."""
    seen: dict[int, types.FunctionType] = {}
    todo = [getattr(f, "__wrapped__", f) for f in fns]
    while todo:
        f = todo.pop()
        if not isinstance(f, types.FunctionType) or id(f) in seen:
            continue
        seen[id(f)] = f
        for name in f.__code__.co_names:
            g = f.__globals__.get(name)
            if isinstance(g, types.FunctionType) and g.__globals__ is f.__globals__:
                todo.append(g)
        todo += [c.cell_contents for c in f.__closure__ or () if _full(c)]
    return list(seen.values())


def _full(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


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
        for o in objects:
            if _kept(o, self.skip):
                self._keep({"handed": o}, "handed")
        for f in _functions(*[f for f in fns if f is not None]):
            for name in f.__code__.co_names:
                if name in f.__globals__ and _kept(f.__globals__[name], self.skip):
                    self._keep(f.__globals__, name)
            for cell in f.__closure__ or ():
                if _full(cell) and _kept(cell.cell_contents, self.skip):
                    self._keep(cell, "cell_contents")

    def _keep(self, space: Any, name: str) -> None:
        value = space[name] if isinstance(space, dict) else getattr(space, name)
        if not any(s is space and n == name for s, n, _, _ in self.slots):
            self.slots.append((space, name, value, _saved(value, self.skip)))

    def now(self) -> StepState:
        """The same names with what they hold now: a point to put them back to later."""
        later = StepState(skip=())
        later.skip = self.skip
        for space, name, _, _ in self.slots:
            value = space[name] if isinstance(space, dict) else getattr(space, name)
            later.slots.append((space, name, value, _saved(value, self.skip)))
        return later

    def restore(self) -> None:
        """Every name bound to its old object again, and that object's contents put back."""
        for space, name, value, saved in self.slots:
            if isinstance(space, dict):
                space[name] = value
            else:
                setattr(space, name, value)
            _restore(value, saved)
