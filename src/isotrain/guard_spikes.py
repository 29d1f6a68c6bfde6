"""The guard's spike window: mean + k * std of recent accepted values, kept on the device.

Runs inside the guarded step, so it never syncs. Imports only torch and the standard library.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["SpikeDetector"]


class SpikeDetector:
    """Flags values above mean + k*std of a rolling window of accepted values, on the device.

    The window is a ring buffer tensor plus a count tensor, so checking and updating never sync.

    Example::

        det = SpikeDetector(n_series=1, k=6.0, window=128, min_samples=16)
        spike = det.is_spike(loss.view(1))  # (1,) bool tensor
        det.update(loss.view(1), accept=~spike[0])
    """

    # A window of identical values has std 0; keep a relative floor so the next equal-ish value
    # is not a "spike".
    REL_STD_FLOOR = 1e-4

    def __init__(
        self, *, n_series: int = 2, k: float = 6.0, window: int = 128, min_samples: int = 16,
        device: torch.device | str | None = None,
    ) -> None:  # fmt: skip
        if window < 2 or not 2 <= min_samples <= window or k <= 0 or n_series < 1:
            raise ValueError(
                f"SpikeDetector needs window >= 2, 2 <= min_samples <= window and k > 0; got "
                f"window={window}, min_samples={min_samples}, k={k}, n_series={n_series}"
            )
        self.k, self.window, self.min_samples = float(k), int(window), int(min_samples)
        self.values = torch.zeros(n_series, window, dtype=torch.float32, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)  # accepted values so far
        self._slots = torch.arange(window, device=device)

    def is_spike(self, values: torch.Tensor) -> torch.Tensor:
        """(n_series,) bool: which values exceed mean + k*std of their window (False until warm)."""
        v = values.detach().float().reshape(-1, 1)  # (S, 1)
        n = self.count.clamp(max=self.window)
        valid = self._slots < n  # (W,)
        mean = torch.where(valid, self.values, 0.0).sum(1, keepdim=True) / n.clamp(min=1)
        sq = torch.where(valid, (self.values - mean).square(), 0.0).sum(1, keepdim=True)
        std = (sq / (n - 1).clamp(min=1)).sqrt().maximum(mean.abs() * self.REL_STD_FLOOR)
        return ((self.count >= self.min_samples) & (v > mean + self.k * std)).reshape(-1)

    def update(self, values: torch.Tensor, accept: torch.Tensor) -> None:
        """Write ``values`` into the ring buffer when ``accept`` (a device bool) is true."""
        write = (self._slots == self.count % self.window) & accept  # (W,)
        v = values.detach().float().reshape(-1, 1)
        self.values.copy_(torch.where(write, v, self.values))
        self.count.add_(accept.to(torch.int64))

    def state_dict(self) -> dict[str, Any]:
        return {"values": self.values.clone(), "count": self.count.clone(), "k": self.k}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if tuple(state["values"].shape) != tuple(self.values.shape):
            raise ValueError(
                f"spike window shape {tuple(state['values'].shape)} does not match this "
                f"detector's {tuple(self.values.shape)}; build it with the same spike_window"
            )
        self.values.copy_(state["values"])
        self.count.copy_(state["count"])
