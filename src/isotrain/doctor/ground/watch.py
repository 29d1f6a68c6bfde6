"""An op watch: a dispatch mode that sees every aten op of the user's step, with its line.

It records the ops that force a host-device sync on an accelerator (on a CPU nothing syncs,
so the ops themselves are what it sees), the first op whose output is NaN/Inf, and the inputs
of exp / log / softmax that overflow or underflow, each located at the user's `file:line`.
"""

from __future__ import annotations

import contextlib
import linecache
import math
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from isotrain._torch_private import to_target_device, tree_leaves
from isotrain.doctor.ground.dispatch import WatchMode

__all__ = [
    "DOCTOR_DIR", "STDLIB_DIR", "TORCH_DIR", "OpWatch", "Site", "bad_values", "doctors_own",
    "local", "short_path", "user_site", "value_ranges", "watching",
]  # fmt: skip

aten = torch.ops.aten
TORCH_DIR = os.path.dirname(torch.__file__)
STDLIB_DIR = os.path.dirname(contextlib.__file__)
# the whole doctor package, every room: its frames are never the user's
DOCTOR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OPTIM = os.path.join(TORCH_DIR, "optim")
_AMP = os.path.join(TORCH_DIR, "amp")  # GradScaler.step reads found_inf on the host by design
_DISTRIBUTIONS = os.path.join(TORCH_DIR, "distributions")
_MODULE_CALL = os.path.join(TORCH_DIR, "nn", "modules", "module.py")
# frames through which torch runs code of its own: a module's forward, autograd's engine
_TORCH_CALLS = {
    (_MODULE_CALL, "_call_impl"),
    (os.path.join(TORCH_DIR, "autograd", "graph.py"), "_engine_run_backward"),
}

# op -> what the user wrote to cause it
_SYNC_OPS: dict[Any, str] = {
    aten._local_scalar_dense.default: ".item() / float(t) / bool(t) / `if t:` / print(t)",
    aten.nonzero.default: "torch.nonzero / torch.where(cond) (output size depends on values)",
    aten.masked_select.default: "torch.masked_select (output size depends on values)",
    aten.equal.default: "torch.equal",
    aten.allclose.default: "torch.allclose",
    aten.is_nonzero.default: "bool(t) / `if t:`",
    aten._unique2.default: "torch.unique (output size depends on values)",
    aten.unique_consecutive.default: "torch.unique_consecutive",
    aten.unique_dim.default: "torch.unique(dim=...)",
    aten.repeat_interleave.Tensor: "repeat_interleave with tensor repeats",
    aten.bincount.default: "torch.bincount",
}
_MASK_OPS = {
    aten.index.Tensor: "x[mask] (boolean-mask indexing)",
    aten.index_put_.default: "x[mask] = v",
}
_MASK_OPS[aten.index_put.default] = "x[mask] = v"
# Python-level methods that read a tensor on the host without any aten op on a CPU
_METHODS = {"tolist": ".tolist()", "numpy": ".numpy()", "cpu": ".cpu()"}
TO_HOST = '.to("cpu")'
# A line that names the host as a `.to` target: `.to("cpu")`, `.to(device='cpu')`,
# `.to(torch.device("cpu"))`. On a CPU run `x.to(device)` is the model's own device, no sync.
_NAMES_HOST = re.compile(r"""\.to\(\s*(?:device\s*=\s*)?(?:torch\.device\(\s*)?["']cpu["']""")


@dataclass(frozen=True)
class Site:
    """Where an op came from: the innermost frame outside torch and the doctor."""

    where: str  # "file.py:42"
    library: bool  # inside an installed package (site-packages), not the user's own code
    in_optimizer: bool  # under torch.optim (its CPU step counters, not the user's code)
    marked: bool = False  # the line carries a `# sync:` comment: intentional
    names_host: bool = False  # the line moves a tensor `.to("cpu")` by name
    in_forward: bool = False  # inside a module's forward (the model's own algorithm)
    validating: bool = False  # torch.distributions checking its arguments (validate_args)


