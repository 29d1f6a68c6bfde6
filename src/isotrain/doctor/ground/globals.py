"""The state a user's step keeps outside the model: the globals and closure cells it reads.

A loop that carries an RNN's hidden state in a module-level dict, appends losses to a list
or counts steps in a global changes them on every call; the doctor calls the step dozens of
times. `StepState` records, before examine starts, what the step function (and the functions
of the same module it calls, transitively) reads by name: tensors (their values too), plain
values, and the builtin containers (dict, list, set) one level deep, and puts them back after
every check, so each check starts from the user's state and examine leaves it as it was.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

from isotrain._torch_private import tensor_version

__all__ = ["StepState"]

_PLAIN = (bool, int, float, complex, str, bytes, type(None))
_CONTAINERS = (dict, list, set)


def _kept(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, *_PLAIN)) or type(value) in _CONTAINERS


def _saved(value: Any) -> Any:
    """What restoring `value` needs: a tensor's values, a container's items."""
    if isinstance(value, torch.Tensor):
        return [value.detach().clone(), tensor_version(value)]  # values, write count after
    if type(value) in _CONTAINERS:
        return value.copy()
    return None


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
    made (functions that are None are left out)."""

    def __init__(self, *fns: Callable[..., Any] | None) -> None:
        self.slots: list[tuple[Any, str, Any, Any]] = []  # (namespace, name, value, saved)
        for f in _functions(*[f for f in fns if f is not None]):
            for name in f.__code__.co_names:
                if name in f.__globals__ and _kept(f.__globals__[name]):
                    self._keep(f.__globals__, name)
            for cell in f.__closure__ or ():
                if _full(cell) and _kept(cell.cell_contents):
                    self._keep(cell, "cell_contents")

    def _keep(self, space: Any, name: str) -> None:
        value = space[name] if isinstance(space, dict) else getattr(space, name)
        if not any(s is space and n == name for s, n, _, _ in self.slots):
            self.slots.append((space, name, value, _saved(value)))

    def restore(self) -> None:
        """Every name bound to its old object again, and that object's contents put back."""
        for space, name, value, saved in self.slots:
            if isinstance(space, dict):
                space[name] = value
            else:
                setattr(space, name, value)
            if isinstance(value, torch.Tensor):
                values, version = saved
                if tensor_version(value) != version and value.shape == values.shape:
                    with torch.no_grad():  # written in place since: its values back
                        value.copy_(values)
                    saved[1] = tensor_version(value)
            elif isinstance(value, list):
                value[:] = saved
            elif type(value) in _CONTAINERS:
                value.clear()
                value.update(saved)
