"""Companions of StepGuard: what to do when steps fail.

All of it runs off the hot path, after a skip or at a log step, so it may sync (each sync has a
``# sync:`` comment): find the source, save the failing case, roll back, and inject faults to
watch it all work. Imports only torch and the standard library.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from isotrain._shared import all_cuda_devices, capture_rng, restore_rng

__all__ = [
    "FaultInjector",
    "Provenance",
    "Rollback",
    "RollbackAction",
    "find_nonfinite_source",
    "load_failure_case",
    "nonfinite_grads",
    "save_failure_case",
]


def _named_params(model: nn.Module | Iterable[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    if isinstance(model, nn.Module):
        return list(model.named_parameters())
    return [(f"param{i}", p) for i, p in enumerate(model)]


def _float_leaves(obj: Any) -> list[torch.Tensor]:
    """Floating-point tensors inside nested tuples/lists/dicts (module outputs, batches)."""
    if torch.is_tensor(obj):
        return [obj] if obj.is_floating_point() or obj.is_complex() else []
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _float_leaves(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _float_leaves(o)]
    return []


def _nonfinite(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    flags = [(~t.detach().isfinite()).any() for t in tensors]
    return torch.stack([f.to(flags[0].device) for f in flags]).any() if flags else None


def _current_rng() -> dict[str, Any]:
    """The RNG states a failure case stores: loadable with weights_only=True (no numpy)."""
    return capture_rng(all_cuda_devices(initialized_only=True), numpy=False)


# -- provenance -------------------------------------------------------------------------------
def nonfinite_grads(model: nn.Module | Iterable[torch.Tensor]) -> list[str]:
    """Names of parameters whose ``.grad`` holds a NaN or Inf; call it before grads are zeroed.

    Example::

        loss.backward()
        bad = nonfinite_grads(model)  # e.g. ["blocks.3.attn.qkv.weight"]
    """
    named = [(n, p.grad) for n, p in _named_params(model) if p.grad is not None]
    flags = [_nonfinite([g]) for _, g in named]
    if not flags:
        return []
    first = flags[0].device  # type: ignore[union-attr]
    bad = torch.stack([f.to(first) for f in flags]).tolist()  # type: ignore[union-attr]  # sync: debug
    return [n for (n, _), b in zip(named, bad) if b]


@dataclass
class Provenance:
    """Where non-finite values first appeared in a replayed forward pass.

    Example: ``find_nonfinite_source(model, (x, y)).module  # e.g. "blocks.3.attn"``
    """

    module: str | None  # qualified name of the first module (in completion order) with a
    #                     non-finite output; "" is the root; None: the forward pass was finite
    module_type: str | None = None
    inputs_nonfinite: bool = False  # the batch itself already held NaN/Inf
    nonfinite_modules: list[str] = field(default_factory=list)  # all, in completion order
    nonfinite_grads: list[str] = field(default_factory=list)  # filled in by the caller if known

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _run(model: nn.Module, batch: Any) -> Any:
    if callable(batch) and not torch.is_tensor(batch):
        return batch(model)
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def find_nonfinite_source(
    model: nn.Module, batch: Any, *, rng_state: dict[str, Any] | None = None
) -> Provenance:
    """Replay a batch with forward hooks on every module; report the first non-finite output.

    ``batch`` is a tensor, a tuple (positional args), a dict (keyword args) or ``fn(model)``.
    Runs under ``no_grad``, with the global RNG restored afterwards; pass ``rng_state`` (from
    :func:`save_failure_case`) to replay the failing step's dropout masks. Hooks are removed
    in ``finally``.

    Example::

        prov = find_nonfinite_source(model, (x, y))
        log.error("first non-finite output in %s", prov.module)
    """
    names = {m: n for n, m in model.named_modules()}
    records: list[tuple[str, str, torch.Tensor]] = []

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        flag = _nonfinite(_float_leaves(output))
        if flag is not None:
            records.append((names.get(module, "?"), type(module).__name__, flag))

    handles = [m.register_forward_hook(hook) for m in names]
    try:
        with (
            torch.random.fork_rng(devices=all_cuda_devices(initialized_only=True)),
            torch.no_grad(),
        ):
            if rng_state is not None:
                restore_rng(rng_state)
            flag_in = None if callable(batch) else _nonfinite(_float_leaves(batch))
            _run(model, batch)
    finally:
        for h in handles:
            h.remove()
    bad = [(n, t) for n, t, f in records if bool(f)]  # sync: debug path, after a failure
    return Provenance(
        module=bad[0][0] if bad else None,
        module_type=bad[0][1] if bad else None,
        inputs_nonfinite=bool(flag_in) if flag_in is not None else False,  # sync: as above
        nonfinite_modules=[n for n, _ in bad],
    )


def save_failure_case(
    directory: str | Path,
    inputs: Any,
    *,
    step: int | None = None,
    rng_state: dict[str, Any] | None = None,
    provenance: Provenance | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Save the offending batch and RNG state so the failure can be replayed; returns the file.

    Capture ``rng_state`` (``{"torch": torch.get_rng_state(), ...}``) *before* the failing
    forward pass to replay dropout exactly; by default the current state is stored.

    Example::

        path = save_failure_case("failures", (x, y), step=step, rng_state=rng_before)
        case = load_failure_case(path)
        find_nonfinite_source(model, case["inputs"], rng_state=case["rng"])
    """

    def to_cpu(obj: Any) -> Any:
        if torch.is_tensor(obj):
            return obj.detach().cpu()  # sync: debug path, after a failure
        if isinstance(obj, (list, tuple)):
            return type(obj)(to_cpu(o) for o in obj)
        if isinstance(obj, dict):
            return {k: to_cpu(v) for k, v in obj.items()}
        return obj

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"failure_step{step if step is not None else 'unknown'}.pt"
    payload = {
        "version": 1,
        "step": step,
        "inputs": to_cpu(inputs),
        "rng": to_cpu(rng_state if rng_state is not None else _current_rng()),
        "provenance": provenance.as_dict() if provenance is not None else None,
        "extra": to_cpu(extra or {}),
    }
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    tmp.replace(path)  # atomic: a half-written case never looks complete
    return path