def user_site() -> Site:
    """The caller's `file:line` outside torch, the standard library and this package; an op
    that torch's own code runs on the way (a torch module's forward, such as DDP's, a
    backward hook torch registered, GradScaler's step) counts as inside a library."""
    frame = sys._getframe(1)
    in_optim = in_torch = validating = False
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_OPTIM):
            in_optim = True
        validating = validating or path.startswith(_DISTRIBUTIONS)
        if (path, frame.f_code.co_name) in _TORCH_CALLS or path.startswith(_AMP):
            in_torch = True
        if not (path.startswith((TORCH_DIR, STDLIB_DIR, DOCTOR_DIR)) or path.startswith("<frozen")):
            lib = "site-packages" in path or "dist-packages" in path
            lib = in_torch or (lib and f"{os.sep}isotrain{os.sep}" not in path)
            line = linecache.getline(path, frame.f_lineno)
            return Site(
                f"{short_path(path)}:{frame.f_lineno}", lib, in_optim, "# sync:" in line,
                bool(_NAMES_HOST.search(line)), _in_module_call(frame), validating,
            )  # fmt: skip
        frame = frame.f_back  # type: ignore[assignment]
    return Site("<torch>", True, in_optim)


def _in_module_call(frame: Any) -> bool:
    """Whether an `nn.Module.__call__` encloses `frame` (its forward is running)."""
    while frame is not None:
        if frame.f_code.co_filename == _MODULE_CALL and frame.f_code.co_name == "_call_impl":
            return True
        frame = frame.f_back
    return False


def short_path(path: str) -> str:
    """A path as the user knows it: relative to the working directory when inside it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


@dataclass
class OpWatch:
    """What one watched block did: sync ops per site, the first non-finite op, risky inputs."""

    syncs: dict[tuple[str, str], int] = field(default_factory=dict)  # (where, what) -> count
    library_syncs: set[str] = field(default_factory=set)  # wheres inside installed packages
    marked_syncs: set[str] = field(default_factory=set)  # wheres marked `# sync:`
    forward_syncs: set[str] = field(default_factory=set)  # wheres inside a module's forward
    validating_syncs: set[str] = field(default_factory=set)  # torch.distributions' checks
    nonfinite: tuple[str, str, str] | None = None  # (op, where, input ranges)
    given: tuple[str, str, str] | None = None  # the same, from a NaN/Inf number passed to it
    risks: dict[tuple[str, str], str] = field(default_factory=dict)  # (where, what) -> evidence
    library_risks: set[str] = field(default_factory=set)  # risk wheres inside installed packages
    autocast: set[torch.dtype] = field(default_factory=set)  # autocast dtypes seen
    paused: bool = False  # the doctor's own hooks run: their ops are not the user's

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Ops inside the block are the doctor's own (a hook measuring a gradient): unseen."""
        self.paused, was = True, self.paused
        try:
            yield
        finally:
            self.paused = was

    def note_risk(self, what: str, evidence: str, site: Site | None = None) -> None:
        site = site or user_site()
        self.risks.setdefault((site.where, what), evidence)
        if site.library:
            self.library_risks.add(site.where)

    def note_sync(self, what: str, site: Site | None = None) -> None:
        site = site or user_site()
        if site.in_optimizer:
            return  # the optimizer's own CPU step counter: no sync on an accelerator either
        key = (site.where, what)
        self.syncs[key] = self.syncs.get(key, 0) + 1
        if site.library:
            self.library_syncs.add(site.where)
        if site.marked:
            self.marked_syncs.add(site.where)
        if site.in_forward:
            self.forward_syncs.add(site.where)
        if site.validating:
            self.validating_syncs.add(site.where)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (an FSDP2 DTensor), the tensor itself else: what
    the doctor reads of values needs no collective (and DTensor has no host read)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def value_ranges(args: Any) -> str:
    """min..max of each floating tensor among `args`, for the evidence."""
    out = []
    for t in _dense(args):
        if t.is_floating_point() and t.numel():
            finite = t[torch.isfinite(t)]
            lo, hi = (finite.min().item(), finite.max().item()) if finite.numel() else (0.0, 0.0)
            nan = int(torch.isnan(t).sum().item())
            extra = f", {nan} NaN" if nan else ""
            out.append(f"{tuple(t.shape)} in [{lo:.3g}, {hi:.3g}]{extra}")
    return "; ".join(out) or "no floating inputs"


