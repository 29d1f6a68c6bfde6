"""The precision run: one call of the user's step, watched for what 16-bit floats do to it.

A torch function mode records the loss functions that return a float16/bfloat16 value (each
recomputed in float32 beside it) and whether the step makes float16 tensors with a graph;
`torch.autograd.backward` is wrapped to measure, once, what float16 does to the gradient
(NOTE [scaled twin]); `GradScaler.scale`, and a subclass's own, is wrapped to leave a scaled
loss alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from isotrain.doctor.ground.calls import LOSS_FUNCTIONS, call_site
from isotrain.doctor.ground.context import CannotRun, Context, params_of
from isotrain.doctor.ground.trace import patched

__all__ = ["GradError", "HalfStep", "LossSeen", "half_step", "half_step_ok"]

LOW = (torch.float16, torch.bfloat16)
# NOTE [scaled twin]
# Multiplying a loss by a power of two S and dividing its gradient by S again changes nothing
# in float32 or bfloat16 (their exponent range holds both), so the two gradients agree bit for
# bit. Where the backward computes in float16, values below its smallest normal number (6.1e-5)
# lose their low bits and those below 6e-8 become 0; times S they do not. The doctor takes
# both gradients of the step's first backward itself (torch.autograd.grad, retain_graph=True:
# nothing reaches .grad) and compares them per parameter. S is the largest of 2**16, 2**12,
# 2**8, 2**4 whose gradient is finite. A loss a GradScaler scaled is not measured.
_SCALES = (2.0**16, 2.0**12, 2.0**8, 2.0**4)


@dataclass(frozen=True)
class LossSeen:
    """A loss function that returned a 16-bit value, and the same call in float32."""

    name: str
    where: str
    dtype: torch.dtype
    value: float
    reference: float  # the same call on the inputs cast to float32
    in_autocast: bool


@dataclass(frozen=True)
class GradError:
    """One parameter's gradient as the step computes it against its scaled twin."""

    name: str
    relative: float  # |g - g_twin| / |g_twin|
    flushed: int  # elements 0 in g, nonzero in the twin
    nonzero: int  # nonzero elements of the twin


@dataclass
class HalfStep:
    """What the precision run saw."""

    losses: list[LossSeen] = field(default_factory=list)
    half: bool = False  # the step made float16 tensors that carry a graph
    half_params: bool = False  # some optimized parameter is float16
    scaled: bool = False  # an enabled GradScaler scaled a loss the step backpropagated
    backward_at: str = "your step"
    grads: list[GradError] | None = None  # per parameter, when measured
    scale: float = 0.0  # the S of NOTE [scaled twin]
    not_measured: str | None = None  # why the gradient was not measured
    error: str | None = None


class _Mode(TorchFunctionMode):
    def __init__(self, seen: HalfStep) -> None:
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            return out
        if out.dtype == torch.float16 and out.grad_fn is not None:
            self.seen.half = True
        name = LOSS_FUNCTIONS.get(func)
        if name is not None and out.dtype in LOW and out.numel() == 1:
            self.seen.losses.append(_loss_seen(name, func, out, args, kwargs))
        return out


def _loss_seen(name: str, func: Any, out: torch.Tensor, args: Any, kwargs: Any) -> LossSeen:
    """The record of a 16-bit loss, with the same call recomputed on float32 inputs."""

    def wide(a: Any) -> Any:
        return a.detach().float() if isinstance(a, torch.Tensor) and a.dtype in LOW else a

    on = torch.is_autocast_enabled(out.device.type)
    try:
        with torch.no_grad(), torch.autocast(out.device.type, enabled=False):
            ref = float(func(*map(wide, args), **{k: wide(v) for k, v in kwargs.items()}))
    except (RuntimeError, TypeError, ValueError):  # a call float32 inputs do not fit
        ref = float("nan")
    value = float(out.detach().float())  # sync: the doctor's measurement
    return LossSeen(name, call_site()[0], out.dtype, value, ref, on)


