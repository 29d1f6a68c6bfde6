"""`--precision auto`: the faster of fp32 and bf16 for this device and this model, measured.

Capability alone does not decide it: on a CPU with AVX512-BF16 but no AMX a bf16 matmul can
be slower than fp32, and on an AMX CPU a tiny model's step may still be faster in fp32. So
where bf16 is native, a short probe times the model's own training step in both precisions
(interleaved) and the result is cached per machine, torch version and shape.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

import torch

from isotrain.autograd import native_bf16_matmul
from isotrain.contexts import autocast_if_available, rng_isolated
from isotrain.train.config import TrainConfig
from isotrain.train.files import PlantedPathError, replace_file
from isotrain.train.model.gpt import GPT
from isotrain.train.parallel import DistInfo, from_main

__all__ = [
    "PrecisionChoice",
    "cache_path",
    "choose_precision",
    "probe_ratio",
    "resolve_precision",
]

log = logging.getLogger(__name__)

BF16_WINS_BELOW = 0.95  # bf16 must be at least 5% faster to be worth its rounding
ProbeFn = Callable[[TrainConfig, torch.device], float]


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision `auto` resolved to, why, and the measured bf16 / fp32 step-time ratio."""

    precision: str
    reason: str
    ratio: float | None = None
    cached: bool = False

    def describe(self) -> str:
        """One line for the run header: `bf16 (auto: ...)`."""
        return f"{self.precision} (auto: {self.reason})"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_key(cfg: TrainConfig, device: torch.device) -> str:
    m = cfg.model
    parts = [
        _device_name(device),
        f"torch {torch.__version__}",
        f"threads {torch.get_num_threads()}" if device.type == "cpu" else device.type,
        f"{m.n_layer}x{m.d_model}h{m.n_head} T{m.block_size} V{m.vocab_size}",
        f"B{cfg.data.batch_size}",
    ]
    return " | ".join(parts)


def cache_path() -> Path:
    """Where probe results live: $ISOTRAIN_CACHE_DIR, else $XDG_CACHE_HOME/isotrain."""
    root = os.environ.get("ISOTRAIN_CACHE_DIR")
    if root:
        return Path(root) / "precision.json"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "isotrain" / "precision.json"


def _read_cache(path: Path) -> dict[str, dict[str, object]]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError) as e:
        log.warning("ignoring the unreadable precision cache %s (%s); probing again", path, e)
        return {}


def _write_cache(path: Path, key: str, choice: PrecisionChoice) -> None:
    data = _read_cache(path)
    data[key] = {k: v for k, v in asdict(choice).items() if k != "cached"}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(path, json.dumps(data, indent=1, sort_keys=True))
    except (OSError, PlantedPathError) as e:  # a read-only home must not stop training
        log.warning("could not cache the precision probe in %s (%s)", path, e)


def _time_step(
    model: GPT, opt: torch.optim.Optimizer, x: torch.Tensor, bf16: bool, device: torch.device
) -> float:
    start = time.perf_counter()
    with autocast_if_available(torch.bfloat16, device=device, enabled=bf16):
        loss = model(x, x)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # sync: timing the probe, never in training
    return time.perf_counter() - start


def probe_ratio(cfg: TrainConfig, device: torch.device, *, rounds: int = 4) -> float:
    """Median bf16 step time over median fp32 step time of `cfg`'s model, interleaved rounds."""
    with rng_isolated(seed=0):
        model = GPT(cfg.model).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(0)
        shape = (cfg.data.batch_size, cfg.model.block_size)
        x = torch.randint(0, cfg.model.vocab_size, shape, generator=gen).to(device)
        times: dict[bool, list[float]] = {False: [], True: []}
        for r in range(rounds + 1):  # round 0 warms both precisions up and is not counted
            for bf16 in (r % 2 == 0, r % 2 == 1):  # alternate which goes first
                t = _time_step(model, opt, x, bf16, device)
                if r:
                    times[bf16].append(t)
    return statistics.median(times[True]) / statistics.median(times[False])


def _bf16_native(device: torch.device) -> tuple[bool, str]:
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return True, f"{_device_name(device)} has bf16"
        return False, f"{_device_name(device)} has no bf16"
    if device.type == "cpu":
        if native_bf16_matmul():
            return True, f"this CPU multiplies bf16 natively ({_cpu_capability()})"
        return False, "this CPU emulates bf16 (AVX2 only), fp32 is faster"
    return False, f"bf16 is not probed on {device.type}"


def _cpu_capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


def choose_precision(
    cfg: TrainConfig, device: torch.device, *, probe: ProbeFn | None = None
) -> PrecisionChoice:
    """fp32 or bf16 for `cfg`'s model on `device`: capability first, then a cached probe."""
    native, why = _bf16_native(device)
    if not native:
        return PrecisionChoice("fp32", why)
    path, key = cache_path(), _cache_key(cfg, device)
    hit = _read_cache(path).get(key)
    if isinstance(hit, dict) and hit.get("precision") in ("fp32", "bf16"):
        return PrecisionChoice(
            str(hit["precision"]), str(hit.get("reason", "")), _float(hit.get("ratio")), True
        )
    ratio = (probe or probe_ratio)(cfg, device)
    precision = "bf16" if ratio < BF16_WINS_BELOW else "fp32"
    measured = f"measured bf16/fp32 step time {ratio:.2f}x on this model"
    choice = PrecisionChoice(precision, f"{why}; {measured}", ratio)
    _write_cache(path, key, choice)
    return choice


def _float(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def resolve_precision(cfg: TrainConfig, info: DistInfo) -> tuple[TrainConfig, str]:
    """`cfg` with `auto` replaced by the choice, made on rank 0 for every rank; and why."""
    if cfg.precision != "auto":
        return cfg, f"{cfg.precision} (--precision {cfg.precision})"
    choice = from_main(choose_precision(cfg, info.device) if info.is_main else None)
    assert choice is not None  # rank 0 always decides
    precision: Literal["fp32", "bf16"] = "bf16" if choice.precision == "bf16" else "fp32"
    return replace(cfg, precision=precision), choice.describe()
