"""The guard's spike window: mean + k * std of recent accepted values, on the device or the host.

``SpikeDetector`` runs inside the sync-free guarded step (never syncs); ``HostSpikeDetector`` is
the same test on Python floats for the guard's "host" mode. Imports only torch and the stdlib.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import torch

__all__ = ["HostSpikeDetector", "SpikeDetector"]


def _check_window(n_series: int, k: float, window: int, min_samples: int) -> None:
    if window < 2 or not 2 <= min_samples <= window or k <= 0 or n_series < 1:
        raise ValueError(
            f"SpikeDetector needs window >= 2, 2 <= min_samples <= window and k > 0; got "
            f"window={window}, min_samples={min_samples}, k={k}, n_series={n_series}"
        )


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
        _check_window(n_series, k, window, min_samples)
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


# NOTE [exact host window]
# Every float32 is an integer multiple of 2**-149, so the host window keeps its running sum and sum
# of squares as exact Python ints (value * 2**149 and its square). The variance's numerator
# n*sum(x^2) - sum(x)^2 is formed exactly in ints (no cancellation) and only then rounded to a
# float; the scale 2**-149 is applied by multiplying with that power of two, which rounds exactly
# as ldexp does (once, correctly). No drift over millions of steps, and the same sums whether the
# window was filled step by step or loaded from a snapshot (so a resumed run makes exactly the
# decisions of an uninterrupted one). Big-int true division is avoided: it costs several
# microseconds a step. Until the window is warm the limits are +inf: no value is above them.
_SHIFT = 149
_SCALE = 2.0**_SHIFT
_UNSCALE, _UNSCALE_SQ = 2.0**-_SHIFT, 2.0 ** (-2 * _SHIFT)  # both exact doubles
_COLD = math.inf


_F32 = struct.Struct("f")


def _f32(v: float) -> float:
    return _F32.unpack(_F32.pack(v))[0]


class HostSpikeDetector:
    """The same window and test as :class:`SpikeDetector`, on host floats (no torch op, no sync).

    For the guard's "host" skip mode (CPU training), where the values are host floats anyway.
    Values are rounded to float32 on entry, as in the device window. ``state_dict`` has the same
    format as :class:`SpikeDetector`'s, so a snapshot written by either loads in the other.
    The limits (mean + k*std per series) are recomputed when the window changes, so the check
    each step is one comparison per value.

    Example::

        det = HostSpikeDetector(n_series=1, k=6.0, window=128, min_samples=16)
        (spike,) = det.is_spike([loss_value])
        det.update([loss_value], accept=not spike)
    """

    REL_STD_FLOOR = SpikeDetector.REL_STD_FLOOR
    _limits: list[float]  # mean + k * std per series, recomputed when the window changes

    def __init__(
        self, *, n_series: int = 2, k: float = 6.0, window: int = 128, min_samples: int = 16
    ) -> None:
        _check_window(n_series, k, window, min_samples)
        self.k, self.window, self.min_samples = float(k), int(window), int(min_samples)
        self._ints = [[0] * window for _ in range(n_series)]  # value * 2**149, slot = count % W
        self.count = 0  # accepted values so far
        self._resum()

    @property
    def values(self) -> list[list[float]]:
        """The ring buffers as floats (exact: every entry is a float32 times 2**149)."""
        return [[i / _SCALE for i in ring] for ring in self._ints]

    def is_spike(self, values: list[float]) -> list[bool]:
        """Which values exceed mean + k*std of their window (all False until warm)."""
        return [v > lim for v, lim in zip(values, self._limits, strict=True)]

    def observe(self, loss: float, norm: float) -> int:
        """The guard's per-step test and update, for two series of finite float32 values.

        1 if ``loss`` spikes, 2 if ``norm`` does (the window unchanged), else 0 once both are in
        the window: `is_spike` then `push` in one call, the arithmetic of `_set_limits` unrolled.
        """
        limits = self._limits
        if len(limits) != 2:
            raise ValueError(f"observe() needs a detector of 2 series, this one has {len(limits)}")
        if loss > limits[0]:
            return 1
        if norm > limits[1]:
            return 2
        count, window = self.count, self.window
        slot = count % window
        ring_l, ring_n = self._ints
        sums, sumsqs = self._sum, self._sumsq
        new_l, new_n = int(loss * _SCALE), int(norm * _SCALE)
        old_l, old_n = ring_l[slot], ring_n[slot]
        ring_l[slot], ring_n[slot] = new_l, new_n
        s_l = sums[0] = sums[0] + (new_l - old_l)
        s_n = sums[1] = sums[1] + (new_n - old_n)
        q_l = sumsqs[0] = sumsqs[0] + (new_l * new_l - old_l * old_l)
        q_n = sumsqs[1] = sumsqs[1] + (new_n * new_n - old_n * old_n)
        self.count = count = count + 1
        if count < self.min_samples:
            return 0
        n = count if count < window else window
        pairs, k, floor = n * (n - 1), self.k, self.REL_STD_FLOOR
        mean_l, mean_n = float(s_l) / n * _UNSCALE, float(s_n) / n * _UNSCALE
        std_l = math.sqrt(float(n * q_l - s_l * s_l) / pairs * _UNSCALE_SQ)
        std_n = math.sqrt(float(n * q_n - s_n * s_n) / pairs * _UNSCALE_SQ)
        floor_l = (mean_l if mean_l >= 0 else -mean_l) * floor
        floor_n = (mean_n if mean_n >= 0 else -mean_n) * floor
        self._limits = [
            mean_l + k * (floor_l if floor_l > std_l else std_l),
            mean_n + k * (floor_n if floor_n > std_n else std_n),
        ]
        return 0

    def update(self, values: list[float], accept: bool) -> None:
        """Write ``values`` (finite) into the ring buffers when ``accept``."""
        if not accept:
            return
        if not all(map(math.isfinite, values)):
            raise ValueError(f"HostSpikeDetector.update: accepted values must be finite: {values}")
        self.push([_f32(v) for v in values])

    def push(self, values: list[float]) -> None:
        """``update(values, True)`` for finite values that already are float32 (unchecked).

        The guard's per-step path: its values come from float32 tensors.
        """
        slot = self.count % self.window
        rings, sums, sumsqs = self._ints, self._sum, self._sumsq
        for i in range(len(rings)):  # plain loop: this runs every guarded step
            ring = rings[i]
            old, new = ring[slot], int(values[i] * _SCALE)
            ring[slot] = new
            sums[i] += new - old
            sumsqs[i] += new * new - old * old
        self.count += 1
        self._set_limits()

    def _resum(self) -> None:
        self._sum = [sum(r) for r in self._ints]
        self._sumsq = [sum(x * x for x in r) for r in self._ints]
        self._set_limits()

    def _set_limits(self) -> None:
        """mean + k * max(std, |mean| * floor) per series, from the exact sums; +inf until warm."""
        if self.count < self.min_samples:
            self._limits = [_COLD] * len(self._sum)
            return
        n = min(self.count, self.window)
        k, floor, sqrt = self.k, self.REL_STD_FLOOR, math.sqrt
        limits = []
        for s, q in zip(self._sum, self._sumsq):  # see NOTE [exact host window]
            mean = float(s) / n * _UNSCALE
            std = sqrt(float(n * q - s * s) / (n * (n - 1)) * _UNSCALE_SQ)
            limits.append(mean + k * max(std, abs(mean) * floor))
        self._limits = limits

    def state_dict(self) -> dict[str, Any]:
        return {
            "values": torch.tensor(self.values, dtype=torch.float32),
            "count": torch.tensor(self.count, dtype=torch.int64),
            "k": self.k,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        shape = (len(self._ints), self.window)
        if tuple(state["values"].shape) != shape:
            raise ValueError(
                f"spike window shape {tuple(state['values'].shape)} does not match this "
                f"detector's {shape}; build it with the same spike_window"
            )
        floats = state["values"].detach().cpu().float().tolist()
        self._ints = [[int(v * _SCALE) for v in ring] for ring in floats]
        self.count = int(state["count"])
        self._resum()
