"""The probe: the model's own training step timed in every mode, interleaved, within a budget.

`measure` knows nothing of models: it calls `step(mode)` in rotating order and reads `clock`,
so the decision is testable with a fake of either. `model_steps` gives the real step: a fresh
model of the run's shape (the run's own weights and RNG are never touched).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from isotrain.contexts import rng_isolated
from isotrain.train.config import TrainConfig
from isotrain.train.environment import memory_for
from isotrain.train.model.gpt import GPT
from isotrain.train.precision.modes import MODES, autocast_for

__all__ = ["Measurement", "Step", "measure", "model_steps"]

Step = Callable[[str], None]  # one training step in the precision named
Clock = Callable[[], float]


@dataclass(frozen=True)
class Measurement:
    """Step times per mode (warm-up left out), the probe's wall time, and whether the budget
    stopped it before every mode was timed `rounds` times."""

    times: dict[str, list[float]]
    seconds: float
    steps: int
    over_budget: bool

    def ratios(self) -> dict[str, float]:
        """Each mode's median step time over fp32's (fp32 itself: 1.0)."""
        fp32 = statistics.median(self.times["fp32"])
        return {m: statistics.median(t) / fp32 for m, t in self.times.items()}


def _rotated(r: int) -> tuple[str, ...]:
    k = r % len(MODES)  # each round starts with another mode: no mode always runs first
    return MODES[k:] + MODES[:k]


def measure(
    step: Step,
    *,
    budget_s: float,
    rounds: int = 4,
    clock: Clock = time.perf_counter,
    progress: Callable[[str], None] | None = None,
) -> Measurement:
    """Round 0 warms every mode up; rounds 1..`rounds` are timed. Before each step the probe
    stops if that step (its mode's last time, else the slowest so far) would end past
    `budget_s`; `progress` gets one line per round."""
    start, steps = clock(), 0
    times: dict[str, list[float]] = {m: [] for m in MODES}
    last: dict[str, float] = {}
    for r in range(rounds + 1):
        for mode in _rotated(r):
            guess = last.get(mode, max(last.values(), default=0.0))
            if clock() - start + guess > budget_s:
                return Measurement(times, clock() - start, steps, over_budget=True)
            t0 = clock()
            step(mode)
            last[mode] = clock() - t0
            steps += 1
            if r:
                times[mode].append(last[mode])
        if progress is not None:
            progress(_round_line(r, rounds, last, clock() - start, budget_s))
    return Measurement(times, clock() - start, steps, over_budget=False)


def _round_line(r: int, rounds: int, last: dict[str, float], spent: float, budget: float) -> str:
    what = "warm-up" if r == 0 else f"round {r}/{rounds}"
    each = ", ".join(f"{m} {last[m]:.3g} s" for m in MODES)
    return f"precision  measuring, {what}: {each} ({spent:.0f} of at most {budget:.0f} s)"


@contextlib.contextmanager
def model_steps(cfg: TrainConfig, device: torch.device) -> Iterator[Step]:
    """`step(mode)`: one forward, backward and AdamW step of a fresh model of `cfg`'s shape,
    on one batch of random tokens; the model is freed on exit, the global RNG untouched."""
    lower = "--data.batch-size or --model.block-size, or pass --precision fp32"
    what = "measuring the precision (--precision auto)"
    with rng_isolated(seed=0), memory_for(what, lower=lower):
        model = GPT(cfg.model).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(0)
        shape = (cfg.data.batch_size, cfg.model.block_size)
        x = torch.randint(0, cfg.model.vocab_size, shape, generator=gen).to(device)

        def step(mode: str) -> None:
            with autocast_for(mode, device):
                loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # sync: timing the probe, never in training

        yield step
