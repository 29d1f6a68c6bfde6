"""What each backward of one step ran on, for gradient_scaled_by_world.

A step may run several backwards before `optimizer.step()`: accumulation micro-batches, a loss
split into parts, pipeline-like chunks. For each one the doctor notes the scalar it ran on and,
where its autograd graph shows that scalar to be a loss-function output (F.cross_entropy and the
others of the call watch, mean-reduced) times constants only, that output: their ratio is the
factor the backward put on its loss, exactly (a chain of multiplications and divisions by
tensors without a gradient). It notes too whether each backward had a forward of the model of
its own (micro-batches) or all shared one (parts of one loss), and whether any ran under
no_sync.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from isotrain.doctor.ground.calls import LOSSES, bound, reduction
from isotrain.doctor.ground.context import as_loss

__all__ = ["EXACT", "Backwards", "Summary", "summarize"]

# relative: a factor applied to the same fp32 number is exact to ~1e-7, while two ranks' or two
# micro-batches' losses at initialisation (all near log C) can agree to 1e-3
EXACT = 1e-5
# autograd nodes that only scale their one input (a constant's side has no gradient)
_SCALING = {"MulBackward0", "DivBackward0", "ToCopyBackward0", "CloneBackward0"}
_HOPS = 16


@dataclass(frozen=True)
class Summary:
    """One rank's first step as gradient_scaled_by_world compares it across ranks."""

    after: list[float]  # the gradients' linear sums after the last backward
    at_step: list[float]  # the same at optimizer.step()
    gathers: int = 0  # tensors gathered across ranks in the step (a loss over the world)
    backwards: int = 1  # backwards before optimizer.step()
    returned: float | None = None  # what the backwards ran on, summed, over the returned loss
    scales: tuple[float | None, ...] = ()  # each backward: what it ran on over its loss output
    losses: tuple[str, ...] = ()  # the loss functions those outputs came from
    # "micro-batches": each backward after a forward of the model of its own; "parts": one
    # forward, then all the backwards; "mixed": neither (or no forward of the model seen)
    layout: str = "micro-batches"
    unsynced: bool = False  # some backward ran under DDP's no_sync (accumulation)


class _LossMode(TorchFunctionMode):
    """Notes each mean-reduced scalar loss-function output that carries a graph."""

    def __init__(self, seen: dict[int, tuple[Any, torch.Tensor, str]]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = LOSSES.get(func)
        scalar = isinstance(out, torch.Tensor) and out.numel() == 1 and out.grad_fn is not None
        arguments = bound(func, args, kwargs) if name and scalar else None
        if name and arguments is not None and reduction(arguments) == "mean":  # the node: its id
            self.seen[id(out.grad_fn)] = (out.grad_fn, out.detach().clone(), name)  # unique
        return out


@dataclass
class Backwards:
    """The backwards of one step before its optimizer.step(), in order."""

    ran_on: list[torch.Tensor | None] = field(default_factory=list)  # scalars, cloned
    scaled: list[tuple[torch.Tensor, str] | None] = field(default_factory=list)  # loss, name
    own: list[bool] = field(default_factory=list)  # a forward of the model since the last one
    unsynced: bool = False
    _seen: dict[int, tuple[Any, torch.Tensor, str]] = field(default_factory=dict)
    _forwards: int = 0  # forwards of the model since the last backward

    @contextlib.contextmanager
    def watching(self, model: nn.Module) -> Iterator[None]:
        """Watch the loss-function calls and the model's forwards of one step."""
        handle = model.register_forward_pre_hook(lambda *_: self._forward())
        try:
            with _LossMode(self._seen):
                yield
        finally:
            handle.remove()
            self._seen.clear()  # the graphs' nodes, held for the step only

    def _forward(self) -> None:
        self._forwards += 1

    def backward(self, ran_on: Any, *, synced: bool) -> None:
        """Note one backward on `ran_on` (what torch.autograd.backward got)."""
        scalar = isinstance(ran_on, torch.Tensor) and ran_on.numel() == 1
        self.ran_on.append(ran_on.detach().clone() if scalar else None)
        self.scaled.append(self._loss_of(ran_on) if scalar else None)
        self.own.append(self._forwards > 0)
        self.unsynced = self.unsynced or not synced
        self._forwards = 0

    def _loss_of(self, t: torch.Tensor) -> tuple[torch.Tensor, str] | None:
        """The loss-function output `t` is a constant multiple of, from its graph."""
        node = t.grad_fn
        for _ in range(_HOPS):
            if node is None:
                return None
            if id(node) in self._seen:
                _, value, name = self._seen[id(node)]
                return value, name
            inputs = [n for n, _ in node.next_functions if n is not None]
            if type(node).__name__ not in _SCALING or len(inputs) != 1:
                return None
            node = inputs[0]
        return None


def summarize(
    backs: Backwards, returned: Any, after: list[float], at_step: list[float], gathers: int
) -> Summary:
    """One rank's Summary of a recorded step (reads the recorded scalars once)."""
    ran = [None if t is None else float(t) for t in backs.ran_on]  # sync: once, after the step
    scales: list[float | None] = []
    for r, got in zip(ran, backs.scaled, strict=True):
        loss = None if got is None else float(got[0])  # sync: once, after the step
        scales.append(_ratio(r, loss))
    names = tuple(dict.fromkeys(got[1] for got in backs.scaled if got is not None))
    return Summary(
        after, at_step, gathers, len(ran), _returned(ran, scales, returned), tuple(scales),
        names, _layout(backs.own), backs.unsynced,
    )  # fmt: skip


def _layout(own: list[bool]) -> str:
    """How the backwards share the model's forwards (Summary.layout)."""
    if all(own):
        return "micro-batches"
    return "parts" if own[:1] == [True] and not any(own[1:]) else "mixed"


def _ratio(x: float | None, y: float | None) -> float | None:
    if x is None or y is None or y == 0:
        return None
    r = x / y
    return r if math.isfinite(r) and r != 0 else None


def _returned(ran: list[float | None], scales: list[float | None], returned: Any) -> float | None:
    """What the backwards ran on, summed, over the loss the step returned (None: no scalar
    returned, or, over several backwards, a return that is one backward's loss or its
    loss-function output, or losses all alike: a sum and one of them cannot be told apart)."""
    value = as_loss(returned)
    if value is None or value.numel() != 1 or not ran or any(r is None for r in ran):
        return None
    r_value = float(value.detach())  # sync: once, after the step
    values = [r for r in ran if r is not None]
    if len(values) > 1:
        losses = [r / s for r, s in zip(values, scales, strict=True) if s is not None]
        if any(_near(v, r_value) for v in values + losses) or all(
            _near(v, values[0]) for v in values
        ):
            return None
    return _ratio(math.fsum(values), r_value)


def _near(x: float, target: float) -> bool:
    return abs(x - target) <= EXACT * abs(target)
