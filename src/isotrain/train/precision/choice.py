"""`--precision auto`: fp32, bf16 or bf16-matmul, whichever trains this model fastest here.

Capability alone does not decide it: on a CPU with AVX512-BF16 but no AMX tiles a bf16 matmul
is slower than fp32, and on an AMX CPU the matmuls gain while attention's backward loses. So
where bf16 is native the probe times the model's own step in all three modes and keeps the
fastest that beats fp32 by 5%; the result is cached per machine, torch, threads and shape.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from isotrain.train.config import TrainConfig
from isotrain.train.parallel import DistInfo, from_main
from isotrain.train.precision.cache import cache_key, cache_path, read_entry, write_entry
from isotrain.train.precision.capability import bf16_native
from isotrain.train.precision.modes import MODES
from isotrain.train.precision.probe import Measurement, measure, model_steps

__all__ = ["WINS_BELOW", "PrecisionChoice", "choose_precision", "decide", "resolve_precision"]

WINS_BELOW = 0.95  # a bf16 mode must be at least 5% faster than fp32 to be worth its rounding
Probe = Callable[[TrainConfig, torch.device], Measurement]


@dataclass(frozen=True)
class PrecisionChoice:
    """What `auto` resolved to ("auto" while the probe is still to run), and why."""

    precision: str
    reason: str
    ratios: dict[str, float] | None = None  # each mode's step time over fp32's
    measured: str | None = None  # when the ratios were measured (ISO 8601)
    cached: bool = False

    def describe(self) -> str:
        """One line for the run header: `bf16-matmul (auto: ...)`."""
        if self.precision == "auto":
            return f"auto: {self.reason}"
        return f"{self.precision} (auto: {self.reason})"


def decide(ratios: dict[str, float]) -> str:
    """The fastest mode that is at least 5% faster than fp32; else fp32."""
    best = min(MODES, key=lambda m: ratios[m])
    return best if ratios[best] < WINS_BELOW else "fp32"


def _in_words(ratios: dict[str, float]) -> str:
    return "step time " + ", ".join(f"{m} {ratios[m]:.2f}x" for m in MODES)


def _from_cache(entry: dict[str, Any], why: str) -> PrecisionChoice:
    ratios = {m: float(v) for m, v in entry["ratios"].items()}
    measured = str(entry["measured"])
    again = f"delete {cache_path()} to measure again"
    words = f"{why}; {_in_words(ratios)}, cached (measured {measured[:10]}; {again})"
    return PrecisionChoice(str(entry["precision"]), words, ratios, measured, cached=True)


def _pending(cfg: TrainConfig, why: str) -> PrecisionChoice:
    budget = cfg.precision_probe_seconds
    modes = ", ".join(MODES[:-1]) + " and " + MODES[-1]
    return PrecisionChoice("auto", f"{why}; measuring {modes} steps (at most {budget:g} s)...")


def choose_precision(
    cfg: TrainConfig,
    device: torch.device,
    *,
    measure_now: bool = True,
    probe: Probe | None = None,
    progress: Callable[[str], None] | None = None,
) -> PrecisionChoice:
    """fp32, bf16 or bf16-matmul for `cfg`'s model on `device`: capability first, then the
    cache, then the probe (with `measure_now`; otherwise a choice of "auto", still to run)."""
    native, why = bf16_native(device)
    if not native:
        return PrecisionChoice("fp32", why)
    path, key = cache_path(), cache_key(cfg, device)
    entry = read_entry(path, key)
    if entry is not None:
        return _from_cache(entry, why)
    if not measure_now:
        return _pending(cfg, why)
    if probe is None:
        with model_steps(cfg, device) as step:
            result = measure(step, budget_s=cfg.precision_probe_seconds, progress=progress)
    else:
        result = probe(cfg, device)
    if result.over_budget:
        return _over_budget(cfg, why, result)
    ratios = result.ratios()
    measured = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    choice = PrecisionChoice(decide(ratios), f"{why}; {_in_words(ratios)}", ratios, measured)
    write_entry(path, key, {"precision": choice.precision, "ratios": ratios, "measured": measured})
    return choice


def _over_budget(cfg: TrainConfig, why: str, result: Measurement) -> PrecisionChoice:
    budget = cfg.precision_probe_seconds
    return PrecisionChoice(
        "fp32",
        f"{why}; the probe stopped at its {budget:g} s budget after {result.steps} step(s) "
        f"({result.seconds:.0f} s), before every mode was timed, so the run takes fp32; raise "
        "--precision-probe-seconds, or pass --precision bf16 or bf16-matmul to choose yourself",
    )


def resolve_precision(
    cfg: TrainConfig,
    info: DistInfo,
    *,
    measure_now: bool = True,
    progress: Callable[[str], None] | None = None,
) -> tuple[TrainConfig, str]:
    """`cfg` with `auto` replaced by the choice, made on rank 0 for every rank; and why.

    Without `measure_now`, a choice that needs the probe leaves `cfg.precision` at "auto"
    (call again with `measure_now` to run it) and says so."""
    if cfg.precision != "auto":
        return cfg, f"{cfg.precision} (--precision {cfg.precision})"
    choice = from_main(
        choose_precision(cfg, info.device, measure_now=measure_now, progress=progress)
        if info.is_main
        else None
    )
    if choice is None:  # rank 0 always decides: a broadcast that lost it is a bug
        raise RuntimeError("rank 0 sent no precision choice")
    if choice.precision == "auto":
        return cfg, choice.describe()
    return replace(cfg, precision=choice.precision), choice.describe()  # type: ignore[arg-type]
