"""inplace_overwrite: an `inplace=True` op whose write reaches a tensor the forward reads again.

`out = self.relu(x)` with `nn.ReLU(inplace=True)` turns `x` itself into ReLU(x), so a residual
`out + x` adds the wrong identity, silently. The invariant: every op called with `inplace=True`
(nn.ReLU, LeakyReLU, Hardtanh, SiLU, Dropout, ... and their F.* forms) is only a memory saving,
so the model's output is the same with each one run out of place. Two eval-mode forwards on
copies of the inputs, the second with `inplace=False` at those calls; where they differ, each
call site is tried alone to name the ones that matter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from isotrain._shared import buffers_restored, restore_rng
from isotrain.doctor.ground.context import CannotRun, Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.inputs import ModelCall, rebuilt
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.watch import user_site

__all__ = ["INPLACE_OVERWRITE", "check_inplace", "model_output"]

_MAX_SITES = 8  # call sites tried one by one


class _OutOfPlace(TorchFunctionMode):
    """Records the sites of calls made with inplace=True; runs those in `swap` out of place."""

    def __init__(self, swap: set[str] | None = None) -> None:
        super().__init__()
        self.swap = swap or set()
        self.sites: dict[str, str] = {}  # file:line -> the function's name

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if kwargs.get("inplace") is True:
            where = user_site().where
            self.sites.setdefault(where, getattr(func, "__name__", str(func)))
            if where in self.swap:
                kwargs = {**kwargs, "inplace": False}
        return func(*args, **kwargs)


def _cloned(obj: Any) -> Any:
    """`obj` with every tensor in nested tuples, lists and mappings cloned (an in-place op in
    the forward then writes into the doctor's copy, never the user's batch)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, Mapping):
        return rebuilt(obj, {k: _cloned(v) for k, v in obj.items()})
    if isinstance(obj, (tuple, list)):
        return rebuilt(obj, [_cloned(v) for v in obj])
    return obj


def model_output(ctx: Context, model: Any, call: ModelCall, mode: Any = None) -> torch.Tensor:
    """The model's main output (float) for a copy of `call`'s inputs, from examine's RNG, in
    `mode` if given; no grad, the buffers put back."""
    restore_rng(ctx.rng)
    copy = ModelCall(_cloned(call.args), _cloned(call.kwargs), call.forward)
    with torch.no_grad(), buffers_restored([model]), mode or contextlib.nullcontext():
        return ctx.outputs(model, copy).float()


def _moved(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest change from `a` to `b`, relative to `a`'s scale (inf for another shape)."""
    if a.shape != b.shape:
        return float("inf")
    return float(((a - b).abs().max() / a.abs().max().clamp_min(1e-6)).item())


def check_inplace(ctx: Context) -> list[Finding]:
    """inplace_overwrite: does running the inplace=True calls out of place change the output?"""
    model, _ = ctx.fresh()
    call = ctx.call(ctx.batches[0])
    model.eval()  # dropout off: examine puts every flag back after the check
    seen = _OutOfPlace()
    a = model_output(ctx, model, call, seen)
    if not seen.sites:
        return []
    sites = list(seen.sites)[:_MAX_SITES]
    change = _moved(a, model_output(ctx, model, call, _OutOfPlace(set(sites))))
    if change <= 1e-5:
        return []
    bad = [s for s in sites if _moved(a, model_output(ctx, model, call, _OutOfPlace({s}))) > 1e-5]
    if not bad:
        raise CannotRun("the output changes only when the in-place calls run out of place together")
    shown = ", ".join(f"{seen.sites[s]} at {s}" for s in bad)
    return [Finding(
        "inplace_overwrite", "error", ", ".join(bad),
        f"running {shown} with inplace=False changes the model's output (by {change:.2g} "
        "relative): the in-place write reaches a tensor read again later (a residual's "
        "identity, a skip connection, a tensor kept for a second branch)",
        "use inplace=False there, or apply the in-place op only to a fresh tensor nobody else "
        "holds (out = self.relu(self.bn(self.conv(x))), not self.relu(x) with x kept)",
    )]  # fmt: skip


INPLACE_OVERWRITE = Check(
    "inplace_overwrite",
    (Kind("inplace_overwrite",
          "an op with inplace=True overwrites a tensor the forward reads again"),),
    check_inplace,
)  # fmt: skip
