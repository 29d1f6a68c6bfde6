"""Every torch loss function the user's step calls, with a summary of each tensor argument.

The trace's call watch keeps what its own checks need of a few losses; the contract checks
need the value ranges of every loss's input, target and weights, and which op made the input
(softmax, sigmoid, log_softmax), so they watch one more call of the step themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from isotrain.doctor.ground.calls import LOSS_FUNCTIONS, bound, call_site
from isotrain.doctor.ground.context import Context

__all__ = ["Seen", "SeenCall", "TensorSeen", "seen_calls"]

# every loss in torch.nn.functional (the nn.*Loss modules call these)
_SQUASH = {
    F.softmax: "softmax", torch.softmax: "softmax", torch.Tensor.softmax: "softmax",
    F.log_softmax: "log_softmax", torch.log_softmax: "log_softmax",
    torch.Tensor.log_softmax: "log_softmax", torch.sigmoid: "sigmoid", F.sigmoid: "sigmoid",
    torch.Tensor.sigmoid: "sigmoid",
}  # fmt: skip


@dataclass(frozen=True)
class TensorSeen:
    """What a contract needs of one tensor argument: shape, range, and how its class rows sum."""

    shape: tuple[int, ...]
    floating: bool
    low_precision: bool  # float16 / bfloat16: its rows sum to 1 less exactly
    low: float
    high: float
    numel: int
    row_sum_off: float  # max |sum over the class dim - 1| (inf when not floating)
    row_lse_off: float  # max |logsumexp over the class dim| (inf when not floating)
    made_by: tuple[str, str] | None  # (softmax | sigmoid | log_softmax, the line) that made it
    values: tuple[float, ...] = ()  # a floating target's distinct values, when at most _FEW


@dataclass
class SeenCall:
    """One loss-function call: its name, line, tensor arguments and other options."""

    name: str
    where: str
    tensors: dict[str, TensorSeen]
    options: dict[str, Any]


@dataclass
class Seen:
    """The loss calls of one step (`error`: what the step raised, if it did)."""

    calls: list[SeenCall] = field(default_factory=list)
    made: dict[int, tuple[str, str]] = field(default_factory=dict)  # storage -> (op, line)
    error: str | None = None


def _class_dim(name: str, shape: tuple[int, ...]) -> int:
    """The dimension a loss's distributions lie along: dim 1 for the class-index losses (their
    (N, C, d1, ...) layout), the last one for kl_div (a (B, T, V) distillation)."""
    if len(shape) < 2:
        return 0
    return -1 if name == "kl_div" else 1


def _storage(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return id(t)


_FEW = 4  # distinct values a target may hold and still be read as hard labels


def _summary(
    t: torch.Tensor, dim: int, made_by: tuple[str, str] | None, *, target: bool = False
) -> TensorSeen:
    """The tensor's summary (the doctor's own syncs, on a detached float copy); a floating
    `target`'s distinct values too, when it holds at most _FEW."""
    with torch.no_grad():
        v = t.detach().float() if t.is_floating_point() else t.detach().double()
        empty = v.numel() == 0
        low = float(v.min()) if not empty else 0.0  # sync: the doctor's
        high = float(v.max()) if not empty else 0.0  # sync: the doctor's
        off_sum = off_lse = float("inf")
        if t.is_floating_point() and not empty and not bool((v.isnan() | v.isposinf()).any()):
            off_sum = float((v.sum(dim) - 1).abs().max())  # sync: the doctor's
            off_lse = float(torch.logsumexp(v, dim).abs().max())  # sync: the doctor's
        values: tuple[float, ...] = ()
        if target and t.is_floating_point() and not empty:
            distinct = torch.unique(v)
            if len(distinct) <= _FEW:
                values = tuple(distinct.tolist())  # sync: the doctor's
    low_precision = t.dtype in (torch.float16, torch.bfloat16)
    return TensorSeen(tuple(t.shape), t.is_floating_point(), low_precision, low, high,
                      t.numel(), off_sum, off_lse, made_by, values)  # fmt: skip


class _LossMode(TorchFunctionMode):
    def __init__(self, seen: Seen) -> None:
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = LOSS_FUNCTIONS.get(func)
        if name is not None:
            self.seen.calls.append(self._record(func, name, args, kwargs))
        out = func(*args, **kwargs)
        if func in _SQUASH and isinstance(out, torch.Tensor):
            self.seen.made[_storage(out)] = (_SQUASH[func], call_site()[0])
        return out

    def _record(self, func: Any, name: str, args: Any, kwargs: dict[str, Any]) -> SeenCall:
        arguments = bound(func, args, kwargs) or {}
        x = arguments.get("input")
        dim = _class_dim(name, tuple(x.shape)) if isinstance(x, torch.Tensor) else 0
        tensors, options = {}, {}
        for key, value in arguments.items():
            if isinstance(value, torch.Tensor):
                made = self.seen.made.get(_storage(value))
                at = dim if value.dim() > dim else 0
                tensors[key] = _summary(value, at, made, target=key == "target")
            elif isinstance(value, (int, float, str, bool)) or value is None:
                options[key] = value
        return SeenCall(name, call_site()[0], tensors, options)


def seen_calls(ctx: Context) -> Seen:
    """The loss calls of one call of the user's step on the first batch (cached on `ctx`)."""
    if "loss_calls" in ctx.cache:
        return ctx.cache["loss_calls"]
    seen = Seen()
    model, opt = ctx.fresh()
    try:
        with _LossMode(seen):
            ctx.run_step(model, opt, ctx.batches[0])
    except Exception as e:  # the user's step failed: the checks that need it say so
        seen.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        ctx.reset()
    ctx.cache["loss_calls"] = seen
    return seen
