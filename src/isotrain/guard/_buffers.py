"""Buffers are training state: a skipped step leaves them as they were before its forward.

BatchNorm updates its running statistics in the forward, long before the guard decides. One
NaN image then poisons every running mean of a step the guard skips, and eval returns NaN.
`StepGuard` (by default wherever the model has floating-point buffers a forward writes; or
`protect_buffers=True`) copies the model's persistent buffers at the first forward after each
step and, on a skip, selects the copies back: NOTE [protected buffers].
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from isotrain._shared import buffer_slots
from isotrain._torch_private import foreach_copy_, non_persistent_buffer_names, tensor_version

__all__ = ["BufferGuard"]

# NOTE [protected buffers]
# What: the persistent buffers (those in the state dict: BatchNorm statistics, counters, EMAs);
# non-persistent ones are caches derived from other state (causal masks, rotary tables).
# When: a forward pre-hook on the model copies them at the first forward after a guarded step
# (one foreach copy into buffers reused every step), so micro-batches, eval forwards in between
# and resumes (load_state_dict before training) are all covered. On a skip they are selected
# back with torch.where on the device (NaN-safe, no sync) or, in host mode, copied back.
# Cost: one copy of the buffers per step plus, in the device modes, one select: for BatchNorm
# nets a few KB to MB, nothing for models without buffers. The hook runs eagerly under
# torch.compile (a graph break at the top of a whole-model compile, none for per-block compile).
# It holds the guard weakly: a dropped guard leaves an inert hook; `close()` removes it.
#
# NOTE [protect by default]
# Left to its default, protection is on for a model with floating-point persistent buffers, and
# the first step decides whether it stays: if its forwards wrote none of them (no module that
# tracks running statistics in training mode, no buffer whose version moved: a frozen table,
# BatchNorm in eval), the hook is removed and later steps cost nothing.


class _CaptureHook:
    """The model's forward pre-hook: copy the buffers at the first forward after a step."""

    def __init__(self, owner: BufferGuard | None) -> None:
        self.ref = weakref.ref(owner) if owner is not None else None
        self.capture = _capture() if owner is not None else None

    def __call__(self, module: nn.Module, args: Any) -> None:
        owner = self.ref() if self.ref is not None else None
        if owner is not None and owner.armed and self.capture is not None:
            self.capture(owner)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_CaptureHook, (None,))  # a pickled or copied model gets an inert hook


def _capture_eagerly(owner: BufferGuard) -> None:
    owner.capture()


@functools.cache
def _capture() -> Callable[[BufferGuard], None]:
    """The capture, never traced: under a whole-model torch.compile a graph break, not a guard
    on `armed`. Wrapped at the first hook, as `torch.compiler.disable` imports dynamo (2.5 s)."""
    return torch.compiler.disable(_capture_eagerly)


class BufferGuard:
    """Copies of a model's persistent buffers, taken before each step's forward, for skips.

    Example: ``bg = BufferGuard(model, warn); ...forward...; bg.settle(ok, host=False)``
    """

    def __init__(
        self, model: nn.Module, warn: Callable[[str, str], None], *, auto: bool = False
    ) -> None:
        self.slots = [
            (o, n) for o, n in buffer_slots([model]) if n not in non_persistent_buffer_names(o)
        ]
        self._warn = warn
        self.auto = auto  # NOTE [protect by default]: the first step decides whether to stay
        self.off = False  # ... and decided to go
        self._versions: list[int] = []
        self.armed, self.captured = True, False
        self._src: list[torch.Tensor] = []
        self._copies: list[torch.Tensor] = []
        self._handle = model.register_forward_pre_hook(_CaptureHook(self))

    def capture(self) -> None:
        """Copy the buffers now (the hook calls this at the first forward after a step)."""
        self.armed = False
        tensors = [getattr(o, n) for o, n in self.slots]
        same = len(tensors) == len(self._src) and all(a is b for a, b in zip(tensors, self._src))
        if not same:  # (re)allocate once; reused while the buffers stay the same tensors
            self._src, self._copies = tensors, [torch.empty_like(t) for t in tensors]
        if tensors:
            with torch.no_grad():
                foreach_copy_(self._copies, tensors)
        if self.auto:
            self._versions = [tensor_version(t) for t in tensors]
        self.captured = True

    @property
    def has_float(self) -> bool:
        """Whether any protected buffer is floating point (what the default protects)."""
        return any(getattr(o, n).is_floating_point() for o, n in self.slots)

    def _stay(self) -> bool:
        """NOTE [protect by default]: did the forwards write a floating-point buffer?"""
        self.auto = False
        for (o, _), t, v in zip(self.slots, self._src, self._versions):
            tracks = getattr(o, "track_running_stats", False) and o.training
            if t.is_floating_point() and (tracks or tensor_version(t) != v):
                return True
        self.close()
        self.off = True
        return False

    def settle(self, ok: torch.Tensor | bool, *, host: bool) -> None:
        """After the decision: keep the buffers if `ok`, else put back the captured copies."""
        if self.off:
            return
        if not self.captured:
            self._warn(
                "buffers",
                "protect_buffers: no forward of the model ran since the last step (or since the "
                "guard was built), so there was nothing to restore; build the guard before the "
                "first forward and pass the model whose forward the loop calls"
                + (
                    " (protection is on by default for a model with floating-point buffers; "
                    "protect_buffers=False turns it off)"
                    if self.auto
                    else ""
                ),
            )
        elif self.slots and (not self.auto or self._stay()):
            with torch.no_grad():
                self._restore(ok, host)
        self.armed, self.captured = True, False

    def _restore(self, ok: torch.Tensor | bool, host: bool) -> None:
        pairs = [(getattr(o, n), c) for (o, n), c in zip(self.slots, self._copies)]
        pairs = [(t, c) for (t, c), s in zip(pairs, self._src) if t is s]  # not replaced since
        if host:
            if not ok and pairs:
                foreach_copy_([t for t, _ in pairs], [c for _, c in pairs])
            return
        assert isinstance(ok, torch.Tensor)
        on_device = {ok.device: ok}
        for cur, old in pairs:
            if cur.device not in on_device:
                self._warn(
                    "buffer-device",
                    f"a buffer on {cur.device} while the guard decides on {ok.device}: the skip "
                    "decision is copied there every step (a sync)",
                )
                on_device[cur.device] = ok.to(cur.device)  # sync: a buffer on another device
            torch.where(on_device[cur.device], cur, old, out=cur)  # selection, NaN-safe

    def close(self) -> None:
        """Remove the forward pre-hook from the model."""
        self._handle.remove()
