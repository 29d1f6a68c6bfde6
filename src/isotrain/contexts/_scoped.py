"""State contexts that always undo themselves: eval/train mode, frozen params, autocast, RNG.

Every context captures the state it changes on entry and restores it in ``finally``, so an
exception inside the block, nesting in any order, or a submodule kept in a different mode than
its parent (a frozen BatchNorm in eval while the rest trains) all come back exactly.
``StateAudit`` (in ``_audit``) checks that a block leaked nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from isotrain._shared import (
    all_cuda_devices,
    capture_rng,
    restore_rng,
    restore_training_flags,
    seed_rng,
    training_flags,
)
from isotrain.contexts._attention import Fp32Attention

__all__ = [
    "AutocastInfo",
    "autocast_if_available",
    "capture_rng_state",
    "eval_mode",
    "frozen",
    "resolve_autocast",
    "restore_rng_state",
    "rng_isolated",
    "train_mode",
]

# NOTE [per-submodule restore]
# `model.train(was_training)` (the common recipe) sets *every* submodule to the parent's flag,
# so a BatchNorm deliberately held in eval while its parent trains silently starts updating its
# running stats after the first evaluation. We record `{module: module.training}` for every
# submodule and write the flags back one by one. Writing the attribute (not calling `.train()`)
# restores exactly what was captured, even for modules that override `train()`.


def _check_modules(fn_name: str, modules: tuple[Any, ...]) -> None:
    if not modules:
        raise TypeError(f"{fn_name}() needs at least one nn.Module, e.g. {fn_name}(model)")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(
                f"{fn_name}() takes nn.Module arguments, got {type(m).__name__}; "
                f"pass the modules positionally: {fn_name}(model_a, model_b)"
            )


def _one_or_all(modules: tuple[nn.Module, ...]) -> nn.Module | tuple[nn.Module, ...]:
    return modules[0] if len(modules) == 1 else modules


@contextmanager
def _restoring_training_flags(modules: tuple[nn.Module, ...]) -> Iterator[None]:
    flags = training_flags(modules)
    try:
        yield
    finally:
        restore_training_flags(flags)


@contextmanager
def eval_mode(*modules: nn.Module, no_grad: bool = True, inference: bool = False) -> Iterator[Any]:
    """Put modules in eval mode (and no-grad) for the block; restore every submodule's flag.

    Example::

        with eval_mode(model) as m:  # several: `with eval_mode(a, b) as (a, b):`
            val_loss = compute_val_loss(m, val_loader)

    ``inference=True`` uses ``torch.inference_mode`` (faster; its tensors can't enter autograd
    later); ``no_grad=False`` keeps the current grad mode.
    """
    _check_modules("eval_mode", modules)
    with ExitStack() as stack:
        stack.enter_context(_restoring_training_flags(modules))
        for m in modules:
            m.eval()
        if inference:
            stack.enter_context(torch.inference_mode())
        elif no_grad:
            stack.enter_context(torch.no_grad())
        yield _one_or_all(modules)


@contextmanager
def train_mode(*modules: nn.Module, enable_grad: bool = True) -> Iterator[Any]:
    """Mirror of :func:`eval_mode`: ``train()`` and grad on inside, every flag restored after.

    Example::

        with eval_mode(model):
            with train_mode(model.adapter):  # e.g. test-time adaptation of one part
                loss = model(x, y)
    """
    _check_modules("train_mode", modules)
    with ExitStack() as stack:
        stack.enter_context(_restoring_training_flags(modules))
        for m in modules:
            m.train()
        if enable_grad:
            if torch.is_inference_mode_enabled():
                stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.enable_grad())
        yield _one_or_all(modules)


@contextmanager
def frozen(*modules: nn.Module) -> Iterator[Any]:
    """Turn ``requires_grad`` off for every parameter; restore each parameter's own flag after.

    Example::

        with frozen(model.encoder):
            loss = model(x, y)  # only the rest gets gradients
            loss.backward()
    """
    _check_modules("frozen", modules)
    # dict keyed by the parameter itself: shared/tied parameters are captured once
    flags = {p: p.requires_grad for m in modules for p in m.parameters()}
    try:
        for p in flags:
            p.requires_grad_(False)
        yield _one_or_all(modules)
    finally:
        for p, flag in flags.items():
            p.requires_grad_(flag)


# ----------------------------------------------------------------------------------- autocast


@dataclass(frozen=True)
class AutocastInfo:
    """What :func:`autocast_if_available` enabled, and why.

    Example: ``with autocast_if_available() as amp: print(amp.enabled, amp.dtype, amp.reason)``
    """

    enabled: bool
    device_type: str
    dtype: torch.dtype | None  # None when disabled
    needs_grad_scaler: bool  # True for float16: small gradients underflow without loss scaling
    reason: str
    attention: str = "autocast"  # "fp32": scaled_dot_product_attention runs in fp32 inside


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _device_available(device_type: str) -> bool:
    if device_type == "cpu":
        return True
    if device_type == "mps":
        return torch.backends.mps.is_available()
    mod = getattr(torch, device_type, None)
    is_available = getattr(mod, "is_available", None)
    return bool(is_available()) if callable(is_available) else False


def _bf16_supported(device_type: str) -> bool:
    if device_type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device_type == "mps":
        check = getattr(torch.backends.mps, "is_macos_or_newer", None)
        return bool(check(14, 0)) if callable(check) else False
    return True


Attention = Literal["autocast", "fp32"]


def resolve_autocast(
    dtype: torch.dtype = torch.bfloat16,
    *,
    device: str | torch.device | None = None,
    enabled: bool = True,
    attention: Attention = "autocast",
) -> AutocastInfo:
    """Decide what :func:`autocast_if_available` would enable, without entering it.

    Example: ``scaler = GradScaler("cuda") if resolve_autocast().needs_grad_scaler else None``.
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.bfloat16, got {dtype!r}")
    if attention not in ("autocast", "fp32"):
        raise ValueError(
            f"attention must be 'autocast' (attention in the autocast dtype) or 'fp32', "
            f"got {attention!r}"
        )
    if device is None:
        device_type = _default_device_type()
    elif isinstance(device, (str, torch.device)):
        device_type = torch.device(device).type
    else:
        raise TypeError(f"device must be a str, torch.device or None, got {type(device).__name__}")

    def off(reason: str) -> AutocastInfo:
        return AutocastInfo(False, device_type, None, False, reason)

    if not enabled:
        return off("disabled by enabled=False")
    if not torch.amp.is_autocast_available(device_type):
        return off(f"torch.autocast does not support device type {device_type!r}")
    if not _device_available(device_type):
        return off(f"device {device_type!r} is not available")
    if dtype not in _LOW_PRECISION:
        return off(f"autocast on {device_type} supports bfloat16/float16, not {dtype}")
    reason = f"{device_type} autocast to {dtype}"
    if dtype == torch.bfloat16 and not _bf16_supported(device_type):
        dtype = torch.float16
        reason = f"bfloat16 unsupported on this {device_type} device; falling back to float16"
    if attention == "fp32":
        reason += ", attention in fp32"
    return AutocastInfo(True, device_type, dtype, dtype == torch.float16, reason, attention)


