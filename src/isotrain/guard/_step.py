"""Non-finite and spike guard: decide on the device, skip by selection, count, never sync.

``StepGuard`` is the guarded step for real loops: finiteness and spikes are decided on the device
and the update is applied or skipped by *selection* (`_select`), with no host-device
synchronization. Skip reasons and the outcome record are in `_outcome`, the spike window in
`_spikes`, wrapped optimizers in `_optim`, buffer protection in `_buffers`; provenance, rollback
and fault injection in `_recovery`; the seed's syncing ``safe_backward`` in `_safe`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from isotrain._torch_private import (
    foreach_norms,
    group_by_device_and_dtype,
    scaler_has_unscaled,
    scaler_optimizer_state,
    scaler_pending,
    scaler_scale,
    set_grad_mode,
    supports_found_inf,
)
from isotrain.guard._buffers import BufferGuard
from isotrain.guard._closure import closure_step, needs_closure
from isotrain.guard._optim import named_trainable, optimizer_chain
from isotrain.guard._outcome import (
    _FLAG_CODES,
    HostOutcome,
    SkipReason,
    StepOutcome,
    _clip_is_one,
    _host_reason,
    _round_f32,
    count_table,
)
from isotrain.guard._record import GuardRecord
from isotrain.guard._select import SelectiveStep
from isotrain.guard._spikes import HostSpikeDetector, SpikeDetector

__all__ = ["SkipReason", "StepGuard", "StepOutcome"]


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` as float32 on ``device``; dispatches nothing when it already is (saves per step)."""
    if t.dtype != torch.float32 or t.device != device:
        return t.to(device=device, dtype=torch.float32)
    return t


_NOT_SCALAR = "guard.step(loss) needs the scalar (mean) loss, got shape {}"

# NOTE [host outcome]
# In host mode the decision reads the loss as a host float (`.item()`), so the outcome keeps
# that float and makes its `loss` tensor only when read (HostOutcome): no copy per step. The
# float is rounded to float32 first, so the tensor, the spike window and the counters hold the
# value the device modes would (a float64 loss beyond float32's range is inf there too). Why
# count torch calls: a step's first call of each torch function runs cold after backward
# (5-20 us each on a CPU), while a repeat of one costs about a microsecond.

# NOTE [what the guard counts]
# The trainer's step counter and LR schedule count *attempted* steps; the optimizer's internal
# `step` (Adam's bias correction) counts only *applied* ones. Attempted steps keep the schedule
# and the data index a pure function of the step number (exact resume, and no host read of the
# skip flag, which would sync); applied-only optimizer steps mean a skip never inflates the
# effective LR (the OLMo-core#309 bug: a skip that forgot `step` gave 2.2x LR).


