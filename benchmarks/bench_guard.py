"""Cost of StepGuard: guarded against a tuned plain update (clip + optimizer.step) in a full step.

Two model sizes (small transformer encoders, d 128 and d 384), AdamW for-loop and AdamW fused.
The plain update is the tuned one (parameter list kept, grads set to None); guarded variants:
skip_mode "auto" (on the CPU: "host") and the accelerator path ("select" for the for-loop
AdamW, "found_inf" for the fused one). The spike threshold is set so high that it never fires
(the detector runs at full cost; no step is skipped, which is checked).

Rounds of one full step per variant (forward + backward + update, order rotating) continue
until every guarded/plain ratio's 95% interval is within +-2% (stats.Stopper). Then the update
phase alone, with the same gradients every time. One thread and process CPU time by default.

    python benchmarks/bench_guard.py          # ~3-6 minutes on 2 cores
    python benchmarks/bench_guard.py --quick  # seconds, a smoke run into a temp dir

Writes guard.{md,json} into benchmarks/results/<cpu-kind>/.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
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
    "d_model",
    "params",
    "optimizer",
    "skip mode",
    "plain step ms",
    "guarded step ms",
    "step time guarded / plain [95% CI]",
    "CI half-width",
    "update ms, plain -> guarded",
]


def build(d: int, layers: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(
        d, nhead=4, dim_feedforward=4 * d, dropout=0.0, batch_first=True
    )  # no dropout: every variant computes the same losses (checked)
    return nn.Sequential(nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
                         nn.Linear(d, d))  # fmt: skip


class Variant:
    """One model + AdamW with a tuned plain update, or a StepGuard in `mode`."""

    def __init__(self, d: int, layers: int, opt_kind: str, mode: str | None) -> None:
        self.model = build(d, layers, seed=0)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        fused = opt_kind == "fused"
        self.opt = torch.optim.AdamW(
            self.params, lr=1e-4, fused=fused, foreach=None if fused else False
        )
        self.mode = mode or "plain"
        self.guard = None
        if mode is not None:
            self.guard = StepGuard(
                self.opt, self.model, max_norm=1.0, skip_mode=mode, spike_k=SPIKE_K
            )

    def update(self, loss: torch.Tensor) -> None:
        if self.guard is not None:
            self.guard.step(loss)
        else:
            nn.utils.clip_grad_norm_(self.params, 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def step(self, x: torch.Tensor) -> tuple[float, float]:
        """One train step; (step seconds, update seconds) in process CPU time."""
        t0 = time.process_time()
        loss = self.model(x).square().mean()
        loss.backward()
        t1 = time.process_time()
        self.update(loss.detach())
        t2 = time.process_time()
        return t2 - t0, t2 - t1

    def loss(self, x: torch.Tensor) -> float:
        with torch.no_grad():
            return float(self.model(x).square().mean())

    def skipped(self) -> int:
        return int(self.guard.summary()["skipped"]) if self.guard is not None else 0


def bench(d: int, opt_kind: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    device_mode = "found_inf" if opt_kind == "fused" else "select"
    variants = [Variant(d, 2, opt_kind, m) for m in (None, "auto", device_mode)]
    x = torch.randn(*args.batch, d, generator=torch.Generator().manual_seed(1))
    start = variants[0].loss(x)
    for v in variants:  # warm up: allocator, optimizer state, the guard's buffers
        v.step(x), v.step(x)
    steps: dict[str, list[float]] = {v.mode: [] for v in variants}
    updates: dict[str, list[float]] = {v.mode: [] for v in variants}
    stopper = Stopper(lambda: paired_ratios(steps, "plain", speed=False),
                      min_rounds=args.min_rounds, max_rounds=args.rounds)  # fmt: skip
    r = 0
    while not stopper(r):
        for v in variants[r % 3 :] + variants[: r % 3]:
            t, u = v.step(x)
            steps[v.mode].append(t)
            updates[v.mode].append(u)
        r += 1
    ratios = paired_ratios(steps, "plain", speed=False)
    losses = [v.loss(x) for v in variants]
    n_params = sum(p.numel() for p in variants[0].params)
    out = []
    for v in variants[1:]:
        mode = v.guard.skip_mode  # type: ignore[union-attr]
        out.append({
            "d_model": d, "params": n_params, "optimizer": f"AdamW {opt_kind}",
            "skip_mode": f"auto ({mode})" if v.mode == "auto" else mode,
            "plain_step_ms": 1e3 * statistics.median(steps["plain"]),
            "guarded_step_ms": 1e3 * statistics.median(steps[v.mode]),
            "plain_update_ms": 1e3 * statistics.median(updates["plain"]),
            "guarded_update_ms": 1e3 * statistics.median(updates[v.mode]),
            "ratio": summarize(ratios[v.mode]), "stopping": stopper.record(r),
            "skipped": v.skipped(), "loss_start": start, "loss_plain": losses[0],
            "loss_guarded": losses[variants.index(v)],
        })  # fmt: skip
    return out


def bench_update(d: int, opt_kind: str, reps: int, batch: tuple[int, int]) -> dict[str, Any]:
    """The update phase alone, with the same gradients every time: less noise than full steps."""
    device_mode = "found_inf" if opt_kind == "fused" else "select"
    variants = [Variant(d, 2, opt_kind, m) for m in (None, "auto", device_mode)]
    x = torch.randn(*batch, d, generator=torch.Generator().manual_seed(1))
    variants[0].model(x).square().mean().backward()
    grads = [p.grad.clone() for p in variants[0].params]  # type: ignore[union-attr]
    times: dict[str, list[float]] = {v.mode: [] for v in variants}
    for r in range(reps + 2):
        for v in variants[r % 3 :] + variants[: r % 3]:
            for p, g in zip(v.params, grads, strict=True):
                p.grad = g.clone()
            t0 = time.process_time()
            v.update(torch.tensor(1.0))
            if r >= 2:  # the first two rounds warm up
                times[v.mode].append(1e3 * (time.process_time() - t0))
    extra = paired_diffs(times, "plain")
    return {"d_model": d, "optimizer": f"AdamW {opt_kind}", "reps": reps,
            "update_ms": {m: statistics.median(t) for m, t in times.items()},
            "extra_ms": {m: summarize(e) for m, e in extra.items()},
            "device_mode": device_mode}  # fmt: skip


def markdown(res: dict[str, Any]) -> str:
    m = res["meta"]
    lines = [
        "# StepGuard overhead in a full training step",
        "",
        f"Command: `{m['command']}`  ",
        f"Machine: {machine_line(m)}  ",
        "Full step = forward + backward + update; plain = the tuned update (parameter list "
        "kept, clip_grad_norm_, step, zero_grad(set_to_none=True)). Ratio: median of per-round "
        "guarded/plain step times (one-step rounds, order rotating) with its 95% interval. "
        "Clock: process CPU time.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for r in res["results"]:
        lines.append(
            f"| {r['d_model']} | {r['params'] / 1e6:.2f}M | {r['optimizer']} | {r['skip_mode']} "
            f"| {r['plain_step_ms']:.1f} | {r['guarded_step_ms']:.1f} | {fmt_ci(r['ratio'])} "
            f"| +-{100 * half_width(r['ratio']):.1f}% "
            f"| {r['plain_update_ms']:.2f} -> {r['guarded_update_ms']:.2f} |"
        )
    stops = {r["stopping"]["reason"] for r in res["results"]}
    lines += ["", f"Rounds: {'; '.join(sorted(stops))}.", ""]
    lines += [
        "Update phase alone (same gradients each time; extra ms over plain, paired [95% CI]):",
        "",
        "| d_model | optimizer | plain ms | guarded auto, extra ms | device path | extra ms |",
        "|---|---|---|---|---|---|",
    ]
    for u in res["update_only"]:
        dm = u["device_mode"]
        lines.append(
            f"| {u['d_model']} | {u['optimizer']} | {u['update_ms']['plain']:.2f} "
            f"| {fmt_ci(u['extra_ms']['auto'])} | {dm} | {fmt_ci(u['extra_ms'][dm])} |"
        )
    return "\n".join([*lines, "", *checks_md(res["checks"])])


def checks(results: list[dict[str, Any]]) -> dict[str, Any]:
    skips = {f"d{r['d_model']} {r['optimizer']} {r['skip_mode']}": r["skipped"] for r in results}
    worst = max(abs(r["loss_guarded"] - r["loss_plain"]) / r["loss_plain"] for r in results)
    moved = all(r["loss_plain"] != r["loss_start"] for r in results)
    return {
        "no skipped steps": check(not any(skips.values()), f"skipped: {skips}"),
        "equal losses": check(
            worst <= 1e-3 and moved,
            f"largest relative difference guarded vs plain after the rounds: {worst:.1e} "
            f"(tolerance 1e-3); the plain model trained: {moved}",
        ),
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--rounds", type=int, default=400, help="the most rounds per configuration")
    p.add_argument("--min-rounds", type=int, default=40)
    p.add_argument("--update-reps", type=int, default=100)
    args = p.parse_args(argv)
    args.sizes, args.batch = (128, 384), (4, 64)
    if args.quick:
        args.rounds = args.min_rounds = 3
        args.update_reps, args.sizes, args.batch = 4, (64,), (2, 16)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = out_dir(args)
    load_before = os.getloadavg()[0]
    results, updates = [], []
    with torch_threads(args.threads):
        for d in args.sizes:
            for opt_kind in ("for-loop", "fused"):
                results += bench(d, opt_kind, args)
                updates.append(bench_update(d, opt_kind, args.update_reps, args.batch))
        meta = run_meta("bench_guard.py", argv, load_before)
    res = {
        "meta": meta,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "results": results,
        "update_only": updates,
        "checks": checks(results),
    }
    return write_results(out, "guard", res, markdown(res))


if __name__ == "__main__":
    steady_malloc()
    raise SystemExit(main())
