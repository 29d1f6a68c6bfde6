"""Audit of PyTorch's invisible state: report anything a block changed and did not restore.

``StateAudit`` snapshots grad/inference/anomaly mode, autocast, default dtype, deterministic
flags, thread count, matmul precision, compiler stance, subnormal flushing, the global RNGs
and (for the modules you pass) every training and ``requires_grad`` flag and every buffer
(BatchNorm statistics, bit for bit), optionally every parameter value and gradient too, then
names each difference.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from isotrain._shared import (
    all_cuda_devices,
    buffer_slots,
    capture_rng,
    restore_rng,
    rng_differences,
)
from isotrain._torch_private import compiler_stance
from isotrain.contexts._subnormals import subnormals_flushed

__all__ = ["StateAudit", "StateLeakError", "assert_isolated"]

F = TypeVar("F", bound=Callable[..., Any])


class StateLeakError(AssertionError):
    """A block left global or module state different from how it found it.

    Example: ``except StateLeakError as e: print(e.differences)  # ["grad mode: True -> False"]``
    """

    def __init__(self, differences: list[str]) -> None:
        self.differences = list(differences)
        lines = "\n".join(f"  - {d}" for d in self.differences)
        super().__init__(f"state leaked from the block ({len(self.differences)}):\n{lines}")


# label -> reader: scalar global state, reported as "label: before -> after"
_GLOBALS: dict[str, Callable[[], Any]] = {
    "grad mode": torch.is_grad_enabled,
    "inference mode": torch.is_inference_mode_enabled,
    "autocast cpu enabled": lambda: torch.is_autocast_enabled("cpu"),
    "autocast cpu dtype": lambda: torch.get_autocast_dtype("cpu"),
    "autocast cuda enabled": lambda: torch.is_autocast_enabled("cuda"),
    "autocast cuda dtype": lambda: torch.get_autocast_dtype("cuda"),
    "autocast cache": torch.is_autocast_cache_enabled,
    "default dtype": torch.get_default_dtype,
    "deterministic algorithms": torch.are_deterministic_algorithms_enabled,
    "deterministic warn_only": torch.is_deterministic_algorithms_warn_only_enabled,
    "num threads": torch.get_num_threads,
    "anomaly mode": torch.is_anomaly_enabled,
    "anomaly check_nan": torch.is_anomaly_check_nan_enabled,
    "float32 matmul precision": torch.get_float32_matmul_precision,
    "compiler stance": compiler_stance,
    "subnormals flushed": subnormals_flushed,
}


def _module_flags(
    modules: tuple[nn.Module, ...],
) -> tuple[list[tuple[str, nn.Module, bool]], list[tuple[str, nn.Parameter, bool]]]:
    """Return [(label, module, training)] and [(label, param, requires_grad)]."""
    mods, params = [], []
    for i, root in enumerate(modules):
        prefix = f"{i}." if len(modules) > 1 else ""
        root_label = str(i) if len(modules) > 1 else "<root>"
        for name, m in root.named_modules():
            mods.append((prefix + name if name else root_label, m, m.training))
        for name, p in root.named_parameters():
            params.append((prefix + name, p, p.requires_grad))
    return mods, params


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (a NaN equals the same NaN; -0.0 differs from 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    try:
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    except RuntimeError:  # a dtype or layout without a byte view: compare values
        return torch.equal(a, b)


class _Values:
    """Buffers (and optionally parameters and their .grad) of the audited modules, copied."""

    def __init__(self, modules: tuple[nn.Module, ...], params: bool) -> None:
        self.buffers: list[tuple[str, nn.Module, str, torch.Tensor, torch.Tensor]] = []
        names = {}
        for i, root in enumerate(modules):
            prefix = f"{i}." if len(modules) > 1 else ""
            names.update({id(m): prefix + n for n, m in root.named_modules()})
        for owner, name in buffer_slots(modules):
            t = getattr(owner, name)
            label = f"{names[id(owner)]}.{name}".lstrip(".")
            self.buffers.append((label, owner, name, t, t.detach().clone()))
        self.params: list[tuple[str, nn.Parameter, torch.Tensor, Any, Any]] = []
        if params:
            for label, p, _ in _module_flags(modules)[1]:
                g = p.grad
                self.params.append(
                    (label, p, p.detach().clone(), g, g.clone() if g is not None else None)
                )

    def differences(self) -> list[str]:
        out = []
        for label, owner, name, t, saved in self.buffers:
            now = getattr(owner, name, None)
            if now is not t:
                out.append(f"buffer '{label}' replaced")
            elif not _same_bits(now.detach(), saved):
                out.append(f"buffer '{label}' changed")
        for label, p, saved, g, g_saved in self.params:
            if not _same_bits(p.detach(), saved):
                out.append(f"parameter '{label}' changed")
            if p.grad is not g or (g is not None and not _same_bits(g, g_saved)):
                out.append(f"parameter '{label}' grad changed")
        return out

    def restore(self) -> None:
        with torch.no_grad():
            for _, owner, name, t, saved in self.buffers:
                setattr(owner, name, t)
                t.copy_(saved)
            for _, p, saved, g, g_saved in self.params:
                p.copy_(saved)
                p.grad = g
                if g is not None:
                    g.copy_(g_saved)


def _restore_globals(before: dict[str, Any]) -> None:
    def changed(*labels: str) -> bool:
        return any(_GLOBALS[label]() != before[label] for label in labels)

    if changed("grad mode"):
        torch.set_grad_enabled(before["grad mode"])
    for dev in ("cpu", "cuda"):
        if changed(f"autocast {dev} enabled", f"autocast {dev} dtype"):
            torch.set_autocast_enabled(dev, before[f"autocast {dev} enabled"])
            torch.set_autocast_dtype(dev, before[f"autocast {dev} dtype"])
    if changed("autocast cache"):
        torch.set_autocast_cache_enabled(before["autocast cache"])
    if changed("default dtype"):
        torch.set_default_dtype(before["default dtype"])
    if changed("deterministic algorithms", "deterministic warn_only"):
        torch.use_deterministic_algorithms(
            before["deterministic algorithms"], warn_only=before["deterministic warn_only"]
        )
    if changed("num threads"):
        torch.set_num_threads(before["num threads"])
    if changed("anomaly mode", "anomaly check_nan"):
        torch.set_anomaly_enabled(before["anomaly mode"], before["anomaly check_nan"])
    if changed("float32 matmul precision"):
        torch.set_float32_matmul_precision(before["float32 matmul precision"])
    if changed("subnormals flushed"):
        torch.set_flush_denormal(before["subnormals flushed"])


class StateAudit:
    """Snapshot PyTorch's invisible state on entry; list every difference at exit.

    Example::

        with StateAudit(model, raise_on_leak=True) as audit:
            evaluate(model)  # raises StateLeakError naming e.g. "grad mode: True -> False"
        audit.differences  # [] when the block was clean

    Also a decorator: ``@StateAudit(raise_on_leak=True)``. ``check_rng=False`` skips the global
    RNG states; ``warn=False`` silences the warning sent when leaks are found without raising.
    Buffers of the modules are compared bit for bit (a copy of each is kept while active);
    ``check_params=True`` also compares every parameter and its ``.grad`` (a copy of the model).
    """

    def __init__(
        self,
        *modules: nn.Module,
        raise_on_leak: bool = False,
        check_rng: bool = True,
        warn: bool = True,
        check_params: bool = False,
    ) -> None:
        for m in modules:
            if not isinstance(m, nn.Module):
                raise TypeError(
                    f"StateAudit takes nn.Module arguments, got {type(m).__name__}; "
                    "pass modules positionally and options by keyword"
                )
        self.modules = modules
        self.raise_on_leak = raise_on_leak
        self.check_rng = check_rng
        self.warn = warn
        self.check_params = check_params
        self.differences: list[str] = []
        self._globals: dict[str, Any] | None = None
        self._before: dict[str, Any] | None = None

    def __enter__(self) -> StateAudit:
        if self._globals is not None:
            raise RuntimeError("this StateAudit is already active; create one per block")
        self.differences = []
        self._globals = {label: read() for label, read in _GLOBALS.items()}
        self._rng = capture_rng(all_cuda_devices(initialized_only=True)) if self.check_rng else {}
        self._mods, self._params = _module_flags(self.modules)
        self._values = _Values(self.modules, self.check_params)
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> None:
        if self._globals is None:
            raise RuntimeError("StateAudit.__exit__ called without __enter__")
        self.differences = self._compare(self._globals)
        self._before, self._globals = self._globals, None
        if not self.differences or exc_type is not None:
            return  # never mask the block's own exception; `differences` still holds the leaks
        if self.raise_on_leak:
            raise StateLeakError(self.differences)
        if self.warn:
            warnings.warn(str(StateLeakError(self.differences)), stacklevel=2)

    def _compare(self, globals_before: dict[str, Any]) -> list[str]:
        diffs = []
        for label, before in globals_before.items():
            after = _GLOBALS[label]()
            if after != before:
                diffs.append(f"{label}: {before} -> {after}")
        if self.check_rng:
            now = capture_rng(all_cuda_devices(initialized_only=True))
            diffs += [f"{label} changed" for label in rng_differences(self._rng, now)]
        for label, m, before in self._mods:
            if m.training != before:
                diffs.append(f"module '{label}' training: {before} -> {m.training}")
        for label, p, before in self._params:
            if p.requires_grad != before:
                diffs.append(f"parameter '{label}' requires_grad: {before} -> {p.requires_grad}")
        return diffs + self._values.differences()

    def restore(self) -> None:
        """Put back what the last audited block changed (e.g. so one leak can't cascade).

        Covers everything audited except inference mode and the compiler stance, which have
        no public setter; call it after the block has exited.
        """
        if self._before is None:
            raise RuntimeError("StateAudit.restore() needs a finished block: call it after `with`")
        _restore_globals(self._before)
        if self._rng:
            restore_rng(self._rng)
        for _, m, training in self._mods:
            m.training = training
        for _, p, requires_grad in self._params:
            p.requires_grad_(requires_grad)
        self._values.restore()

    def __call__(self, fn: F) -> F:
        """Use as a decorator: every call of ``fn`` runs under a fresh audit like this one."""

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            audit = StateAudit(
                *self.modules,
                raise_on_leak=self.raise_on_leak,
                check_rng=self.check_rng,
                warn=self.warn,
                check_params=self.check_params,
            )
            try:
                with audit:
                    return fn(*args, **kwargs)
            finally:
                self.differences = audit.differences

        return wrapper  # type: ignore[return-value]


def assert_isolated(
    fn: Callable[[], Any] | None = None, *modules: nn.Module, check_rng: bool = True
) -> Any:
    """Run ``fn()`` and raise StateLeakError if it leaked state; with ``fn=None``, a context.

    Example::

        assert_isolated(lambda: evaluate(model, batches), model)
        with assert_isolated(None, model):
            evaluate(model, batches)
    """
    if isinstance(fn, nn.Module):
        raise TypeError(
            "assert_isolated(fn, *modules): the first argument is the function to run, got an "
            "nn.Module; use assert_isolated(lambda: ..., model) or assert_isolated(None, model)"
        )
    audit = StateAudit(*modules, raise_on_leak=True, check_rng=check_rng)
    if fn is None:
        return audit
    if not callable(fn):
        raise TypeError(f"assert_isolated() needs a callable or None, got {type(fn).__name__}")
    with audit:
        return fn()
