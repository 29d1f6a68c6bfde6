"""autocast_not_applied: inside the user's autocast region, matmul-class ops in float32.

The call watch's dispatch mode saw them during the first traced call (NOTE [escapes] in
ground.calls): an in-place or out= form autocast leaves alone, a region opened for another device
than the tensors', a custom kernel autocast has no rule for (information); torch's own
"Disabling autocast" warning says a region never opened at all. A region turned off inside
the user's own (NOTE [float32 islands]) is judged by the matmul FLOPs it runs in float32.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.amp.autocast_mode import autocast
from torch.utils.flop_counter import flop_registry

from isotrain._torch_private import tree_leaves
from isotrain.doctor.ground.calls import call_site
from isotrain.doctor.ground.context import Context
from isotrain.doctor.ground.dispatch import WatchMode
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.trace import patched, trace_ok

__all__ = ["AUTOCAST_NOT_APPLIED", "check_autocast"]

_DISABLED = "Disabling autocast"
WARN_SHARE, INFO_SHARE = 0.25, 0.05  # of the region's matmul FLOPs run in float32


def _fix(what: str) -> str:
    if "in-place" in what:
        return "use the out-of-place op (torch.addmm(...), no out=) so autocast casts it"
    return "open the region for the tensors' device: torch.autocast(device_type=x.device.type)"


def check_autocast(ctx: Context) -> list[Finding]:
    """One finding per line whose matmul-class op escaped the autocast region it ran in, and
    per float32 island inside the region that runs a share of its matmul FLOPs."""
    watch = trace_ok(ctx).watch
    islands, composite = _islands(ctx)
    out = []
    for (where, what), n in sorted(watch.fp32_ops.items()):
        out.append(Finding(
            "autocast_not_applied", "warning", where,
            f"{n} call(s) per step: {what}: the step runs it in full precision, slower than "
            "the region promises",
            _fix(what),
        ))  # fmt: skip
    for (where, what), n in sorted(watch.opaque_ops.items()):
        op = what.split(" ")[2]
        if op in composite:
            continue  # its kernel's matmuls ran in the region (counted with the islands)
        out.append(Finding(
            "autocast_not_applied", "info", where,
            f"{n} call(s) per step: {what}; if it multiplies matrices, it does so in float32",
            f"register an autocast rule for it: torch.library.register_autocast({op!r}, "
            "device_type, torch.bfloat16)",
        ))  # fmt: skip
    for where, message in {w: m for w, m in watch.warned if _DISABLED in m}.items():
        said = message.splitlines()[0].rstrip(".")
        out.append(Finding(
            "autocast_not_applied", "warning", where,
            f"torch disabled your autocast region: {said}; every op in it runs in float32",
            "open the region for the device the model runs on: torch.autocast("
            "device_type=next(model.parameters()).device.type, dtype=torch.bfloat16)",
        ))  # fmt: skip
    return out + islands


# NOTE [float32 islands]
# Inside an autocast region the user's code may turn autocast off again: a nested
# torch.autocast(enabled=False) (a with block or a decorator), or an autograd.Function whose
# forward is decorated custom_fwd(cast_inputs=torch.float32). What runs there runs in the
# dtype of its inputs, float32 for a model kept in float32. That is right for a numerically
# sensitive op (a norm, a softmax, a loss, a router's logits: few or no matmul FLOPs) and
# wrong for a block whose matmuls are the work the region was opened for. The doctor runs one
# call of the step with torch.autocast's enter and exit watched (the regions the step opens,
# innermost last, and the line that opened each) and a dispatch mode counting the FLOPs of
# each forward matmul-class op (torch.utils.flop_counter's formulas) run while a region is
# open, by the dtype it ran in. Float32 FLOPs under a turned-off scope are that scope's: a
# warning from WARN_SHARE of the region's matmul FLOPs, information from INFO_SHARE, nothing
# below. A custom op runs under the autocast state the user's code had (a dispatch mode
# handler runs with autocast off): torch autocasts the matmuls inside its body.
@dataclass
class _Scope:
    """One torch.autocast the step entered: its device, whether it is on, and where."""

    key: int  # id of the autocast object
    device: str
    enabled: bool
    dtype: torch.dtype
    where: str
    what: str


@dataclass
class _Tally:
    """The scopes open now (innermost last) and the matmul FLOPs counted so far."""

    thread: int
    stack: list[_Scope] = field(default_factory=list)
    total: dict[str, float] = field(default_factory=dict)  # device -> matmul FLOPs in a region
    region: dict[str, torch.dtype] = field(default_factory=dict)  # device -> the region's dtype
    island: dict[tuple[str, str, str], list[float]] = field(default_factory=dict)
    composite: set[str] = field(default_factory=set)  # custom ops whose kernels run matmuls

    def scopes(self, device: str) -> tuple[_Scope | None, _Scope | None]:
        """The innermost scope for `device`, and the innermost one that is on."""
        mine = [s for s in self.stack if s.device == device]
        on = [s for s in mine if s.enabled]
        return (mine[-1] if mine else None), (on[-1] if on else None)

    def enter(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def enter(cm: Any) -> Any:
            if threading.get_ident() == self.thread:
                dtype = cm.fast_dtype
                self.stack.append(_Scope(id(cm), cm.device, bool(cm._enabled), dtype,
                                         *_entered_at(sys._getframe(1))))  # fmt: skip
            return original(cm)

        return enter

    def exit(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def exit_(cm: Any, *exc: Any) -> Any:
            try:
                return original(cm, *exc)
            finally:
                for i in range(len(self.stack) - 1, -1, -1):
                    if self.stack[i].key == id(cm):
                        del self.stack[i]
                        break

        return exit_


def _entered_at(frame: Any) -> tuple[str, str]:
    """Where a scope was entered and what entered it (custom_fwd, a decorator, a with)."""
    code, local = frame.f_code.co_name, frame.f_locals
    if code == "decorate_fwd" and callable(local.get("fwd")):
        cast = local.get("cast_inputs")
        what = f"custom_fwd(cast_inputs={cast}) of {local['fwd'].__qualname__}"
    elif code == "decorate_autocast" and callable(local.get("func")):
        what = f"@torch.autocast(enabled=False) on {local['func'].__qualname__}"
    else:
        what = "torch.autocast(enabled=False)"
    return call_site()[0], what


class _Flops(WatchMode):
    """The forward matmul-class ops' FLOPs while a region is open, by the dtype they ran in."""

    def __init__(self, tally: _Tally, kernel: str | None = None) -> None:
        super().__init__()
        self.tally, self.kernel = tally, kernel  # kernel: the custom op whose kernel this sees

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        t = self.tally
        if not t.stack or torch._C._current_autograd_node() is not None:  # none, or backward
            return func(*args, **kwargs)
        floats = [x for x in tree_leaves(args) if isinstance(x, torch.Tensor)
                  and x.is_floating_point()]  # fmt: skip
        if not floats:
            return func(*args, **kwargs)
        device, dtype = floats[0].device.type, floats[0].dtype
        inner, on = t.scopes(device)
        if inner is None or on is None:
            return func(*args, **kwargs)
        if getattr(func, "namespace", "aten") not in ("aten", "prim", "prims"):
            return self._custom(func, args, kwargs, inner)
        out = func(*args, **kwargs)
        flops = _flops(func, args, kwargs, out)
        if flops and self.kernel is not None:
            t.composite.add(self.kernel)  # a custom op whose matmuls autocast reaches
        if flops:
            t.total[device] = t.total.get(device, 0.0) + flops
            t.region[device] = on.dtype
            if not inner.enabled and dtype == torch.float32:
                n = t.island.setdefault((device, inner.where, inner.what), [0.0, 0.0])
                n[0], n[1] = n[0] + flops, n[1] + 1
        return out

    def _custom(self, func: Any, args: Any, kwargs: Any, inner: _Scope) -> Any:
        """A custom op's kernel, run under the autocast state the user's code had (WatchMode
        enters it), its inner ops counted: the kernel is reached by redispatching to the
        device's key, so this mode sees its ops and not the op again."""
        key = _BACKEND.get(inner.device)
        if key is None:
            return func(*args, **kwargs)
        with _Flops(self.tally, func.name()):
            return func.redispatch(torch._C.DispatchKeySet(key), *args, **kwargs)


