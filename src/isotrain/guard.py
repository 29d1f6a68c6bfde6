"""Non-finite and spike guard: decide on the device, skip by selection, count, never sync.

``safe_backward`` is the seed's simple API (it syncs: it returns a Python bool). ``StepGuard``
is the guarded step for real loops: finiteness and spikes are decided on the device and the
update is applied or skipped by *selection*, with no host-device synchronization. The spike
window, provenance, rollback and fault injection live in :mod:`isotrain.guard_recovery`.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

from isotrain.guard_spikes import SpikeDetector

__all__ = [
    "SkipReason",
    "StepGuard",
    "StepOutcome",
    "safe_backward",
]

log = logging.getLogger(__name__)


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class SkipReason(enum.IntEnum):
    """Why a guarded step was skipped (``OK``: it was applied).

    Example: ``SkipReason(int(outcome.reason)).name  # "NONFINITE_LOSS"``
    """

    OK = 0
    NONFINITE_LOSS = 1
    NONFINITE_GRAD = 2
    LOSS_SPIKE = 3
    GRAD_SPIKE = 4
    SCALER_OVERFLOW = 5


def safe_backward(
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None = None,
    *,
    max_norm: float = 1.0,
) -> bool:
    """Backward, clip, step and zero grads, unless the loss or the gradient norm is non-finite.

    Returns whether the step was applied. It syncs twice per call (it branches on the host); in
    training loops use :class:`StepGuard`, which decides on the device.

    Example::

        applied = safe_backward(loss_fn(model(x), y), optimizer, max_norm=1.0)
    """
    scaling = scaler is not None and scaler.is_enabled()
    if not bool(torch.isfinite(loss.detach()).all()):  # sync: the seed's API branches on the host
        log.warning("non-finite loss: skipping the step")
        optimizer.zero_grad(set_to_none=True)
        return False
    (scaler.scale(loss) if scaling else loss).backward()  # type: ignore[union-attr]
    if scaling:
        scaler.unscale_(optimizer)  # type: ignore[union-attr]
    norm = nn.utils.clip_grad_norm_(_optimizer_params(optimizer), max_norm)
    if not bool(torch.isfinite(norm)):  # sync: as above
        log.warning("non-finite gradient norm: skipping the step")
        optimizer.zero_grad(set_to_none=True)
        if scaling:
            scaler.update()  # type: ignore[union-attr]  # lowers the scale on overflow
        return False
    if scaling:
        scaler.step(optimizer)  # type: ignore[union-attr]
        scaler.update()  # type: ignore[union-attr]
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return True


@dataclass(frozen=True)
class StepOutcome:
    """One guarded step as device tensors; read them only at log steps (reading syncs).

    Example: ``outcome = guard.step(loss.detach()); if log_step: print(outcome.to_dict())``
    """

    applied: torch.Tensor  # () bool
    reason: torch.Tensor  # () int64, a SkipReason value
    grad_norm: torch.Tensor  # () float32, before clipping (rank-averaged when distributed)
    loss: torch.Tensor  # () float32 (rank-averaged when distributed)
    loss_scale: torch.Tensor  # () float32, the GradScaler scale this step used (1.0 without)

    def to_dict(self) -> dict[str, Any]:
        """Host values for a log line."""
        fields = [self.applied, self.reason, self.grad_norm, self.loss, self.loss_scale]
        a, r, g, loss, s = torch.stack([f.double() for f in fields]).tolist()  # sync: log step
        return {"applied": bool(a), "reason": SkipReason(int(r)).name, "grad_norm": g,
                "loss": loss, "loss_scale": s}  # fmt: skip


# NOTE [what the guard counts]
# The trainer's step counter and LR schedule count *attempted* steps; the optimizer's internal
# `step` (Adam's bias correction) counts only *applied* ones. Attempted steps keep the schedule
# and the data index a pure function of the step number (exact resume, and no host read of the
# skip flag, which would sync); applied-only optimizer steps mean a skip never inflates the
# effective LR (the OLMo-core#309 bug: a skip that forgot `step` gave 2.2x LR).
#
# NOTE [skip modes]
# "found_inf" (fused Adam/AdamW/SGD): the GradScaler protocol; the fused kernel skips itself.
# "select": copy params and optimizer state tensors before the step (one _foreach_copy_ into
#   reused buffers), run the step, then `torch.where(ok, new, old, out=new)`: any optimizer,
#   NaN-safe (selection, not multiply-by-0), sync-free.
# "host": branch on the host and skip `optimizer.step()`. Free when the decision lives in host
#   memory (CPU training: reading a CPU tensor waits for no device), a sync on accelerators.
# "auto" = host on CPU, else found_inf for fused optimizers, else select. On CPU, `torch.where`
# runs at ~3 ns/element (not memory-bound as on GPUs), so select would cost ~2x the update.
#
# NOTE [where select / found_inf may still sync]
# Selection needs the decision on the device of each selected tensor. Three cases need it on
# the host, and the guard then syncs once (with a one-time warning where it is avoidable):
# 1. the optimizer creates state lazily this step (its first step, or a param's first grad):
#    on a skip that new state is dropped, so it is exactly as if the step never happened;
# 2. the optimizer keeps non-tensor state that the step changed (custom optimizers);
# 3. state on another device than the decision: torch's non-fused, non-capturable Adam keeps
#    `step` on the CPU when params are on CUDA. Use fused=True or capturable=True there.
# Case 3 never arises on CPU; cases 1-2 end at the first applied step.


class StepGuard:
    """Sync-free guarded optimizer step: unscale, clip, decide on device, apply or skip, count.

    Example::

        guard = StepGuard(optimizer, model, max_norm=1.0, scaler=None)
        for x, y in batches:
            loss = loss_fn(model(x), y)
            loss.backward()  # or scaler.scale(loss).backward(), over several micro-batches
            outcome = guard.step(loss.detach())  # zeroes the grads
            if step % 100 == 0:
                log.info("%s", guard.summary())  # the only sync
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module | Iterable[torch.Tensor] | None = None,
        *,
        max_norm: float | None = 1.0,
        scaler: torch.amp.GradScaler | None = None,
        spike_k: float | None = 6.0,
        spike_window: int = 128,
        spike_min_samples: int = 16,
        process_group: Any = None,
        skip_mode: str = "auto",
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"StepGuard needs a torch.optim.Optimizer, got {type(optimizer)}")
        if max_norm is not None and not max_norm > 0:
            raise ValueError(f"max_norm must be > 0 (or None for no clipping), got {max_norm}")
        self.optimizer, self.max_norm, self.process_group = optimizer, max_norm, process_group
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        if isinstance(model, nn.Module):
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        else:
            params = list(model) if model is not None else _optimizer_params(optimizer)
            named = [(f"param{i}", p) for i, p in enumerate(params)]
        if not named:
            raise ValueError("StepGuard found no parameters: pass the model or a non-empty list")
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        dev = self.device = self.params[0].device
        self.skip_mode = self._resolve_mode(skip_mode, optimizer, dev)
        self.spikes = None
        if spike_k is not None:
            self.spikes = SpikeDetector(
                n_series=2, k=spike_k, window=spike_window, min_samples=spike_min_samples,
                device=dev,
            )  # fmt: skip
        self.steps = 0  # attempted steps (a host int: it advances every call)
        self._applied = torch.zeros((), dtype=torch.int64, device=dev)
        self._by_reason = torch.zeros(len(SkipReason), dtype=torch.int64, device=dev)
        self._consecutive = torch.zeros((), dtype=torch.int64, device=dev)
        self._last = torch.zeros(4, dtype=torch.float32, device=dev)  # reason, norm, loss, scale
        self._codes = torch.arange(len(SkipReason), device=dev)
        self._one = torch.ones((), dtype=torch.float32, device=dev)
        self._snap_src: list[torch.Tensor] = []  # the tensors "select" copies, and their copies
        self._snap: list[torch.Tensor] = []
        self._grad_finite: torch.Tensor | None = None  # per-tensor, in `_grad_names` order
        self._grad_names: list[str] = []
        self._warned: set[str] = set()
        # Tests set this to guard_recovery.forbid_host_sync; it wraps the sync-free phases.
        self.sync_check: Callable[[], contextlib.AbstractContextManager[Any]] = (
            contextlib.nullcontext
        )

    # -- the step -------------------------------------------------------------------------
    def step(self, loss: torch.Tensor | float) -> StepOutcome:
        """Unscale, clip, decide, apply or skip the update, update the scaler, count, zero grads."""
        with torch.no_grad():
            with self.sync_check():
                scale, found_inf = self._unscale()
                grads, norm = self._grad_norm()
                ok, reason, loss32, norm_g = self._decide(loss, norm, found_inf)
                if self.max_norm is not None and grads:
                    nn.utils.clip_grads_with_norm_(self.params, self.max_norm, norm)
            if self.skip_mode == "host":
                if bool(ok):  # sync: none on CPU, see NOTE [skip modes]
                    self.optimizer.step()
            else:
                with self.sync_check():
                    fresh, host_state = self._snapshot()
                fused = self.skip_mode == "found_inf"
                with self.sync_check() if fused else contextlib.nullcontext():
                    self._optimizer_step(ok)
                self._undo_host_state(ok, fresh, host_state)
            with self.sync_check():
                self._restore(ok)
                if self.scaler is not None:
                    self.scaler.update()
                self._count(ok, reason, torch.stack([norm_g, loss32, scale]))
                self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return StepOutcome(ok, reason, norm_g, loss32, scale)

    @staticmethod
    def _resolve_mode(mode: str, optimizer: torch.optim.Optimizer, device: torch.device) -> str:
        fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
            g.get("fused") for g in optimizer.param_groups
        )
        if mode == "auto":
            return "host" if device.type == "cpu" else "found_inf" if fused else "select"
        if mode not in ("host", "select", "found_inf") or (mode == "found_inf" and not fused):
            raise ValueError(
                f"skip_mode={mode!r} is not available for {type(optimizer).__name__} "
                f"(fused={fused}): use 'auto', 'select', 'host', or 'found_inf' with fused=True"
            )
        return mode

    def _unscale(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.scaler is None:
            return self._one, None
        sc = self.scaler
        if sc._scale is None:
            raise RuntimeError("StepGuard: call scaler.scale(loss).backward() before guard.step")
        scale = sc._scale.detach().float().clone()  # before update() changes it in place
        state = sc._per_optimizer_states[id(self.optimizer)]
        if state["stage"].name != "UNSCALED":  # the user may have unscaled already
            sc.unscale_(self.optimizer)
        infs = [
            t.to(self.device, non_blocking=True) for t in state["found_inf_per_device"].values()
        ]
        return scale, torch.stack(infs).sum() if infs else torch.zeros((), device=self.device)

    def _grad_norm(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        # Same grouping and reduction order as nn.utils.get_total_norm (so clipping is bitwise the
        # same as clip_grad_norm_), keeping the per-tensor norms for `nonfinite_grad_names`.
        named = [(n, p.grad) for n, p in zip(self.names, self.params) if p.grad is not None]
        grads = [g for _, g in named]
        if not grads:
            self._grad_finite, self._grad_names = None, []
            return grads, torch.zeros((), device=self.device)
        norms, order = [], []
        groups = _group_tensors_by_device_and_dtype([grads], with_indices=True)  # type: ignore[list-item]
        for (device, _), ([dev_grads], idx) in groups.items():
            if _has_foreach_support(dev_grads, device):
                norms.extend(torch._foreach_norm(dev_grads, 2.0))
            else:
                norms.extend(torch.linalg.vector_norm(g, 2.0) for g in dev_grads)
            order.extend(idx)
        per = torch.stack([n.to(grads[0].device) for n in norms])
        if hasattr(per, "full_tensor"):  # FSDP2 DTensor grads: reduce the per-shard norms
            per = per.full_tensor()
        self._grad_finite, self._grad_names = per.isfinite(), [named[i][0] for i in order]
        return grads, torch.linalg.vector_norm(per, 2.0)

    def _decide(
        self, loss: torch.Tensor | float, norm: torch.Tensor, found_inf: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        loss = torch.as_tensor(loss, device=self.device).detach()
        if loss.numel() != 1:
            raise ValueError(
                f"guard.step(loss) needs the scalar (mean) loss, got shape {tuple(loss.shape)}"
            )
        overflow = found_inf if found_inf is not None else torch.zeros((), device=self.device)
        vec = torch.stack(
            [loss.float().reshape(()), norm.float().to(self.device), overflow.float()]
        )
        vec = self._all_reduce_mean(vec)  # agree across ranks: NaN anywhere is NaN everywhere
        loss32, norm_g, overflow = vec[0], vec[1], vec[2] > 0
        if found_inf is not None:  # make every rank's GradScaler.update() see the agreed flag
            sc: Any = self.scaler
            for t in sc._per_optimizer_states[id(self.optimizer)]["found_inf_per_device"].values():
                t.copy_(overflow)
        spike = torch.zeros(2, dtype=torch.bool, device=self.device)
        if self.spikes is not None:
            spike = self.spikes.is_spike(vec[:2])
        flags = [~loss32.isfinite(), overflow, ~norm_g.isfinite(), spike[0], spike[1]]
        codes = [SkipReason.NONFINITE_LOSS, SkipReason.SCALER_OVERFLOW, SkipReason.NONFINITE_GRAD,
                 SkipReason.LOSS_SPIKE, SkipReason.GRAD_SPIKE]  # fmt: skip
        reason = torch.zeros((), dtype=torch.int64, device=self.device)
        for flag, code in reversed(list(zip(flags, codes))):  # first listed wins
            reason = torch.where(flag, int(code), reason)
        ok = reason == SkipReason.OK
        if self.spikes is not None:
            self.spikes.update(vec[:2], ok)
        return ok, reason, loss32, norm_g

    def _all_reduce_mean(self, vec: torch.Tensor) -> torch.Tensor:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return vec
        world = dist.get_world_size(self.process_group)
        if world == 1:
            return vec
        dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=self.process_group)
        return vec / world

    # -- apply or skip by selection -------------------------------------------------------
    def _snapshot(self) -> tuple[list[torch.Tensor], list[tuple[dict, Any, Any]]]:
        """Copy params and optimizer state tensors that the step may change (non-fused path)."""
        fresh, host_state, tensors = [], [], []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue  # torch.optim leaves params without grads untouched
                tensors.append(p)
                state = self.optimizer.state.get(p)
                if not state:
                    fresh.append(p)  # state created by this step: dropped on a skip
                    continue
                for key, value in state.items():
                    if torch.is_tensor(value):
                        tensors.append(value)
                    else:
                        host_state.append((state, key, value))
        if self.skip_mode == "found_inf":
            return fresh, host_state  # the fused kernels honour found_inf themselves
        same = len(tensors) == len(self._snap_src) and all(
            a is b for a, b in zip(tensors, self._snap_src)
        )
        if not same:  # (re)allocate once; reused every step while the state tensors stay the same
            self._snap_src, self._snap = tensors, [torch.empty_like(t) for t in tensors]
        if tensors:
            torch._foreach_copy_(self._snap, tensors)
        return fresh, host_state

    def _optimizer_step(self, ok: torch.Tensor) -> None:
        if self.skip_mode == "select":
            self.optimizer.step()
            return
        opt: Any = self.optimizer
        opt.grad_scale, opt.found_inf = None, (~ok).to(torch.float32)  # the GradScaler protocol
        try:
            opt.step()
        finally:
            del opt.grad_scale, opt.found_inf

    def _restore(self, ok: torch.Tensor) -> None:
        if self.skip_mode != "select":
            return
        on_device: dict[torch.device, torch.Tensor] = {self.device: ok}
        for cur, old in zip(self._snap_src, self._snap):
            if cur.device not in on_device:
                self._warn_once(
                    "device",
                    f"optimizer state on {cur.device} while params are on {self.device}: the skip "
                    "decision is copied to the host every step (a sync); use fused=True or "
                    "capturable=True in the optimizer to avoid it",
                )
                on_device[cur.device] = ok.to(cur.device)  # sync: see NOTE [where select ...]
            torch.where(on_device[cur.device], cur, old, out=cur)  # selection, NaN-safe

    def _undo_host_state(self, ok: torch.Tensor, fresh: list, host_state: list) -> None:
        state = self.optimizer.state
        new = [p for p in fresh if any(v is not None for v in state.get(p, {}).values())]
        changed = [(s, k, v) for s, k, v in host_state if s.get(k) is not v and s.get(k) != v]
        if not new and not changed:
            return
        if changed:
            self._warn_once("host", "optimizer keeps non-tensor state: each step syncs to undo it")
        if not bool(ok):  # sync: see NOTE [where select / found_inf may still sync]
            for p in new:
                del state[p]
            for s, k, v in changed:
                s[k] = v

    def _count(self, ok: torch.Tensor, reason: torch.Tensor, values: torch.Tensor) -> None:
        self._applied.add_(ok.to(torch.int64))
        self._by_reason.add_((self._codes == reason).to(torch.int64))
        self._consecutive.copy_(torch.where(ok, 0, self._consecutive + 1))
        self._last.copy_(torch.cat([reason.float().view(1), values.float()]))

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"StepGuard: {message}", stacklevel=3)

    # -- reading and state ----------------------------------------------------------------
    @property
    def consecutive_skips(self) -> torch.Tensor:
        """Device int64 count of skipped steps since the last applied one."""
        return self._consecutive

    def note_rollback(self) -> None:
        """Reset the consecutive-skip count after the caller restored a last-good state."""
        self._consecutive.zero_()

    def summary(self) -> dict[str, Any]:
        """Counters for a log line: steps, applied, skipped (total and by reason), last values."""
        counts = torch.cat([self._applied.view(1), self._by_reason, self._consecutive.view(1)])
        vals = torch.cat([counts.double(), self._last.double()]).tolist()  # sync: log steps only
        n = len(SkipReason)
        applied, by_reason, consecutive = int(vals[0]), vals[1 : 1 + n], int(vals[1 + n])
        reason, norm, loss, scale = vals[2 + n :]
        return {
            "steps": self.steps, "applied": applied, "skipped": self.steps - applied,
            "skipped_by_reason": {r.name: int(by_reason[r]) for r in SkipReason if r},
            "consecutive_skips": consecutive, "last_reason": SkipReason(int(reason)).name,
            "last_grad_norm": norm, "last_loss": loss, "loss_scale": scale,
        }  # fmt: skip

    def nonfinite_grad_names(self) -> list[str]:
        """Names of the params whose gradient was non-finite at the last step (syncs once)."""
        if self._grad_finite is None:
            return []
        finite = self._grad_finite.tolist()  # sync: called after a skip, at a log step
        return [n for n, f in zip(self._grad_names, finite) if not f]

    def state_dict(self) -> dict[str, Any]:
        """Counters and spike window as plain tensors/ints (loadable with weights_only=True)."""
        return {
            "version": 1, "steps": self.steps, "applied": self._applied.clone(),
            "by_reason": self._by_reason.clone(), "consecutive": self._consecutive.clone(),
            "last": self._last.clone(),
            "spikes": None if self.spikes is None else self.spikes.state_dict(),
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counters and spike window so a resumed run continues the same window."""
        if state.get("version") != 1:
            raise ValueError(
                f"unknown StepGuard state version {state.get('version')!r}; expected 1"
            )
        self.steps = int(state["steps"])
        for name in ("applied", "by_reason", "consecutive", "last"):
            getattr(self, f"_{name}").copy_(state[name])
        if self.spikes is not None and state["spikes"] is not None:
            self.spikes.load_state_dict(state["spikes"])
