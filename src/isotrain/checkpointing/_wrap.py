"""How a block is checkpointed in place: its forward, its buffers, and the model's KV cache.

`_Checkpointed` is the instance forward of a wrapped block (NOTE [instance forwards] in
`isotrain._shared`: class, keys and pickling unchanged). The recomputation in backward
must start from the buffers its forward started from and leave the block's own buffers alone
(NOTE [buffers in recompute]), and must not build a KV cache again (NOTE [caches in recompute]).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from isotrain._shared import (
    ForwardWrapper,
    buffer_slots,
    find_forward,
    install_forward,
    outside_stacklevel,
    remove_forward,
)
from isotrain._torch_private import function_modes, tensor_version
from isotrain.checkpointing._selective import SELECTIVE
from isotrain.checkpointing._state import _State

__all__ = ["ModesReplayed", "disable_caches", "is_checkpointed", "unwrap", "wrap"]

# NOTE [buffers in recompute]
# Backward re-runs a checkpointed block's forward. Parameters are read-only there, but buffers
# are not, and a forward may read what it writes: BatchNorm updates its running statistics
# (torch.utils.checkpoint documents a second update as a caveat), spectral_norm advances its
# power-iteration vectors and builds the weight from them, a counter or an EMA moves. So every
# buffer of the block is copied just before its forward runs (outside the checkpointed region);
# after the forward, the copies of the buffers it wrote are kept and the others dropped. The
# recomputation runs with each written buffer swapped for a fresh copy of its pre-forward value,
# restored in `finally`: it starts from the state the forward started from, computes and saves
# exactly what the forward did, and the module's own tensors are never touched again, so
# outputs, gradients and every buffer end bit for bit as without checkpointing. "Wrote" is: any
# buffer of a module that tracks running statistics (BatchNorm kernels update them without
# bumping the tensor version), any buffer whose version changed, any buffer replaced by another
# tensor. Cost: one copy of the block's buffers per training forward (modern transformer blocks
# hold none; BatchNorm statistics are a few KB). Under torch.compile a region that writes
# buffers only as BatchNorm does traces whole (the graph applies its mutations once); one that
# writes them in Python is a graph break, and dynamo runs this same checkpoint eagerly, which
# then copies the buffers at the start of its first (forward) call.
#
# NOTE [caches in recompute]
# A model that builds a KV cache in forward (HF Transformers, `use_cache=True`, the default of
# its configs) would build it again in the recomputation: the cache doubles, T5 changes what it
# saves and backward fails, selective checkpointing misses cached outputs. HF's own
# gradient_checkpointing_enable() turns the cache off for training forwards with a warning;
# so does this, for every module above a checkpointed block whose forward takes `use_cache`:
# forwards with gradients run with use_cache=False (one warning per module, naming it); eval and
# generation under no_grad keep the cache. A block called with use_cache=True directly gets
# use_cache=False the same way.
#
# NOTE [modes in recompute]
# torch.utils.checkpoint replays the forward's autocast state in the recomputation, but not the
# torch function modes that were active (`autocast_if_available(attention="fp32")`, `with
# torch.device(...)`, a user's TorchFunctionMode): backward usually runs outside their `with`,
# so the recomputation would compute something else (attention in bf16, not fp32) and the
# non-reentrant checkpoint refuses it. The recomputation enters, outermost first, each mode the
# forward ran under that is not active at that moment, and leaves them after.


def _tracks_stats(owner: nn.Module) -> bool:
    return bool(getattr(owner, "track_running_stats", False))


class _Replay:
    """One checkpointed call: the first run is the forward, later runs are recomputations.

    `snapshot()` keeps every buffer of the block as the forward finds it; the recomputations
    start from those copies and write to them: NOTE [buffers in recompute].
    """

    def __init__(self, wrapper: _Checkpointed, kwargs: dict[str, Any]) -> None:
        self.wrapper, self.kwargs = wrapper, kwargs
        self.slots: list[tuple[nn.Module, str]] | None = None
        self.tensors: list[torch.Tensor] = []
        self.versions: list[int] = []
        self.before: list[torch.Tensor] = []
        self.written: list[tuple[nn.Module, str]] | None = None
        self.modes: list[Any] = []

    def snapshot(self) -> None:
        """Copy every buffer of the block now, before its forward writes any."""
        self.slots = buffer_slots([self.wrapper.module])
        self.tensors = [getattr(o, n) for o, n in self.slots]
        self.versions = [tensor_version(t) for t in self.tensors]
        with torch.no_grad():
            self.before = [t.clone() for t in self.tensors]

    def _settle(self) -> None:
        """After the forward: keep the copies of the buffers it wrote, drop the others."""
        slots = self.slots or []
        kept = [
            ((o, n), copy)
            for (o, n), t, v, copy in zip(slots, self.tensors, self.versions, self.before)
            if _tracks_stats(o) or getattr(o, n) is not t or tensor_version(t) != v
        ]
        self.written, self.before = [s for s, _ in kept], [c for _, c in kept]
        self.tensors, self.versions = [], []

    def __call__(self, *args: Any) -> Any:
        w = self.wrapper
        if torch.compiler.is_compiling():  # traced into the graph: NOTE [buffers in recompute]
            return w.call_inner(*args, **self.kwargs)
        if self.written is None:  # the forward
            if self.slots is None:  # dynamo gave this call back to eager at a graph break
                self.snapshot()
            self.modes = function_modes()  # NOTE [modes in recompute]
            try:
                return w.call_inner(*args, **self.kwargs)
            finally:
                self._settle()
        return self._recompute(args)

    def _recompute(self, args: tuple[Any, ...]) -> Any:
        """Backward's rerun, from the buffers the forward started from, writing to copies."""
        written = self.written or []
        originals = [getattr(o, n) for o, n in written]
        # Selective checkpointing counts every op of the rerun against the forward's and
        # refuses one more clone (torch allows it one backward anyway): use the copies as they are.
        scratch = self.before if self.wrapper.selective else [t.clone() for t in self.before]
        try:
            for (o, n), t in zip(written, scratch):
                setattr(o, n, t)
            with _modes_entered(self.modes):  # NOTE [modes in recompute]
                return self.wrapper.call_inner(*args, **self.kwargs)
        finally:
            for (o, n), t in zip(written, originals):
                setattr(o, n, t)


