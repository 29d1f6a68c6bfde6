"""The few helpers several patterns need, each written once: blocks, devices, RNG, modes.

Private to isotrain: the pattern packages import it, users reach `find_blocks` through
`isotrain`. It imports only torch and the standard library.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import random
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "BlockSpec",
    "ForwardWrapper",
    "all_cuda_devices",
    "buffer_slots",
    "buffers_restored",
    "capture_rng",
    "cuda_devices",
    "find_blocks",
    "find_forward",
    "install_forward",
    "outside_stacklevel",
    "remove_forward",
    "restore_rng",
    "restore_training_flags",
    "rng_differences",
    "seed_rng",
    "training_flags",
]

BlockSpec = type[nn.Module] | tuple[type[nn.Module], ...] | Callable[[str, nn.Module], bool] | None


# ------------------------------------------------------------------------------ blocks
def _matcher(model: nn.Module, modules: BlockSpec) -> tuple[Callable[[str, nn.Module], bool], str]:
    """A `(name, module) -> bool` test for `modules` and words for what it looks for."""
    if modules is None:

        def in_list(name: str, mod: nn.Module) -> bool:
            parent = model.get_submodule(name.rpartition(".")[0]) if name else None
            return isinstance(parent, nn.ModuleList)

        return in_list, "the children of an nn.ModuleList (the usual transformer block list)"
    if isinstance(modules, type) or (
        isinstance(modules, tuple) and modules and all(isinstance(t, type) for t in modules)
    ):
        types = modules if isinstance(modules, tuple) else (modules,)

        def of_type(name: str, mod: nn.Module) -> bool:
            return name != "" and isinstance(mod, types)

        return of_type, "submodules of type " + " or ".join(t.__name__ for t in types)
    if callable(modules) and not isinstance(modules, type):
        return modules, f"submodules matching the predicate {getattr(modules, '__name__', modules)}"
    raise TypeError(
        "modules must be an nn.Module subclass, a tuple of them, or a predicate "
        f"(name, module) -> bool; got {modules!r}. Example: modules=(Block,)"
    )


def find_blocks(
    model: nn.Module, modules: BlockSpec = None, *, purpose: str = "blocks"
) -> list[tuple[str, nn.Module]]:
    """The `(name, module)` blocks of `model`, outermost matches only, in model order.

    `modules` is a block type, a tuple of types, a predicate `(name, module) -> bool`, or None
    for the children of every outermost `nn.ModuleList`. Raises ValueError naming what it
    looked for when nothing matches. One rule for checkpointing, compile and FSDP wrapping.

    Example: ``[name for name, _ in find_blocks(gpt)]  # ["blocks.0", "blocks.1", ...]``
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    match, looked_for = _matcher(model, modules)
    chosen: list[tuple[str, nn.Module]] = []
    for name, mod in model.named_modules():
        if any(name.startswith(c + ".") for c, _ in chosen):
            continue  # inside a chosen block: the outer one already covers it
        if match(name, mod):
            chosen.append((name, mod))
    if not chosen:
        raise ValueError(
            f"found no {purpose} in {type(model).__name__}: looked for {looked_for}. "
            f"Pass modules={_suggest(model)} or a predicate (name, module) -> bool"
        )
    return chosen