class _Watch:
    """The wrappers of the precision run; they write into `seen`."""

    def __init__(self, ctx: Context, model: torch.nn.Module) -> None:
        names = {id(p): n for n, p in params_of(model).items()}
        params = {id(p): p for o in ctx.optimizers for g in o.param_groups for p in g["params"]}
        self.params = [(names.get(i, "?"), p) for i, p in params.items() if p.requires_grad]
        self.seen = HalfStep(half_params=any(p.dtype == torch.float16 for _, p in self.params))
        self.measured = False

    def backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def patched(tensors: Any, grad_tensors: Any = None, *args: Any, **kwargs: Any) -> Any:
            if not self.measured and isinstance(tensors, torch.Tensor) and grad_tensors is None:
                self.measured = True
                self.seen.backward_at = call_site()[0]
                if (self.seen.half or self.seen.half_params) and not self.seen.scaled:
                    self._measure(tensors)
            return original(tensors, grad_tensors, *args, **kwargs)

        return patched

    def _measure(self, loss: torch.Tensor) -> None:
        """NOTE [scaled twin]: the step's gradient against the scaled one, per parameter."""
        wanted = [p for _, p in self.params]
        if loss.numel() != 1 or not wanted or loss.grad_fn is None:
            return
        try:
            plain = torch.autograd.grad(loss, wanted, retain_graph=True, allow_unused=True)
            if not all(g is None or bool(g.isfinite().all()) for g in plain):
                self.seen.not_measured = "the gradient itself is not finite"
                return
            for s in _SCALES:
                twin = torch.autograd.grad(loss * s, wanted, retain_graph=True, allow_unused=True)
                if all(g is None or bool(g.isfinite().all()) for g in twin):
                    break
            else:
                self.seen.not_measured = "the loss times 16 already overflows float16"
                return
        except RuntimeError as e:  # e.g. reentrant checkpointing refuses autograd.grad
            self.seen.not_measured = f"autograd.grad raised {str(e).splitlines()[0]}"
            return
        self.seen.scale = s
        self.seen.grads = [
            _compare(name, g, t / s)
            for (name, _), g, t in zip(self.params, plain, twin, strict=True)
            if g is not None and t is not None
        ]

    def scaled(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def patched(scaler: Any, outputs: Any) -> Any:
            if scaler.is_enabled():
                self.seen.scaled = True
            return original(scaler, outputs)

        return patched


def _compare(name: str, g: torch.Tensor, twin: torch.Tensor) -> GradError:
    g, twin = g.detach().float(), twin.detach().float()
    nz = twin != 0
    norm = float(twin.norm())  # sync: the doctor's measurement
    rel = float((g - twin).norm()) / norm if norm > 0 else 0.0
    return GradError(name, rel, int((nz & (g == 0)).sum()), int(nz.sum()))


def _scalers(cls: type[torch.amp.GradScaler] = torch.amp.GradScaler) -> list[type]:
    """GradScaler and each subclass with its own `scale` (FSDP's ShardedGradScaler never calls
    GradScaler.scale), so a loss any of them scales is seen as scaled."""
    own: list[type] = [cls] if "scale" in cls.__dict__ else []
    subs: list[type[torch.amp.GradScaler]] = cls.__subclasses__()
    return own + [c for sub in subs for c in _scalers(sub)]


def half_step(ctx: Context) -> HalfStep:
    """The precision run (cached on `ctx`): one watched call of the step on the first batch."""
    if "half step" in ctx.cache:
        return ctx.cache["half step"]
    model, opt = ctx.fresh()
    w = _Watch(ctx, model)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(patched(torch.autograd, "backward", w.backward))
            for scaler in _scalers():
                stack.enter_context(patched(scaler, "scale", w.scaled))
            stack.enter_context(_Mode(w.seen))
            ctx.run_step(model, opt, ctx.batches[0])
    except Exception as e:  # the user's step failed: the checks that need it say so
        w.seen.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    ctx.cache["half step"] = w.seen
    return w.seen


def half_step_ok(ctx: Context) -> HalfStep:
    """The precision run, or CannotRun when the user's step raised in it."""
    seen = half_step(ctx)
    if seen.error is not None:
        raise CannotRun(f"your step raised {seen.error}")
    return seen
