"""Cost of StepGuard's buffer protection (on by default for BatchNorm nets) in a full step.

A small BatchNorm convnet (conv-BN-ReLU stages, then a linear head), AdamW for-loop, StepGuard
with skip_mode "auto" (on the CPU: "host") and the device path "select": protect_buffers=False
against the default (protection on: one copy of the buffers per step, plus one select on the
device path). No step is skipped (checked), and both variants train to the same losses.

Rounds of one full step per variant (forward + backward + guarded update, order rotating)
continue until every default/off ratio's 95% interval is within +-2% (stats.Stopper). One
thread and process CPU time by default.

    python benchmarks/bench_guard_buffers.py          # ~1-3 minutes on 2 cores
    python benchmarks/bench_guard_buffers.py --quick  # seconds, a smoke run into a temp dir

Writes guard_buffers.{md,json} into benchmarks/results/<cpu-kind>/.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from common import (
    add_common_args,
    check,
    checks_md,
    machine_line,
    out_dir,
    run_meta,
    steady_malloc,
    torch_threads,
    write_results,
)
from isotrain.guard import StepGuard
from loops import SPIKE_K
from stats import Stopper, fmt_ci, half_width, paired_diffs, paired_ratios, summarize

COLUMNS = [
    "channels",
    "buffer KB",
    "skip mode",
    "off: step ms",
    "default (protected): step ms",
    "step time protected / off [95% CI]",
    "CI half-width",
    "extra ms per step [95% CI]",
]


def build(channels: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    c_in = 3
    for _ in range(4):
        layers += [nn.Conv2d(c_in, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU()]
        c_in = channels
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))


class Variant:
    """One convnet + AdamW + StepGuard in `mode`, buffers protected (the default) or not."""

    def __init__(self, channels: int, mode: str, protect: bool) -> None:
        self.model = build(channels, seed=0)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=False)
        kw: dict[str, Any] = {} if protect else {"protect_buffers": False}  # the default: on
        self.guard = StepGuard(self.opt, self.model, skip_mode=mode, spike_k=SPIKE_K, **kw)
        self.name = "default" if protect else "off"

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One train step; seconds of process CPU time."""
        t0 = time.process_time()
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.guard.step(loss.detach())
        return time.process_time() - t0

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> float:
        with torch.no_grad():
            return float(F.cross_entropy(self.model(x), y))


def bench(channels: int, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    variants = [Variant(channels, mode, protect) for protect in (False, True)]
    g = torch.Generator().manual_seed(1)
    x, y = (
        torch.randn(*args.batch, generator=g),
        torch.randint(0, 10, (args.batch[0],), generator=g),
    )
    for v in variants:  # warm up: allocator, optimizer state, the guard's copies
        v.step(x, y), v.step(x, y)
    steps: dict[str, list[float]] = {v.name: [] for v in variants}
    stopper = Stopper(lambda: paired_ratios(steps, "off", speed=False),
                      min_rounds=args.min_rounds, max_rounds=args.rounds)  # fmt: skip
    r = 0
    while not stopper(r):
        for v in variants[r % 2 :] + variants[: r % 2]:
            steps[v.name].append(v.step(x, y))
        r += 1
    guard = variants[1].guard.buffers
    protected = guard is not None and not guard.off
    kb = sum(b.numel() * b.element_size() for b in variants[1].model.buffers()) / 1e3
    return {
        "channels": channels, "buffer_kb": kb, "skip_mode": variants[1].guard.skip_mode,
        "requested_mode": mode, "protected": protected,
        "off_ms": 1e3 * statistics.median(steps["off"]),
        "default_ms": 1e3 * statistics.median(steps["default"]),
        "ratio": summarize(paired_ratios(steps, "off", speed=False)["default"]),
        "extra_ms": summarize(paired_diffs(steps, "off", scale=1e3)["default"]),
        "stopping": stopper.record(r),
        "skipped": [int(v.guard.summary()["skipped"]) for v in variants],
        "losses": [v.loss(x, y) for v in variants],
    }  # fmt: skip


def nan_batch_check(channels: int, batch: tuple[int, ...]) -> dict[str, Any]:
    """A default guard skips a NaN-image step and leaves the BatchNorm statistics as before."""
    v = Variant(channels, "auto", protect=True)
    x, y = torch.randn(*batch), torch.zeros(batch[0], dtype=torch.long)
    v.step(x, y)
    before = [b.clone() for b in v.model.buffers()]
    x[0, 0, 0, 0] = float("nan")
    v.step(x, y)
    same = all(torch.equal(a, b) for a, b in zip(v.model.buffers(), before, strict=True))
    skipped = int(v.guard.summary()["skipped"])
    return check(same and skipped == 1, f"skipped {skipped} step(s); statistics unchanged: {same}")


def markdown(res: dict[str, Any]) -> str:
    m = res["meta"]
    lines = [
        "# StepGuard buffer protection (the default for BatchNorm nets) in a full step",
        "",
        f"Command: `{m['command']}`  ",
        f"Machine: {machine_line(m)}  ",
        "Full step = forward + backward + guarded update of a 4-stage conv-BN-ReLU net; off = "
        "`protect_buffers=False`, default = protection on. Ratio: median of per-round "
        "protected/off step times (one-step rounds, order alternating) with its 95% interval. "
        "Clock: process CPU time.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for r in res["results"]:
        lines.append(
            f"| {r['channels']} | {r['buffer_kb']:.1f} | {r['skip_mode']} | {r['off_ms']:.2f} "
            f"| {r['default_ms']:.2f} | {fmt_ci(r['ratio'])} "
            f"| +-{100 * half_width(r['ratio']):.1f}% | {fmt_ci(r['extra_ms'])} |"
        )
    stops = {r["stopping"]["reason"] for r in res["results"]}
    lines += ["", f"Rounds: {'; '.join(sorted(stops))}.", ""]
    return "\n".join([*lines, *checks_md(res["checks"])])


def checks(results: list[dict[str, Any]], nan_check: dict[str, Any]) -> dict[str, Any]:
    skips = {f"c{r['channels']} {r['skip_mode']}": r["skipped"] for r in results}
    worst = max(abs(r["losses"][1] - r["losses"][0]) / r["losses"][0] for r in results)
    return {
        "no skipped steps": check(not any(sum(s) for s in skips.values()), f"skipped: {skips}"),
        "equal losses": check(worst <= 1e-6, f"largest relative difference: {worst:.1e}"),
        "protected by default": check(
            all(r["protected"] for r in results), "the default guard kept protecting"
        ),
        "a NaN image leaves the statistics": nan_check,
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--rounds", type=int, default=400, help="the most rounds per configuration")
    p.add_argument("--min-rounds", type=int, default=40)
    args = p.parse_args(argv)
    args.sizes, args.batch = (16, 64), (16, 3, 16, 16)
    if args.quick:
        args.rounds = args.min_rounds = 3
        args.sizes, args.batch = (8,), (4, 3, 8, 8)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = out_dir(args)
    load_before = os.getloadavg()[0]
    results = []
    with torch_threads(args.threads):
        for channels in args.sizes:
            for mode in ("auto", "select"):
                results.append(bench(channels, mode, args))
        nan_check = nan_batch_check(args.sizes[0], args.batch)
        meta = run_meta("bench_guard_buffers.py", argv, load_before)
    res = {
        "meta": meta,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "results": results,
        "checks": checks(results, nan_check),
    }
    return write_results(out, "guard_buffers", res, markdown(res))


if __name__ == "__main__":
    steady_malloc()
    raise SystemExit(main())