_BACKEND = {"cpu": torch._C.DispatchKey.CPU, "cuda": torch._C.DispatchKey.CUDA}


_aten = torch.ops.aten
_SDPA_CPU = _aten._scaled_dot_product_flash_attention_for_cpu
_COMPOSITE = (_aten.matmul, _aten.linear)  # linear: the weight's last dim (in_features)


def _flops(func: Any, args: Any, kwargs: Any, out: Any) -> float:
    """A matmul-class op's FLOPs (torch.utils.flop_counter's formula), 0 for any other op."""
    packet = func.overloadpacket
    if packet is _SDPA_CPU:  # q (B, H, L, E), k (B, H, S, E), v (B, H, S, Ev)
        q, k, v = args[:3]
        b, h, n, e = q.shape
        return 2.0 * b * h * n * k.shape[-2] * (e + v.shape[-1])
    if packet in _COMPOSITE and isinstance(out, torch.Tensor):  # seen undecomposed in a kernel
        return 2.0 * out.numel() * args[packet is _aten.linear].shape[-1]
    formula = flop_registry.get(packet)
    if formula is None:
        return 0.0
    try:
        return float(formula(*args, **kwargs, out_val=out))
    except Exception:  # a formula that does not take this overload's arguments
        return 0.0


def _islands(ctx: Context) -> tuple[list[Finding], set[str]]:
    """NOTE [float32 islands]: one call of the step, its scopes and matmul FLOPs counted; and
    the custom ops whose kernels ran aten ops there."""
    tally = _Tally(threading.get_ident())
    model, opt = ctx.fresh()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(patched(autocast, "__enter__", tally.enter))
            stack.enter_context(patched(autocast, "__exit__", tally.exit))
            stack.enter_context(_Flops(tally))
            ctx.run_step(model, opt, ctx.batches[0])
    finally:
        ctx.reset()
    out = []
    for (device, where, what), (flops, ops) in sorted(tally.island.items()):
        share, dtype = flops / tally.total[device], tally.region[device]
        if share < INFO_SHARE:
            continue
        small = "" if share >= WARN_SHARE else ": a float32 island, under a quarter of them"
        out.append(Finding(
            "autocast_not_applied", "warning" if share >= WARN_SHARE else "info", where,
            f"{what}, inside your autocast({device}, {_name(dtype)}) region, runs {ops:.0f} "
            f"matmul-class op(s) per step in float32: {_mega(flops)} of the region's "
            f"{_mega(tally.total[device])} matmul FLOPs ({share:.0%}), which it would run in "
            f"{_name(dtype)}{small}",
            _island_fix(what),
        ))  # fmt: skip
    return out, tally.composite


def _island_fix(what: str) -> str:
    if what.startswith("custom_fwd"):
        return (
            "custom_fwd(cast_inputs=torch.float32) turns autocast off for the whole forward: "
            "drop cast_inputs so autocast casts its matmuls, and upcast only the numerically "
            "sensitive part (x.float() on a reduction's input)"
        )
    return (
        "end the autocast(enabled=False) block before its matmuls: keep in float32 only the op "
        "that needs it (a norm, a softmax, the loss), or cast that op's inputs with .float() "
        "inside the region"
    )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _mega(flops: float) -> str:
    return f"{flops / 1e6:.3g} MFLOP" if flops < 1e9 else f"{flops / 1e9:.3g} GFLOP"


AUTOCAST_NOT_APPLIED = Check(
    "autocast_not_applied",
    (Kind("autocast_not_applied", "inside an autocast region, matmul-class ops run in float32"),),
    check_autocast,
)