def load_failure_case(path: str | Path) -> dict[str, Any]:
    """Load a case written by :func:`save_failure_case` (``weights_only=True``).

    Example: ``case = load_failure_case(path); find_nonfinite_source(model, case["inputs"])``
    """
    return torch.load(path, weights_only=True)


# -- recovery ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class RollbackAction:
    """What :meth:`Rollback.check` did, and what the caller should do next.

    Example: ``if (action := rollback.check(step, guard)): offset += action.skip_batches``
    """

    step: int  # the (attempted) step at which the rollback happened
    restored_step: int  # the step at which the restored last-good copy was taken
    rollbacks: int  # rollbacks so far, this one included
    skip_batches: int  # extra batches to skip beyond those already consumed
    cooldown_until: int  # multiply the LR by `Rollback.lr_factor(step)` until this step


def _clone_tree(obj: Any, device: torch.device | str | None) -> Any:
    if torch.is_tensor(obj):
        return obj.detach().to(device, copy=True) if device else obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone_tree(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone_tree(v, device) for v in obj)
    return obj


class Rollback:
    """Keep a last-good copy; after ``patience`` consecutive skips restore it and cool the LR.

    ``check`` reads two device counters (one sync): call it every step for exact patience, or
    every few steps to keep syncs rare. A copy is taken every ``every`` applied steps while the
    last step applied. ``device="cpu"`` keeps copies in host memory; ``None`` keeps them where
    the tensors live (faster, costs accelerator memory).

    Example::

        rollback = Rollback(model, optimizer, every=100, patience=8, max_rollbacks=3)
        action = rollback.check(step, guard)  # after guard.step(...)
        lr = schedule(step) * rollback.lr_factor(step)
        if action is not None: data_offset += action.skip_batches
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        every: int = 100,
        patience: int = 8,
        max_rollbacks: int = 3,
        device: torch.device | str | None = "cpu",
        cooldown_factor: float = 0.1,
        cooldown_steps: int = 100,
        skip_batches: int = 0,
    ) -> None:
        if every < 1 or patience < 1 or max_rollbacks < 0 or cooldown_steps < 0:
            raise ValueError(
                "Rollback needs every >= 1, patience >= 1, max_rollbacks >= 0, cooldown_steps "
                f">= 0; got {every}, {patience}, {max_rollbacks}, {cooldown_steps}"
            )
        if not 0.0 < cooldown_factor <= 1.0:
            raise ValueError(f"cooldown_factor must be in (0, 1], got {cooldown_factor}")
        self.model, self.optimizer, self.device = model, optimizer, device
        self.every, self.patience, self.max_rollbacks = every, patience, max_rollbacks
        self.cooldown_factor, self.cooldown_steps = cooldown_factor, cooldown_steps
        self.skip_batches, self.rollbacks = skip_batches, 0
        self.last_rollback_step: int | None = None
        self.snapshot(step=0, applied=0)

    def snapshot(self, *, step: int, applied: int) -> None:
        """Take the last-good copy of model and optimizer state now."""
        self._model_state = _clone_tree(self.model.state_dict(), self.device)
        self._optim_state = _clone_tree(self.optimizer.state_dict(), self.device)
        self.snapshot_step, self._applied_at_snapshot = step, applied

    def check(self, step: int, guard: Any) -> RollbackAction | None:
        """Snapshot or roll back according to the guard's counters; returns the action taken."""
        s = guard.summary()  # sync: two counters, see the class docstring
        if s["consecutive_skips"] >= self.patience:
            return self._roll_back(step, guard, s)
        due = s["applied"] - self._applied_at_snapshot >= self.every
        if s["consecutive_skips"] == 0 and due:
            self.snapshot(step=step, applied=s["applied"])
        return None

    def _roll_back(self, step: int, guard: Any, s: dict[str, Any]) -> RollbackAction:
        if self.rollbacks >= self.max_rollbacks:
            raise RuntimeError(
                f"Rollback: {s['consecutive_skips']} consecutive skipped steps at step {step} "
                f"(last reason {s['last_reason']}) after {self.rollbacks} rollbacks "
                f"(max_rollbacks={self.max_rollbacks}): the run is not recovering. Lower the LR, "
                "inspect the saved failure case, or raise max_rollbacks."
            )
        self.model.load_state_dict(self._model_state)
        self.optimizer.load_state_dict(_clone_tree(self._optim_state, None))
        guard.note_rollback()
        self.rollbacks += 1
        self.last_rollback_step = step
        return RollbackAction(
            step=step,
            restored_step=self.snapshot_step,
            rollbacks=self.rollbacks,
            skip_batches=self.skip_batches,
            cooldown_until=step + self.cooldown_steps,
        )

    def lr_factor(self, step: int) -> float:
        """LR multiplier: ramps linearly from ``cooldown_factor`` back to 1 after a rollback."""
        start = self.last_rollback_step
        if (
            start is None
            or self.cooldown_steps == 0
            or not start <= step < start + self.cooldown_steps
        ):
            return 1.0
        frac = (step - start) / self.cooldown_steps
        return self.cooldown_factor + (1.0 - self.cooldown_factor) * frac

    def state_dict(self) -> dict[str, Any]:
        """Rollback count and cool-down position (the in-memory copy is not persisted)."""
        return {"rollbacks": self.rollbacks, "last_rollback_step": self.last_rollback_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rollbacks, self.last_rollback_step = state["rollbacks"], state["last_rollback_step"]


# -- fault injection --------------------------------------------------------------------------
class FaultInjector:
    """Corrupt the loss or one gradient with NaN/Inf at chosen steps, to watch the guard work.

    Deterministic from ``(seed, step)`` with a private ``random.Random`` (no global RNG) and
    decided on the host from the step number, so it adds no sync.

    Example::

        inject = FaultInjector(at_steps=(10, 11), kind="nan", target="loss")
        loss = inject.corrupt_loss(loss_fn(model(x), y), step)
        loss.backward(); inject.corrupt_grads(model, step)  # a no-op for target="loss"
    """

    def __init__(
        self,
        *,
        at_steps: Iterable[int] = (),
        probability: float = 0.0,
        kind: str = "nan",
        target: str = "loss",
        seed: int = 0,
    ) -> None:
        if kind not in ("nan", "inf") or target not in ("loss", "grad"):
            raise ValueError(
                f'FaultInjector needs kind "nan" or "inf" and target "loss" or "grad"; got '
                f"kind={kind!r}, target={target!r}"
            )
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"probability must be in [0, 1], got {probability}")
        self.at_steps, self.probability = frozenset(int(s) for s in at_steps), probability
        self.kind, self.target, self.seed = kind, target, seed
        self.value = float("nan") if kind == "nan" else float("inf")

    def _rng(self, step: int) -> random.Random:
        return random.Random(f"isotrain.FaultInjector:{self.seed}:{step}")  # str seeds: sha512

    def fires(self, step: int) -> bool:
        """Whether a fault is injected at ``step`` (pure function of seed and step)."""
        if step in self.at_steps:
            return True
        return self.probability > 0.0 and self._rng(step).random() < self.probability

    def corrupt_loss(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """``loss * nan`` (or ``* inf``) at a firing step, so the gradients are non-finite too."""
        if self.target != "loss" or not self.fires(step):
            return loss
        return loss * self.value

    def corrupt_grads(self, model: nn.Module | Iterable[torch.Tensor], step: int) -> str | None:
        """At a firing step, set one element of one parameter's gradient; returns its name."""
        if self.target != "grad" or not self.fires(step):
            return None
        named = [(n, p) for n, p in _named_params(model) if p.grad is not None]
        if not named:
            return None
        rng = self._rng(step)
        rng.random()  # the first draw decided `fires`; pick the parameter with the next ones
        name, p = named[rng.randrange(len(named))]
        grad: torch.Tensor = p.grad  # type: ignore[assignment]
        flat, index = rng.randrange(grad.numel()), []
        for size in reversed(grad.shape):  # unravel the flat index (works for any strides)
            flat, i = divmod(flat, size)
            index.append(i)
        grad[tuple(reversed(index))] = self.value
        return name