class StepGuard(GuardRecord):
    """Sync-free guarded optimizer step: unscale, clip, decide on device, apply or skip, count.

    `optimizer` may be wrapped (Lightning Fabric, HF Accelerate, your own forwarding class): the
    guard steps what you pass and skips on the torch optimizer inside (NOTE [wrapped optimizers]).
    A skipped step also leaves the model's buffers (BatchNorm statistics) as they were before
    its forward: by default when `model` has floating-point buffers its forwards write, always
    with `protect_buffers=True`, never with False (NOTE [protected buffers], NOTE [protect by
    default]; `close()` removes the hook this installs). `set_to_none` is how the guard zeroes
    the gradients, as your loop would (NOTE [the user's zero_grad]). A closure optimizer
    (LBFGS) steps with `step_with_closure` (NOTE [closure steps]).

    Example::

        guard = StepGuard(optimizer, model, max_norm=1.0, scaler=None)
        for x, y in batches:
            loss = loss_fn(model(x), y)
            loss.backward()  # or scaler.scale(loss).backward(), over several micro-batches
            outcome = guard.step(loss.detach())  # zeroes the grads
            if step % 100 == 0:
                log.info("%s", guard.summary())  # the only sync
    """

    _zero: dict[str, bool]  # zero_grad's keyword arguments: NOTE [the user's zero_grad]

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
        protect_buffers: bool | None = None,
        set_to_none: bool | None = None,
    ) -> None:
        if not all(callable(getattr(optimizer, a, None)) for a in ("step", "zero_grad")):
            raise TypeError(
                f"StepGuard needs a torch.optim.Optimizer (or a wrapper of one, with step() and "
                f"zero_grad()), got {type(optimizer).__name__}"
            )
        if max_norm is not None and not max_norm > 0:
            raise ValueError(f"max_norm must be > 0 (or None for no clipping), got {max_norm}")
        self.optimizer, self.max_norm, self.process_group = optimizer, max_norm, process_group
        self.set_to_none = set_to_none  # NOTE [the user's zero_grad]
        # NOTE [wrapped optimizers]: step the object given, decide on the torch optimizer inside
        self.chain = optimizer_chain(optimizer)
        self.inner = self.chain[-1]
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.names, self.params = named_trainable(model, self.inner)
        dev = self.device = self.params[0].device
        self._warned: set[str] = set()
        self.needs_closure = needs_closure(self.inner)
        self.skip_mode = self._resolve_mode(skip_mode, dev)
        self.host = self.skip_mode == "host"
        self.buffers = self._buffer_guard(model, protect_buffers)
        self.spikes = self._spike_detector(spike_k, spike_window, spike_min_samples)
        self.steps = 0  # attempted steps (a host int: it advances every call)
        self._world_size: int | None = None
        self._init_counters(dev)
        self._one = torch.ones((), dtype=torch.float32, device=dev)
        self._consts = (  # StepOutcome's applied / reason in host mode (shared, read-only)
            [torch.tensor(r == SkipReason.OK, device=dev) for r in SkipReason],
            [torch.tensor(int(r), device=dev) for r in SkipReason],
        )
        self._select = (
            None if self.host else SelectiveStep(self.chain, self.skip_mode, dev, self._warn_once)
        )
        self._grad_per: torch.Tensor | None = None  # per-tensor norms, in `_grad_order` order
        # (present, order): norm j belongs to names[present[order[j]]]; resolved when read
        self._grad_order: tuple[list[int], list[int]] = ([], [])
        # Tests set this to isotrain.testing.forbid_host_sync; it wraps the sync-free phases.
        self.sync_check: Callable[[], contextlib.AbstractContextManager[Any]] = (
            contextlib.nullcontext
        )

    def _spike_detector(
        self, k: float | None, window: int, min_samples: int
    ) -> SpikeDetector | HostSpikeDetector | None:
        """The loss-spike window for this guard's mode (None when spike_k is None)."""
        if k is None:
            return None
        kw: dict[str, Any] = {"k": k, "window": window, "min_samples": min_samples}
        return HostSpikeDetector(**kw) if self.host else SpikeDetector(**kw, device=self.device)

    def _init_counters(self, dev: torch.device) -> None:
        # Counters [applied, *by_reason, consecutive] and last [reason, norm, loss, scale]:
        # Python numbers in host mode, one device buffer each otherwise.
        self._counts: Any = [0] * (len(SkipReason) + 2)
        self._last: Any = [0.0] * 4
        if not self.host:
            self._counts = torch.zeros(len(SkipReason) + 2, dtype=torch.int64, device=dev)
            self._last = torch.zeros(4, dtype=torch.float32, device=dev)
            self._count_table = count_table().to(dev)

    def _buffer_guard(self, model: Any, protect: bool | None) -> BufferGuard | None:
        if protect is False or (protect is None and not isinstance(model, nn.Module)):
            return None
        if not isinstance(model, nn.Module):
            raise ValueError(
                "protect_buffers=True needs the model (an nn.Module) as StepGuard's second "
                f"argument to find its buffers, got {type(model).__name__}"
            )
        guard = BufferGuard(model, self._warn_once, auto=protect is None)
        if not guard.slots or (protect is None and not guard.has_float):  # nothing to protect
            guard.close()
            return None
        return guard

    # -- the step -------------------------------------------------------------------------
    def step(self, loss: torch.Tensor | float) -> StepOutcome:
        """Unscale, clip, decide, apply or skip the update, update the scaler, count, zero grads."""
        if self.needs_closure:
            raise TypeError(
                f"StepGuard: {type(self.inner).__name__}.step() evaluates a closure (several "
                "times a step), so guard.step(loss) cannot run it: call "
                "guard.step_with_closure(closure), or GuardedOptimizer(...).step(closure)"
            )
        grad_mode = torch.is_grad_enabled()
        set_grad_mode(False)  # torch.no_grad(), without its per-call objects
        try:
            outcome = self._host_step(loss) if self.host else self._device_step(loss)
        finally:
            set_grad_mode(grad_mode)
        self.steps += 1
        return outcome

    def step_with_closure(self, closure: Callable[[], Any]) -> tuple[Any, StepOutcome]:
        """The guarded step of an optimizer that needs a closure (LBFGS): each evaluation
        checked, a skip undone (NOTE [closure steps]). Returns the step's result and outcome."""
        grad_mode = torch.is_grad_enabled()
        set_grad_mode(False)
        try:
            result = closure_step(self, closure)
        finally:
            set_grad_mode(grad_mode)
        self.steps += 1
        return result

    # NOTE [the user's zero_grad]
    # The guard zeroes the gradients after each step (a skipped step's must not reach the next
    # one). How matters: a parameter that gets no gradient in a step keeps a zero tensor after
    # zero_grad(set_to_none=False), and SGD's momentum and weight decay, Adam's moments, keep
    # moving it; after set_to_none=True its grad is None and torch.optim leaves it alone. So the
    # guard zeroes as the loop would: `set_to_none` if given, else the optimizer's own default
    # (`zero_grad()` with no argument: True for torch.optim); GuardedOptimizer.zero_grad(...)
    # sets it from each call the loop or its framework makes.
    @property
    def set_to_none(self) -> bool | None:
        """How the guard zeroes the gradients (None: the optimizer's default)."""
        return self._zero.get("set_to_none")

    @set_to_none.setter
    def set_to_none(self, value: bool | None) -> None:
        self._zero = {} if value is None else {"set_to_none": bool(value)}

    def zero_grad(self) -> None:
        """Zero the gradients as the training loop would: NOTE [the user's zero_grad]."""
        self.optimizer.zero_grad(**self._zero)

    def _count_host(self, reason: int, norm: float, loss: float, scale: float) -> None:
        """Count a step decided on the host (host mode, closure steps)."""
        c = self._counts
        ok = reason == 0
        c[0] += ok
        c[reason + 1] += 1
        c[-1] = 0 if ok else c[-1] + 1
        self._last = [float(reason), norm, loss, scale]

    def _device_step(self, loss: torch.Tensor | float) -> StepOutcome:
        with self.sync_check():
            scale, found_inf = self._unscale()
            grads, norm = self._grad_norm()
            ok, reason, loss32, norm_g = self._decide(loss, norm, found_inf)
            if self.max_norm is not None and grads:
                nn.utils.clip_grads_with_norm_(self.params, self.max_norm, norm)
        assert self._select is not None  # built for every device mode
        self._select.run(ok, self.sync_check)
        with self.sync_check():
            if self.buffers is not None:
                self.buffers.settle(ok, host=False)
            if self.scaler is not None and scaler_pending(self.scaler):
                self.scaler.update()  # unless a wrapper's step already did (Accelerate fp16)
            self._count(reason, [norm_g, loss32, scale])
            self.optimizer.zero_grad(**self._zero)
        return StepOutcome(ok, reason, norm_g, loss32, scale)

    def _host_step(self, loss: torch.Tensor | float) -> StepOutcome:
        # NOTE [skip modes] in guard_select: on CPU every read below waits for no device.
        # Few Python calls and few distinct torch calls in the usual case (one rank, no scaler):
        # in a real loop, forward and backward evict the guard from the caches, and the first
        # call of each torch function in a step costs 5-20 microseconds (NOTE [host outcome]).
        lf = self._host_loss(loss)
        scale, found_inf = (self._one, None) if self.scaler is None else self._unscale()
        grads, norm = self._grad_norm()
        norm_g = _on(norm, self.device)
        loss32 = None
        if (self._world_size or self._world()) > 1:
            overflow = found_inf if found_inf is not None else torch.zeros((), device=self.device)
            loss32 = torch.tensor(lf, dtype=torch.float32, device=self.device)
            vec = self._all_reduce_mean(torch.stack([loss32, norm_g, overflow.float()]))
            loss32, norm_g = vec[0], vec[1]
            lf, nf, of = vec.tolist()  # sync: host mode
            if found_inf is not None:
                self._agree_found_inf(vec[2] > 0)
        else:
            nf = norm_g.item()  # sync: host mode
            of = found_inf.item() if found_inf is not None else 0.0  # sync: host mode
        # The whole decision, and the spike window's update when it is 0 (apply): one call.
        reason = _host_reason(lf, of, nf, self.spikes)  # type: ignore[arg-type]
        ok = reason == 0
        if ok:
            if self.max_norm is not None and grads and not _clip_is_one(self.max_norm, norm, nf):
                nn.utils.clip_grads_with_norm_(self.params, self.max_norm, norm)
            self.optimizer.step()
        if self.buffers is not None:
            self.buffers.settle(ok, host=True)
        if self.scaler is not None and scaler_pending(self.scaler):
            self.scaler.update()
        sf = scale.item() if self.scaler is not None else 1.0  # sync: host mode
        c = self._counts  # _count_host, inlined: each Python call here is one per step
        c[0] += ok
        c[reason + 1] += 1
        c[-1] = 0 if ok else c[-1] + 1
        self._last = [float(reason), nf, lf, sf]
        self.optimizer.zero_grad(**self._zero)  # zero_grad(), inlined
        applied_t, reason_t = self._consts
        if loss32 is None:
            return HostOutcome(applied_t[reason], reason_t[reason], norm_g, lf, scale, self.device)
        return StepOutcome(applied_t[reason], reason_t[reason], norm_g, loss32, scale)

    @staticmethod
    def _host_loss(loss: torch.Tensor | float) -> float:
        """The loss as a host float, rounded as a float32 tensor holds it (one read)."""
        if not isinstance(loss, torch.Tensor):
            return _round_f32(float(loss))
        try:
            value = loss.item()  # sync: host mode
        except RuntimeError:
            raise ValueError(_NOT_SCALAR.format(tuple(loss.shape))) from None
        return value if loss.dtype is torch.float32 else _round_f32(float(value))

    def _resolve_mode(self, mode: str, device: torch.device) -> str:
        inner = self.inner
        if mode not in ("auto", "host", "select", "found_inf"):
            raise ValueError(
                f"unknown skip_mode {mode!r}: use 'auto', 'select', 'host' or 'found_inf'"
            )
        if self.needs_closure:  # NOTE [closure steps]: decided on the host
            if mode not in ("auto", "host") or self.scaler is not None:
                raise ValueError(
                    f"{type(inner).__name__}.step() evaluates a closure and reads its loss on "
                    "the host, so StepGuard decides there too: use skip_mode='auto' or 'host' "
                    "and no GradScaler (torch's GradScaler refuses closures as well)"
                )
            return "host"
        if not isinstance(inner, torch.optim.Optimizer):  # its state is out of our sight
            if mode != "host" and not (mode == "auto" and device.type == "cpu"):
                self._warn_once(
                    "mode",
                    f"{type(inner).__name__} is not a torch.optim.Optimizer and holds none, so "
                    f"skip_mode={mode!r} cannot see its state: using 'host' (skips by not "
                    "calling step(); one host sync per step on an accelerator)",
                )
            return "host"
        fused = supports_found_inf(inner)
        if mode == "auto":
            return "host" if device.type == "cpu" else "found_inf" if fused else "select"
        if mode == "found_inf" and not fused:
            raise ValueError(
                f"skip_mode='found_inf' is not available for {type(inner).__name__} "
                f"(fused={fused}): use 'auto', 'select', 'host', or 'found_inf' with fused=True"
            )
        return mode

    def _unscale(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.scaler is None:
            return self._one, None
        sc = self.scaler
        current = scaler_scale(sc)
        if current is None:
            raise RuntimeError("StepGuard: call scaler.scale(loss).backward() before guard.step")
        scale = current.detach().float().clone()  # before update() changes it in place
        # The user or their framework may have unscaled through any level of a wrapped optimizer.
        key = next((o for o in self.chain if scaler_has_unscaled(sc, o)), self.inner)
        self._scaler_key = key
        state = scaler_optimizer_state(sc, key)
        if state["stage"].name != "UNSCALED":
            sc.unscale_(key)
        infs = [
            t.to(self.device, non_blocking=True) for t in state["found_inf_per_device"].values()
        ]
        return scale, torch.stack(infs).sum() if infs else torch.zeros((), device=self.device)

    def _grad_norm(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        # Same grouping and reduction order as nn.utils.get_total_norm (so clipping is bitwise the
        # same as clip_grad_norm_), keeping the per-tensor norms for `nonfinite_grad_names`.
        index = [i for i, p in enumerate(self.params) if p.grad is not None]
        grads = [g for g in (p.grad for p in self.params) if g is not None]
        if not grads:
            self._grad_per, self._grad_order = None, ([], [])
            return grads, torch.zeros((), device=self.device)
        norms: list[torch.Tensor] = []
        order: list[int] = []
        groups = group_by_device_and_dtype(grads)
        for (device, _), (dev_grads, idx) in groups.items():
            norms.extend(foreach_norms(dev_grads, device))
            order.extend(idx)
        if len(groups) > 1:  # one group (the usual case) is on one device already
            norms = [n.to(grads[0].device) for n in norms]
        per = torch.stack(norms)
        if hasattr(per, "full_tensor"):  # FSDP2 DTensor grads: reduce the per-shard norms
            per = per.full_tensor()
        self._grad_per, self._grad_order = per, (index, order)
        return grads, torch.linalg.vector_norm(per, 2.0)

    def _loss32(self, loss: torch.Tensor | float) -> torch.Tensor:
        """The loss as a fresh () float32 tensor on the guard's device (step runs under no_grad)."""
        if not isinstance(loss, torch.Tensor):
            return torch.tensor(float(loss), dtype=torch.float32, device=self.device)
        if loss.numel() != 1:
            raise ValueError(_NOT_SCALAR.format(tuple(loss.shape)))
        loss = loss.to(device=self.device, dtype=torch.float32, copy=True)  # one op
        return loss if loss.dim() == 0 else loss.reshape(())

    def _decide(
        self, loss: torch.Tensor | float, norm: torch.Tensor, found_inf: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        loss32 = self._loss32(loss)
        overflow = found_inf if found_inf is not None else torch.zeros((), device=self.device)
        vec = torch.stack([loss32, _on(norm, self.device), overflow.float()])
        vec = self._all_reduce_mean(vec)  # agree across ranks: NaN anywhere is NaN everywhere
        loss32, norm_g, overflow = vec[0], vec[1], vec[2] > 0
        if found_inf is not None:
            self._agree_found_inf(overflow)
        spike = torch.zeros(2, dtype=torch.bool, device=self.device)
        if isinstance(self.spikes, SpikeDetector):
            spike = self.spikes.is_spike(vec[:2])
        flags = [~loss32.isfinite(), overflow, ~norm_g.isfinite(), spike[0], spike[1]]
        reason = torch.zeros((), dtype=torch.int64, device=self.device)
        for flag, code in reversed(list(zip(flags, _FLAG_CODES))):  # first listed wins
            reason = torch.where(flag, code, reason)
        ok = reason == SkipReason.OK
        if self.spikes is not None:
            self.spikes.update(vec[:2], ok)  # type: ignore[arg-type]
        return ok, reason, loss32, norm_g

    def _agree_found_inf(self, overflow: torch.Tensor) -> None:
        """Make every rank's GradScaler.update() see the agreed overflow flag."""
        sc: Any = self.scaler
        for t in scaler_optimizer_state(sc, self._scaler_key)["found_inf_per_device"].values():
            t.copy_(overflow)

    def _world(self) -> int:
        """The process group's size, read at the first step (the group exists by then)."""
        if self._world_size is None:
            dist = torch.distributed
            initialized = dist.is_available() and dist.is_initialized()
            self._world_size = dist.get_world_size(self.process_group) if initialized else 1
        return self._world_size

    def _all_reduce_mean(self, vec: torch.Tensor) -> torch.Tensor:
        world = self._world()
        if world == 1:
            return vec
        dist = torch.distributed
        dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=self.process_group)
        return vec / world

    def _count(self, reason: torch.Tensor, values: list[torch.Tensor]) -> None:
        mul, inc = self._count_table.index_select(0, reason.view(1))[0]  # (2, counters)
        torch.addcmul(inc, self._counts, mul, out=self._counts)
        torch.stack([reason.float(), *values], out=self._last)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"StepGuard: {message}", stacklevel=3)

    def close(self) -> None:
        """Remove the forward pre-hook `protect_buffers=True` installed on the model."""
        if self.buffers is not None:
            self.buffers.close()