class _Mode(WatchMode):
    """The dispatch mode behind `watching`."""

    def __init__(self, watch: OpWatch, numerics: bool) -> None:
        super().__init__()
        self.watch, self.numerics = watch, numerics

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.watch.paused:
            return func(*args, **kwargs)
        what = _SYNC_OPS.get(func)
        if what is None and func in _MASK_OPS and _has_bool_index(args):
            what = _MASK_OPS[func]
        if what is not None:
            self.watch.note_sync(what)
        out = func(*args, **kwargs)
        if self.numerics:
            _inspect(self.watch, func, args, out)
        return out


def _has_bool_index(args: Any) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


_EXP = {aten.exp.default, aten.exp2.default, aten.expm1.default}
_LOG = {aten.log.default, aten.log2.default, aten.log10.default}
_SOFTMAX = {aten._softmax.default}
_UNINITIALISED = ("empty", "new_empty", "resize", "set_")  # whatever memory held: not data
_SKIP = {aten._local_scalar_dense.default, aten.isfinite.default, aten.detach.default}


def _inspect(watch: OpWatch, func: Any, args: Any, out: Any) -> None:
    """Record a non-finite output (the first one) and exp/log/softmax inputs near the edge."""
    if func in _SKIP or func.overloadpacket.__name__.startswith(_UNINITIALISED):
        return
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            watch.autocast.add(torch.get_autocast_dtype(device))
    x = next(iter(_dense(args[:1])), None) if args else None
    if x is not None and x.is_floating_point() and x.numel():
        _risky_input(watch, func, x)
    outs = _dense(out)
    for t in outs:
        if t.dtype in (torch.float16, torch.bfloat16) and t.numel():
            big, top = float(t.abs().max().item()), torch.finfo(t.dtype).max
            if top / 64 < big < float("inf"):
                watch.note_risk(
                    f"{t.dtype}",
                    f"{func.overloadpacket.__name__} output reaches {big:.3g} in {t.dtype}, "
                    f"within 64x of its largest finite value {top:.3g}",
                )
    made = watch.nonfinite is None and any(map(_has_bad, outs))
    if made and not any(map(_has_bad, _dense(args))):  # else carried from its inputs
        _made_nonfinite(watch, func, args)


def _made_nonfinite(watch: OpWatch, func: Any, args: Any) -> None:
    """Note the op whose output is the first NaN/Inf while its tensors are finite: it made it,
    or carries a NaN/Inf number the code passed it (max_norm=inf: NOTE [a given inf])."""
    name = str(func.overloadpacket.__name__)
    numbers = [a for a in tree_leaves(args) if isinstance(a, float) and not math.isfinite(a)]
    if not numbers:
        watch.nonfinite = (name, user_site().where, value_ranges(args))
    elif watch.given is None:
        ranges = f"{value_ranges(args)} and the number {numbers[0]}"
        watch.given = (name, user_site().where, ranges)


# NOTE [a given inf]
# clip_grad_norm_(params, float("inf")) measures the norm without clipping: inside it
# max_norm / norm is inf, then clamped to 1. An op whose NaN/Inf output comes from a NaN/Inf
# number the code passed it did not make one; nonfinite_forward names it only when the step's
# loss or a gradient at the update is not finite (that number then reached the training).


def _dense(obj: Any) -> list[torch.Tensor]:
    """The strided tensors in `obj` (a DTensor's local shard): a sparse or nested tensor's
    values are the user's ops' business, and comparing them is an op their layout may lack."""
    leaves = (obj,) if isinstance(obj, torch.Tensor) else tree_leaves(obj)  # (most outputs)
    found = (local(t) for t in leaves if isinstance(t, torch.Tensor))
    return [t for t in found if t.layout == torch.strided and not t.is_nested]