def _suggest(model: nn.Module) -> str:
    """`modules=` text naming the class that repeats most among containers' children (ResNet's
    BasicBlock in an nn.Sequential), or a placeholder when nothing repeats."""
    counts: dict[type[nn.Module], int] = {}
    for mod in model.modules():
        if isinstance(mod, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            for child in mod.children():
                if not isinstance(child, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
                    counts[type(child)] = counts.get(type(child), 0) + 1
    best = max(counts.items(), key=lambda kv: kv[1], default=(None, 0))
    if best[0] is None or best[1] < 2:
        return "(YourBlock,)"
    name, n = best[0].__name__, best[1]
    return f"({name},) ({name} repeats {n} times; blocks in an nn.Sequential need naming)"


# ------------------------------------------------------------------------ forward wrappers
# NOTE [instance forwards]
# Checkpointing and compile change what a block's forward does without changing its class,
# type(), repr or state-dict keys: they set `module.forward` (an instance attribute, which
# nn.Module.__call__ prefers over the class's) to a ForwardWrapper. A wrapper is a plain object
# of a module-level class holding the module and the instance forward it replaced, so
# copy.deepcopy and torch.save(model) / torch.load(weights_only=False) carry it along (a bound
# method of a module-level function cannot be unpickled: pickle looks the function up on the
# instance). Wrappers stack; each kind can be removed from anywhere in the stack. Dynamo
# traces a wrapper's __call__ like any forward, and shares one graph across blocks.
class ForwardWrapper:
    """Base of the forwards isotrain installs on a module instance: NOTE [instance forwards]."""

    def __init__(self, module: nn.Module, inner: Callable[..., Any] | None) -> None:
        self.module, self.inner = module, inner
        # The class's forward, held as a function: tracing it needs no import of its module.
        self.base: Callable[..., Any] = type(module).forward

    def call_inner(self, *args: Any, **kwargs: Any) -> Any:
        """The forward this wrapper replaced: an earlier instance forward, or the class's."""
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return self.base(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call_inner(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        """The replaced forward's signature: frameworks read it (HF Trainer keeps only the
        dataset columns `model.forward` names)."""
        inner = self.inner if self.inner is not None else self.base.__get__(self.module)
        return inspect.signature(inner)


def install_forward(module: nn.Module, wrapper: type[ForwardWrapper], *args: Any) -> Any:
    """Set `module.forward = wrapper(module, <current instance forward>, *args)`; return it."""
    made = wrapper(module, module.__dict__.get("forward"), *args)
    module.forward = made
    return made


def find_forward(module: nn.Module, kind: type[ForwardWrapper]) -> Any:
    """The installed wrapper of type `kind` on `module`, or None."""
    fn = module.__dict__.get("forward")
    while isinstance(fn, ForwardWrapper):
        if isinstance(fn, kind):
            return fn
        fn = fn.inner
    return None


def remove_forward(module: nn.Module, kind: type[ForwardWrapper]) -> bool:
    """Take every wrapper of type `kind` out of `module`'s forward stack; whether one was."""
    removed, outer, fn = False, None, module.__dict__.get("forward")
    while isinstance(fn, ForwardWrapper):
        if isinstance(fn, kind):
            removed = True
            if outer is not None:
                outer.inner = fn.inner
            elif fn.inner is not None:
                module.forward = fn.inner
            else:
                del module.__dict__["forward"]
        else:
            outer = fn
        fn = fn.inner
    return removed


# ----------------------------------------------------------------------------- buffers
def buffer_slots(modules: Iterable[nn.Module]) -> list[tuple[nn.Module, str]]:
    """`(owner, name)` of every buffer under `modules`, each tensor once, in model order."""
    seen: set[int] = set()
    out = []
    for root in modules:
        for owner in root.modules():
            for name, buf in owner.named_buffers(recurse=False):
                if id(buf) not in seen:
                    seen.add(id(buf))
                    out.append((owner, name))
    return out


@contextlib.contextmanager
def buffers_restored(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Put every buffer's value back on exit, in place (BatchNorm statistics, counters)."""
    saved = [(o, n, getattr(o, n).clone()) for o, n in buffer_slots(modules)]
    try:
        yield
    finally:
        with torch.no_grad():
            for owner, name, value in saved:
                current = getattr(owner, name)
                if current is None or current.shape != value.shape:
                    setattr(owner, name, value)  # replaced meanwhile: put the old one back
                else:
                    current.copy_(value)


# ----------------------------------------------------------------------------- devices
def cuda_devices(obj: Any) -> list[int]:
    """Sorted CUDA device indices of the tensors inside `obj` (nested tuples, lists, dicts)."""
    found: set[int] = set()
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.device.type == "cuda":
                found.add(item.device.index if item.device.index is not None else 0)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return sorted(found)


# ---------------------------------------------------------------------------- warnings
_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.abspath(__file__))


def outside_stacklevel() -> int:
    """`warnings.warn` stacklevel, for the caller of this function, that names the first frame
    outside torch and isotrain: the user's line, however deep the module call chain."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        path = frame.f_code.co_filename
        if not (path.startswith(_TORCH_DIR) or path.startswith(_OWN_DIR)):
            return level
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return 1


# --------------------------------------------------------------------------------- RNG
def _accelerators() -> list[tuple[str, Any]]:
    """Single-generator backends that `torch.manual_seed` also reseeds (mps, xpu)."""
    mods = [("mps", torch.mps)] if torch.backends.mps.is_available() else []
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        mods.append(("xpu", xpu))
    return mods


def capture_rng(cuda: Iterable[int] = (), *, numpy: bool = True) -> dict[str, Any]:
    """Every global RNG state: Python, torch CPU, the given CUDA devices, mps/xpu, numpy.

    numpy's legacy state is taken only when numpy is imported (otherwise nobody used it) and
    `numpy=True`; leave it out of anything loaded with `weights_only=True`.
    """
    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": {i: torch.cuda.get_rng_state(i) for i in cuda},
    }
    for name, mod in _accelerators():
        state[name] = mod.get_rng_state()
    np = sys.modules.get("numpy")
    if numpy and np is not None:
        state["numpy"] = np.random.get_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set every RNG state `capture_rng` returned (a snapshot's round trip included)."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    cuda = state.get("cuda") or {}
    for i, s in cuda.items() if isinstance(cuda, dict) else enumerate(cuda):
        if int(i) < torch.cuda.device_count():
            torch.cuda.set_rng_state(s, int(i))
    for name, mod in _accelerators():
        if name in state:
            mod.set_rng_state(state[name])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])


def seed_rng(seed: int, cuda: Iterable[int] = ()) -> None:
    """Seed exactly the generators `capture_rng(cuda)` covers, and no other CUDA device."""
    random.seed(seed)
    torch.default_generator.manual_seed(seed)
    for i in cuda:
        torch.cuda.default_generators[i].manual_seed(seed)
    for _, mod in _accelerators():
        mod.manual_seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed % 2**32)


def rng_differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Names of the generators whose state differs between two `capture_rng` results."""
    out = []
    if before.get("python") != after.get("python"):
        out.append("Python random state")
    if not torch.equal(before["torch"], after["torch"]):
        out.append("torch RNG state")
    for i, state in before.get("cuda", {}).items():
        if i in after.get("cuda", {}) and not torch.equal(state, after["cuda"][i]):
            out.append(f"CUDA RNG state (device {i})")
    for name, _ in _accelerators():
        if name in before and name in after and not torch.equal(before[name], after[name]):
            out.append(f"{name} RNG state")
    if "numpy" in before and "numpy" in after:
        a, b = before["numpy"], after["numpy"]  # ('MT19937', keys, pos, has_gauss, gauss)
        same = a[0] == b[0] and (a[1] == b[1]).all() and a[2:] == b[2:]
        if not same:
            out.append("numpy RNG state")
    return out


def all_cuda_devices(*, initialized_only: bool = False) -> list[int]:
    """Every visible CUDA device index; none when CUDA is absent (or not yet initialised)."""
    if not torch.cuda.is_available() or (initialized_only and not torch.cuda.is_initialized()):
        return []
    return list(range(torch.cuda.device_count()))


# ------------------------------------------------------------------------------- modes
def training_flags(modules: Iterable[nn.Module]) -> list[tuple[nn.Module, bool]]:
    """Each submodule's own `training` flag, so a restore brings back mixed modes exactly."""
    return [(m, m.training) for root in modules for m in root.modules()]


def restore_training_flags(flags: list[tuple[nn.Module, bool]]) -> None:
    """Put back what `training_flags` captured (never `model.train(flag)`: that clobbers)."""
    for m, flag in flags:
        m.training = flag
