"""What a StepGuard has counted, read at log steps, and its state in a snapshot.

`GuardRecord` is StepGuard's reading side: counters in host mode are Python numbers, in the
device modes one tensor each (read with one sync, at log steps only).
"""

from __future__ import annotations

from typing import Any

import torch

from isotrain.guard._outcome import SkipReason
from isotrain.guard._spikes import HostSpikeDetector, SpikeDetector

__all__ = ["GuardRecord"]


class GuardRecord:
    """Counters, summary and state dict of a StepGuard (its base class)."""

    host: bool
    device: torch.device
    steps: int
    names: list[str]
    spikes: SpikeDetector | HostSpikeDetector | None
    _counts: Any  # [applied, *by_reason, consecutive]: a list (host) or an int64 tensor
    _last: Any  # [reason, norm, loss, scale]: a list (host) or a float32 tensor
    _grad_per: torch.Tensor | None
    _grad_order: tuple[list[int], list[int]]

    @property
    def consecutive_skips(self) -> torch.Tensor:
        """int64 count of skipped steps since the last applied one (on the guard's device)."""
        c = self._counts
        return torch.tensor(c[-1], device=self.device) if self.host else c[-1].clone()

    def note_rollback(self) -> None:
        """Reset the consecutive-skip count after the caller restored a last-good state."""
        if self.host:
            self._counts[-1] = 0
        else:
            self._counts[-1].zero_()

    def _host_values(self) -> tuple[list[int], list[float]]:
        if self.host:
            return list(self._counts), list(self._last)
        vals = torch.cat([self._counts.double(), self._last.double()]).tolist()  # sync: log step
        n = len(self._counts)
        return [int(v) for v in vals[:n]], vals[n:]

    def summary(self) -> dict[str, Any]:
        """Counters for a log line: steps, applied, skipped (total and by reason), last values."""
        (applied, *by_reason, consecutive), (reason, norm, loss, scale) = self._host_values()
        return {
            "steps": self.steps, "applied": applied, "skipped": self.steps - applied,
            "skipped_by_reason": {r.name: by_reason[r] for r in SkipReason if r},
            "consecutive_skips": consecutive, "last_reason": SkipReason(int(reason)).name,
            "last_grad_norm": norm, "last_loss": loss, "loss_scale": scale,
        }  # fmt: skip

    def nonfinite_grad_names(self) -> list[str]:
        """Names of the params whose gradient was non-finite at the last step (syncs once)."""
        if self._grad_per is None:
            return []
        finite = self._grad_per.isfinite().tolist()  # sync: called after a skip, at a log step
        present, order = self._grad_order
        return [self.names[present[j]] for j, f in zip(order, finite) if not f]

    def state_dict(self) -> dict[str, Any]:
        """Counters and spike window as plain tensors/ints (loadable with weights_only=True).

        The same format in every skip mode: a snapshot from one loads into a guard in another.
        """
        counts, last = self._counts, self._last
        if self.host:
            counts = torch.tensor(counts, dtype=torch.int64, device=self.device)
            last = torch.tensor(last, dtype=torch.float32, device=self.device)
        n = len(SkipReason)
        return {
            "version": 1, "steps": self.steps, "applied": counts[0].clone(),
            "by_reason": counts[1 : 1 + n].clone(), "consecutive": counts[-1].clone(),
            "last": last.clone(), "spikes": self.spikes.state_dict() if self.spikes else None,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counters and spike window so a resumed run continues the same window."""
        if state.get("version") != 1:
            raise ValueError(
                f"unknown StepGuard state version {state.get('version')!r}; expected 1"
            )
        self.steps = int(state["steps"])
        parts = [state["applied"].view(1), state["by_reason"], state["consecutive"].view(1)]
        counts = torch.cat([c.to(torch.int64).cpu() for c in parts])
        if self.host:
            self._counts, self._last = counts.tolist(), state["last"].float().tolist()
        else:
            self._counts.copy_(counts)
            self._last.copy_(state["last"])
        if self.spikes is not None and state["spikes"] is not None:
            self.spikes.load_state_dict(state["spikes"])