def _has_bad(t: torch.Tensor) -> bool:
    """Whether `t` holds a NaN or +inf, in one reduction (its max is NaN or +inf then): every
    op of the probe step asks, so this is the watch's hot path."""
    if not t.is_floating_point() or not t.numel():
        return False
    top = float(t.detach().amax())  # sync: the doctor's measurement
    return math.isnan(top) or top == math.inf


def bad_values(t: torch.Tensor) -> int:
    """NaN and +inf entries: -inf is what attention masks are made of (exp(-inf) = 0)."""
    return int((torch.isnan(t) | (t == float("inf"))).sum().item())


def _risky_input(watch: OpWatch, func: Any, x: torch.Tensor) -> None:
    if func in _LOG:
        bad = int((x <= 0).sum().item())
        if bad:
            evidence = f"log() of {bad} value(s) <= 0 (log(0) = -inf): input {value_ranges(x)}"
            watch.note_risk("log", evidence)
    elif func in _EXP:
        limit = math.log(torch.finfo(x.dtype).max)
        hi = float(x.max().item())
        if hi > limit - 8:  # within a factor e^8 (~3000) of the largest finite value
            evidence = f"exp() input reaches {hi:.3g}; {x.dtype} overflows beyond {limit:.3g}"
            watch.note_risk("exp", evidence)
    elif func in _SOFTMAX:
        live = x[x > -1e4]  # masked entries (-inf, finfo.min) are meant to vanish
        spread = float((live.max() - live.min()).item()) if live.numel() else 0.0
        if spread > 60:
            watch.note_risk("softmax", (
                f"softmax inputs span {spread:.3g} (e^-60 = 1e-26: the softmax saturates, its "
                "gradient vanishes, and float16 scores overflow): unscaled attention scores?"
            ))  # fmt: skip


_ACTIVE: list[OpWatch] = []  # the watches open now (innermost last)


@contextlib.contextmanager
def doctors_own() -> Iterator[None]:
    """Ops inside the block are the doctor's own, whatever watch is open (its exchange between
    ranks inside the user's collective): none of them counts as the user's."""
    with contextlib.ExitStack() as stack:
        for watch in list(_ACTIVE):
            stack.enter_context(watch.pause())
        yield


@contextlib.contextmanager
def watching(*, numerics: bool = False) -> Iterator[OpWatch]:
    """Watch every aten op inside the block (and .tolist()/.numpy()/.cpu() calls)."""
    watch = OpWatch()
    _ACTIVE.append(watch)
    saved: dict[str, Callable[..., Any]] = {}
    for name, what in _METHODS.items():
        saved[name] = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, _noting(saved[name], watch, what))
    saved["to"] = torch.Tensor.to
    torch.Tensor.to = _noting_host_copies(saved["to"], watch)  # type: ignore[method-assign]
    try:
        with _Mode(watch, numerics):
            yield watch
    finally:
        _ACTIVE.remove(watch)
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def _noting(method: Callable[..., Any], watch: OpWatch, what: str) -> Callable[..., Any]:
    def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not watch.paused and not getattr(_inside, "depth", 0):
            watch.note_sync(what)
        return _once(method, self, *args, **kwargs)

    return wrapper


# A torch function mode (WatchMode's) hands a patched method's call back to the patched
# method: the call it wraps is noted once, at the outermost wrapper.
_inside = threading.local()


def _once(method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        return method(*args, **kwargs)
    finally:
        _inside.depth -= 1


def _noting_host_copies(method: Callable[..., Any], watch: OpWatch) -> Callable[..., Any]:
    """`.to` that notes a copy to the host: from an accelerator always; on a CPU where the
    line names the host (it syncs once the step runs on an accelerator)."""

    def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        inside = watch.paused or getattr(_inside, "depth", 0) > 0
        target = None if inside else to_target_device(args, kwargs)
        if target is not None and target.type == "cpu":
            site = user_site()
            if self.device.type != "cpu" or site.names_host:
                watch.note_sync(TO_HOST, site)
        return _once(method, self, *args, **kwargs)

    return wrapper
