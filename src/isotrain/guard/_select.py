"""StepGuard's device path: apply or skip one optimizer step by selection, with no sync.

"found_inf" hands the decision to the fused kernels (the GradScaler protocol); "select" copies
params and optimizer state before the step and selects old or new after it with `torch.where`
(NaN-safe: selection, never multiply-by-0). StepGuard picks the mode: NOTE [skip modes]. A
wrapped optimizer is stepped as given, decided on inside: NOTE [wrapped optimizers] in `_optim`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from isotrain._torch_private import foreach_copy_
from isotrain.guard._optim import found_inf_on

__all__ = ["SelectiveStep"]

# NOTE [skip modes]
# "found_inf" (fused Adam/AdamW/SGD): the GradScaler protocol; the fused kernel skips itself.
# "select": copy params and optimizer state tensors before the step (one _foreach_copy_ into
#   reused buffers), run the step, then `torch.where(ok, new, old, out=new)`: any optimizer,
#   NaN-safe (selection, not multiply-by-0), sync-free.
# "host": read loss and norm as Python floats, decide, count and keep the spike window on the
#   host (HostSpikeDetector), and skip `optimizer.step()` (and the clip) by branching. Free when
#   the values live in host memory (CPU training: reading a CPU tensor waits for no device), a
#   sync per step on accelerators; `sync_check` is not applied in this mode. Counters become
#   tensors only in state_dict() (the same format as the device modes', so snapshots cross).
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


class SelectiveStep:
    """Run `optimizer.step()` so that a device bool `ok` decides, on the device, if it counts.

    Example: ``SelectiveStep([opt], "select", device, warn).run(ok, contextlib.nullcontext)``
    """

    def __init__(
        self,
        chain: list[Any],
        mode: str,
        device: torch.device,
        warn: Callable[[str, str], None],
    ) -> None:
        # chain: the optimizer as given (what `step()` is called on) down to the torch optimizer
        self.chain, self.optimizer, self.inner = chain, chain[0], chain[-1]
        self.mode, self.device, self._warn = mode, device, warn
        self._src: list[torch.Tensor] = []  # the tensors "select" copies, and their copies
        self._copies: list[torch.Tensor] = []

    def run(
        self, ok: torch.Tensor, sync_check: Callable[[], contextlib.AbstractContextManager[Any]]
    ) -> None:
        """Snapshot, step, undo host-side state on a skip, select; `sync_check` wraps the
        phases that must not sync (the tests make any host read raise there)."""
        with sync_check():
            fresh, host_state = self._snapshot()
        with sync_check() if self.mode == "found_inf" else contextlib.nullcontext():
            self._step(ok)
        self._undo_host_state(ok, fresh, host_state)
        with sync_check():
            self._restore(ok)

    def _snapshot(self) -> tuple[list[Any], list[tuple[dict[str, Any], Any, Any]]]:
        """Copy params and optimizer state tensors that the step may change (non-fused path)."""
        fresh, host_state, tensors = [], [], []
        # Read every step: load_state_dict (a rollback, a resume) replaces `state` objects.
        found = [getattr(o, "state", None) for o in self.chain]
        states = list({id(s): s for s in found if isinstance(s, dict)}.values())  # often shared
        for group in self.inner.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue  # torch.optim leaves params without grads untouched
                tensors.append(p)
                for owner in states:
                    state = owner.get(p)
                    if not state:
                        fresh.append((owner, p))  # state created by this step: dropped on a skip
                        continue
                    for key, value in state.items():
                        if torch.is_tensor(value):
                            tensors.append(value)
                        else:
                            host_state.append((state, key, value))
        if self.mode == "found_inf":
            return fresh, host_state  # the fused kernels honour found_inf themselves
        same = len(tensors) == len(self._src) and all(a is b for a, b in zip(tensors, self._src))
        if not same:  # (re)allocate once; reused every step while the state tensors stay the same
            self._src, self._copies = tensors, [torch.empty_like(t) for t in tensors]
        if tensors:
            foreach_copy_(self._copies, tensors)
        return fresh, host_state

    def _step(self, ok: torch.Tensor) -> None:
        if self.mode == "select":
            self.optimizer.step()
            return
        with found_inf_on(self.inner, (~ok).to(torch.float32)):  # the GradScaler protocol
            self.optimizer.step()

    def _restore(self, ok: torch.Tensor) -> None:
        if self.mode != "select":
            return
        on_device: dict[torch.device, torch.Tensor] = {self.device: ok}
        for cur, old in zip(self._src, self._copies):
            if cur.device not in on_device:
                self._warn(
                    "device",
                    f"optimizer state on {cur.device} while params are on {self.device}: the skip "
                    "decision is copied to the host every step (a sync); use fused=True or "
                    "capturable=True in the optimizer to avoid it",
                )
                on_device[cur.device] = ok.to(cur.device)  # sync: see NOTE [where select ...]
            torch.where(on_device[cur.device], cur, old, out=cur)  # selection, NaN-safe

    def _undo_host_state(self, ok: torch.Tensor, fresh: list[Any], host_state: list[Any]) -> None:
        new = [(s, p) for s, p in fresh if any(v is not None for v in s.get(p, {}).values())]
        changed = [(s, k, v) for s, k, v in host_state if s.get(k) is not v and s.get(k) != v]
        if not new and not changed:
            return
        if changed:
            self._warn("host", "optimizer keeps non-tensor state: each step syncs to undo it")
        if not bool(ok):  # sync: see NOTE [where select / found_inf may still sync]
            for states, p in new:
                del states[p]
            for s, k, v in changed:
                s[k] = v