@contextmanager
def _modes_entered(modes: list[Any]) -> Iterator[None]:
    """Enter, outermost first, each of `modes` that is not active now; leave them after."""
    with ExitStack() as stack:
        active = function_modes()
        for mode in modes:
            if not any(mode is m for m in active):
                stack.enter_context(mode)
        yield


class ModesReplayed:
    """`fn` for `checkpoint`: its first call is the forward, and later calls (recomputations)
    run under the function modes that call ran under (NOTE [modes in recompute])."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.modes: list[Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.modes is None:
            self.modes = function_modes()
            return self.fn(*args, **kwargs)
        with _modes_entered(self.modes):
            return self.fn(*args, **kwargs)


class _Checkpointed(ForwardWrapper):
    """A block's forward under non-reentrant checkpoint; `selective` picks the op policy."""

    def __init__(self, module: nn.Module, inner: Any, selective: bool = False) -> None:
        super().__init__(module, inner)
        self.selective, self.warned = selective, False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _State.bypass or not torch.is_grad_enabled():
            return self.call_inner(*args, **kwargs)
        if kwargs.get("use_cache"):  # NOTE [caches in recompute]
            kwargs["use_cache"] = False
            self.warned = self.warned or _warn_cache(type(self.module).__name__)
        ctx: dict[str, Any] = {"context_fn": SELECTIVE} if self.selective else {}
        replay = _Replay(self, kwargs)
        if not torch.compiler.is_compiling():
            replay.snapshot()  # before the forward, outside the checkpointed region
        return checkpoint(replay, *args, use_reentrant=False, **ctx)


def _warn_cache(where: str) -> bool:
    warnings.warn(
        f"activation checkpointing: {where} was called with use_cache=True (or its config says "
        "so); a cache built in forward would be built again when checkpointed blocks recompute "
        "in backward, so forwards with gradients now run with use_cache=False (eval and no_grad "
        "forwards keep the cache). Pass use_cache=False when training to silence this, and "
        "compare against the unwrapped model called with use_cache=False: the cache lays K and V "
        "out differently, which some CPUs' kernels round differently.",
        stacklevel=outside_stacklevel(),
    )
    return True


class _NoCache(ForwardWrapper):
    """Training forwards of a module above checkpointed blocks run with use_cache=False."""

    def __init__(self, module: nn.Module, inner: Any, index: int, default: Any) -> None:
        super().__init__(module, inner)
        self.index, self.default, self.warned = index, default, False  # index: positional slot

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and not _State.bypass:
            positional = 0 <= self.index < len(args)
            value = args[self.index] if positional else kwargs.get("use_cache")
            if value is None:
                config = getattr(self.module, "config", None)
                value = getattr(config, "use_cache", None)
            if value if value is not None else self.default:
                if positional:
                    args = (*args[: self.index], False, *args[self.index + 1 :])
                else:
                    kwargs["use_cache"] = False
                self.warned = self.warned or _warn_cache(type(self.module).__name__)
        return self.call_inner(*args, **kwargs)


def _use_cache_slot(module: nn.Module) -> tuple[int, Any] | None:
    """(positional index or -1, default) of `use_cache` in the class's forward, or None."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]  # no self
    except (TypeError, ValueError):
        return None
    for i, p in enumerate(params):
        if p.name == "use_cache":
            positional = p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            return (i if positional else -1), (None if p.default is p.empty else p.default)
    return None


def disable_caches(model: nn.Module, block_names: list[str]) -> None:
    """`_NoCache` on exactly the root and the ancestors of `block_names` that take use_cache
    (kept where already installed, so each warns once; removed from every other module)."""
    names = {""} | {b.rsplit(".", i)[0] for b in block_names for i in range(1, b.count(".") + 1)}
    names = names if block_names else set()
    for name, module in model.named_modules():
        if name not in names:
            remove_forward(module, _NoCache)
        elif find_forward(module, _NoCache) is None and (slot := _use_cache_slot(module)):
            install_forward(module, _NoCache, *slot)


def wrap(module: nn.Module, selective: bool = False) -> None:
    install_forward(module, _Checkpointed, selective)


def unwrap(module: nn.Module) -> None:
    remove_forward(module, _Checkpointed)
    remove_forward(module, _NoCache)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether `module` runs under activation checkpointing (isotrain wrapping or the block)."""
    if find_forward(module, _Checkpointed) is not None:
        return True
    return getattr(module, "checkpoint_mode", "none") != "none"