@contextmanager
def autocast_if_available(
    dtype: torch.dtype = torch.bfloat16,
    *,
    device: str | torch.device | None = None,
    enabled: bool = True,
    attention: Attention = "autocast",
) -> Iterator[AutocastInfo]:
    """Mixed precision where the device supports it, a no-op elsewhere; yields an AutocastInfo.

    Example::

        with autocast_if_available() as amp:  # cuda if available, else cpu; bfloat16
            loss = model(x, y)
        # amp.enabled, amp.dtype, amp.needs_grad_scaler, amp.reason say what happened

    ``attention="fp32"``: matmuls in the low-precision dtype, but every
    ``F.scaled_dot_product_attention`` on fp32 inputs, forward and backward (NOTE [fp32
    attention]); weights, gradients and optimizer state stay fp32 as with plain autocast.
    """
    info = resolve_autocast(dtype, device=device, enabled=enabled, attention=attention)
    if info.enabled and info.dtype != dtype:
        warnings.warn(
            f"{info.reason}: float16 gradients can underflow, so scale the loss with "
            f"torch.amp.GradScaler({info.device_type!r}) (AutocastInfo.needs_grad_scaler is True)",
            stacklevel=3,  # past contextlib's __enter__ to the `with` line
        )
    if not info.enabled:
        yield info
        return
    with ExitStack() as stack:
        stack.enter_context(torch.autocast(info.device_type, dtype=info.dtype))
        if attention == "fp32":
            stack.enter_context(Fp32Attention())
        yield info


# ---------------------------------------------------------------------------------------- RNG


def _cuda_indices(devices: Iterable[int | str | torch.device] | None) -> list[int]:
    if devices is None:
        # Like torch.random.fork_rng: capturing the states initialises CUDA if it is available.
        return all_cuda_devices()
    out = []
    for d in devices:
        dev = torch.device(d) if not isinstance(d, int) else torch.device("cuda", d)
        if dev.type != "cuda":
            raise ValueError(f"rng_isolated(devices=...) takes CUDA devices or indices, got {d!r}")
        out.append(dev.index if dev.index is not None else torch.cuda.current_device())
    return out


@contextmanager
def rng_isolated(
    seed: int | None = None, *, devices: Iterable[int | str | torch.device] | None = None
) -> Iterator[None]:
    """Restore the Python, numpy, torch CPU, CUDA (and mps/xpu) global RNG states after the block.

    Evaluation or sampling inside training then leaves the training run bit-identical::

        with eval_mode(model), rng_isolated(seed=0):  # seed: same eval draws every time
            samples = model.generate(prompt)

    ``devices``: CUDA devices to cover (default: all, when CUDA is available); ``seed`` seeds
    exactly the generators that are restored.
    """
    if seed is not None and not isinstance(seed, int):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    if seed is not None:
        _try_import_numpy()  # so its state is captured before we seed it
    cuda = _cuda_indices(devices)
    state = capture_rng(cuda)
    try:
        if seed is not None:
            seed_rng(seed, cuda)
        yield
    finally:
        restore_rng(state)


def capture_rng_state() -> dict[str, Any]:
    """Every global RNG state (Python, torch CPU, each CUDA device), loadable with
    ``torch.load(weights_only=True)``: what a snapshot stores to resume bit for bit.

    Example: ``state = capture_rng_state(); ...; restore_rng_state(state)``
    """
    return capture_rng(all_cuda_devices(), numpy=False)


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set the global RNG states that :func:`capture_rng_state` returned.

    Example: ``restore_rng_state(torch.load(path, weights_only=True)["rng"])``
    """
    restore_rng(state)


def _try_import_numpy() -> None:
    with suppress(ImportError):
        import numpy  # noqa: F401
