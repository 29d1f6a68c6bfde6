"""A call watch: the torch functions the user's step calls, seen with their real arguments.

A `TorchFunctionMode` sees `F.cross_entropy(logits, targets, ignore_index=...)` as the user
wrote it (aten only sees its decomposition), the softmax whose output reaches a loss, the
tensors that carry an autograd graph, and whether an autocast region is open; a light
dispatch mode below it names matmul-class ops that run in float32 inside that region.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from isotrain._torch_private import tree_leaves
from isotrain.doctor.ground.dispatch import WatchMode
from isotrain.doctor.ground.watch import DOCTOR_DIR, STDLIB_DIR, TORCH_DIR, short_path

__all__ = [
    "LOSS_FUNCTIONS",
    "CallWatch",
    "LossCall",
    "bound",
    "call_site",
    "reduction",
    "watching_calls",
]


LOSSES = {
    F.cross_entropy: "cross_entropy", F.nll_loss: "nll_loss", F.mse_loss: "mse_loss",
    F.l1_loss: "l1_loss", F.smooth_l1_loss: "smooth_l1_loss", F.huber_loss: "huber_loss",
}  # fmt: skip
LOSS_FUNCTIONS: dict[Any, str] = {  # every torch.nn.functional loss (nn.*Loss modules call them)
    getattr(F, n): n
    for n in dir(F)
    if (n.endswith("_loss") or n in ("cross_entropy", "binary_cross_entropy",
                                     "binary_cross_entropy_with_logits", "kl_div"))
    and callable(getattr(F, n))
}  # fmt: skip
ELEMENTWISE = {"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss"}  # input and target align
_SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax}
aten = torch.ops.aten
# NOTE [escapes]
# Autocast casts out-of-place matmul-class ops (_MATMUL) above the dispatch mode, so the mode
# sees them in the region's dtype. What reaches it on float32 inputs while a region is open
# escaped: an in-place or out= form (autocast leaves those alone), an op on a device the
# region was not opened for (autocast("cuda") around a model on the CPU), or a custom op
# autocast has no rule for whose kernel runs no aten op the region could reach (a C++ or
# Triton kernel): that last one is information, since its kernel may not multiply matrices.
_MATMUL = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.addbmm, aten.convolution,
           aten._scaled_dot_product_flash_attention_for_cpu,
           aten._scaled_dot_product_efficient_attention,
           aten._scaled_dot_product_flash_attention}  # fmt: skip
_INPLACE = {aten.addmm_, aten.baddbmm_, aten.addbmm_}


def call_site() -> tuple[str, str]:
    """(the user's `file:line`, the innermost line outside torch): the first frame outside
    torch, the standard library, this package and installed packages, and the innermost one
    outside torch (a library's own line when the call is inside one). A call the doctor's own
    step makes (model(**batch).loss) has no user's line: both are the innermost one."""
    frame: Any = sys._getframe(1)
    inner = None
    while frame is not None:
        path = frame.f_code.co_filename
        if inner is not None and path.startswith(DOCTOR_DIR):
            return inner, inner  # above here is the doctor, not the user's step
        if not (path.startswith((TORCH_DIR, STDLIB_DIR, DOCTOR_DIR)) or path.startswith("<frozen")):
            where = f"{short_path(path)}:{frame.f_lineno}"
            inner = inner or where
            library = "site-packages" in path or "dist-packages" in path
            if not library or f"{os.sep}isotrain{os.sep}" in path:
                return where, inner
        frame = frame.f_back
    return inner or "<torch>", inner or "<torch>"


@dataclass
class LossCall:
    """One loss-function call of the step, with what the checks need of its arguments."""

    name: str
    step: int
    where: str  # the user's line
    inner: str  # the innermost line outside torch (a library's, when inside one)
    input_shape: tuple[int, ...]
    target_shape: tuple[int, ...]
    target: torch.Tensor | None  # integer class targets, copied
    ignore_index: int
    reduction: str
    probabilities: str | None  # evidence that the input rows are probabilities
    softmax_at: str | None  # where the softmax that made the input ran
    value: float | None = None  # the mean-reduced loss it returned
    weight: torch.Tensor | None = None  # a class-index loss's per-class weight, copied
    pos_weight: torch.Tensor | None = None  # a BCE-with-logits loss's per-label pos_weight
    positives: torch.Tensor | None = None  # with it: each label's positive targets (> 0.5)


@dataclass
class CallWatch:
    """Everything the call watch saw in one step (`step` says which)."""

    step: int = 0
    calls: list[LossCall] = field(default_factory=list)
    weighted: list[LossCall] = field(default_factory=list)  # BCE-with-logits with a pos_weight
    last_loss: torch.Tensor | None = None  # the latest scalar loss output (for the reference)
    graphs: dict[int, tuple[Any, str]] = field(default_factory=dict)  # id -> (weakref, line)
    region: dict[str, torch.dtype] = field(default_factory=dict)  # autocast open at the call
    fp32_ops: dict[tuple[str, str], int] = field(default_factory=dict)  # (line, what) -> count
    opaque_ops: dict[tuple[str, str], int] = field(default_factory=dict)  # custom kernels, same
    warned: list[tuple[str, str]] = field(default_factory=list)  # (line, message)
    softmax_at: dict[int, str] = field(default_factory=dict)  # storage pointer -> line


def _probabilities(x: torch.Tensor) -> str | None:
    """Evidence that `x` holds probabilities over its class dimension (all >= 0, rows sum to 1)."""
    if not x.is_floating_point() or x.numel() == 0 or x.dim() == 0:
        return None
    with torch.no_grad():
        v = x.detach().float()
        # sync: the doctor's measurement inside the traced step (its own call, not the user's)
        if not bool(torch.isfinite(v).all()) or bool(v.min() < 0):
            return None
        dim = 1 if v.dim() > 1 else 0
        off = float((v.sum(dim) - 1).abs().max())
    if off > (1e-3 if x.dtype == torch.float32 else 2e-2):
        return None
    return (
        f"all {x.numel()} values in [{float(v.min()):.3g}, {float(v.max()):.3g}] and every row "
        f"sums to 1 (off by at most {off:.1g})"
    )


class _CallMode(TorchFunctionMode):
    def __init__(self, watch: CallWatch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        w = self.watch
        w.region = {d: torch.get_autocast_dtype(d) for d in ("cpu", "cuda")
                    if torch.is_autocast_enabled(d)}  # fmt: skip
        call = _loss_call(w, func, args, kwargs) if func in LOSSES else None
        if func is F.binary_cross_entropy_with_logits:
            bce = _loss_call(w, func, args, kwargs)
            if bce is not None and bce.pos_weight is not None:
                w.weighted.append(bce)  # read by class_weight_order alone
        out = func(*args, **kwargs)
        if call is not None:
            scalar = isinstance(out, torch.Tensor) and out.numel() == 1
            if scalar and call.reduction == "mean":
                call.value = float(out.detach().float())  # sync: the doctor's, not the step's
            if scalar and call.reduction == "mean" and out.requires_grad:
                w.last_loss = out  # the loss the reference gradient differentiates
            w.calls.append(call)
        elif func in _SOFTMAX and isinstance(out, torch.Tensor):
            w.softmax_at[_storage(out)] = call_site()[0]
        if isinstance(out, torch.Tensor) and out.grad_fn is not None:
            w.graphs[id(out)] = (weakref.ref(out), call_site()[0])
        return out


def _storage(t: torch.Tensor) -> int:
    """The address of `t`'s storage (shared by its views), or its id for a storage-less one."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # a tensor subclass without one
        return id(t)


def bound(func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """A call's arguments by parameter name, as passed (defaults not filled in), or None when
    they do not bind to the function's signature (the call itself will raise)."""
    try:
        return dict(inspect.signature(func).bind(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return None


def reduction(arguments: Mapping[str, Any]) -> str:
    """The reduction a loss call performs: its `reduction`, or what the legacy
    `size_average`/`reduce` pair means when either is given (torch's own reading of them)."""
    size_average, reduce = arguments.get("size_average"), arguments.get("reduce")
    if size_average is None and reduce is None:
        return str(arguments.get("reduction", "mean"))
    if reduce is False:
        return "none"
    return "sum" if size_average is False else "mean"


def _loss_call(w: CallWatch, func: Any, args: Any, kwargs: dict[str, Any]) -> LossCall | None:
    """The call's record, taken before it runs (the target may be changed in place later)."""
    arguments = bound(func, args, kwargs)
    if arguments is None:
        return None
    x, y = arguments.get("input"), arguments.get("target")
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        return None
    where, inner = call_site()
    name = LOSS_FUNCTIONS[func]
    ce = name in ("cross_entropy", "nll_loss")
    classes = ce and not y.is_floating_point()
    probs = _probabilities(x) if ce else None
    softmax = w.softmax_at.get(_storage(x)) if probs else None
    weight = arguments.get("weight") if classes else None
    weight = weight.detach().float().clone() if isinstance(weight, torch.Tensor) else None
    pos_weight, positives = _label_counts(arguments.get("pos_weight"), y)
    return LossCall(
        name, w.step, where, inner, tuple(x.shape), tuple(y.shape),
        y.detach().clone() if classes else None, int(arguments.get("ignore_index", -100)),
        reduction(arguments), probs, softmax, weight=weight, pos_weight=pos_weight,
        positives=positives,
    )  # fmt: skip


def _label_counts(
    pos_weight: Any, y: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A (L,) pos_weight, copied, and each of the L labels' positive targets along y's last
    dimension (the one pos_weight broadcasts along); (None, None) for any other."""
    if not isinstance(pos_weight, torch.Tensor) or pos_weight.dim() != 1 or y.dim() == 0:
        return None, None
    if len(pos_weight) < 2 or y.shape[-1] != len(pos_weight) or not y.is_floating_point():
        return None, None
    with torch.no_grad():
        positives = (y.detach() > 0.5).reshape(-1, len(pos_weight)).sum(0)
    return pos_weight.detach().float().clone(), positives


class _PrecisionMode(WatchMode):
    """Matmul-class ops that escape an open autocast region on float32 inputs: NOTE [escapes]."""

    def __init__(self, watch: CallWatch) -> None:
        super().__init__()
        self.watch = watch

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        region = self.watch.region
        if not region:
            return func(*args, **kwargs)
        device, fp32 = _float32_device(args)
        if getattr(func, "namespace", "aten") not in ("aten", "prim", "prims"):
            return self._custom(func, args, kwargs, device, region, fp32=fp32)
        if not fp32:
            return func(*args, **kwargs)
        packet, what = func.overloadpacket, None
        if packet in _INPLACE or (packet in _MATMUL and str(func).endswith(".out")):
            what = f"{func} (an in-place or out= form, which autocast does not cast)"
        elif packet in _MATMUL and device not in region:
            what = f"{func} on {device} (the region is for {', '.join(region)})"
        if what is not None:
            self._note(what, region.get(device or "", next(iter(region.values()))))
        return func(*args, **kwargs)

    def _custom(
        self, func: Any, args: Any, kwargs: Any, device: Any, region: Any, *, fp32: bool
    ) -> Any:
        """A custom op, run as torch runs it (inside autocast: WatchMode); named when its
        inputs are all float32 and its kernel runs no aten op the region could cast."""
        dtype = region.get(device)
        with _Inner() as inner:
            out = func(*args, **kwargs)
        outs = [
            t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()
        ]
        if fp32 and dtype and not inner.ops and outs and outs[0].dtype == torch.float32:
            self._note(f"custom op {func.name()} (no rule in autocast, no aten ops inside: its "
                       "kernel got float32 inputs)", dtype, info=True)  # fmt: skip
        return out

    def _note(self, what: str, dtype: torch.dtype, *, info: bool = False) -> None:
        key = (call_site()[0], f"{what} ran in float32 inside autocast({dtype})")
        table = self.watch.opaque_ops if info else self.watch.fp32_ops
        table[key] = table.get(key, 0) + 1


_MOVES = {"detach", "alias", "view", "_unsafe_view", "as_strided", "t", "transpose", "permute",
          "expand", "contiguous", "clone", "copy_", "_to_copy", "lift_fresh", "empty", "empty_like",
          "new_empty", "empty_strided"}  # fmt: skip


class _Inner(WatchMode):
    """Whether a custom op computes with aten ops of its own (a composite op autocast
    reaches), not only moves or views data around a kernel outside the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "aten" and func.overloadpacket.__name__ not in _MOVES:
            self.ops += 1  # (the custom op itself passes here first: not counted)
        return func(*args, **(kwargs or {}))


def _float32_device(args: Any) -> tuple[str | None, bool]:
    floats = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        return None, False
    return floats[0].device.type, all(t.dtype == torch.float32 for t in floats)


@contextlib.contextmanager
def watching_calls(watch: CallWatch, *, precision: bool = False) -> Iterator[CallWatch]:
    """Watch the torch calls of a block into `watch`, with the warnings it raises; with
    `precision`, the dtype of matmul-class ops inside autocast too."""

    def note(message: Any, category: Any, *rest: Any, **kw: Any) -> None:
        watch.warned.append((call_site()[0], str(message)))

    with warnings.catch_warnings():  # puts showwarning back too
        warnings.simplefilter("always")
        warnings.showwarning = note
        with contextlib.ExitStack() as modes:
            modes.enter_context(_CallMode(watch))
            if precision:
                modes.enter_context(_PrecisionMode(watch))
            yield watch
