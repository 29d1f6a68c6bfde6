"""The trainer benchmarks on one CUDA GPU, in under 8 minutes: throughput, overhead, precision,
compile, activation-checkpointing memory, MFU.

Sections (each writes benchmarks/results/gpu_<section>.{md,json}):

    trainer        tokens/s of plain / isotrain / Fabric / Accelerate, `small` preset, bf16 autocast
    overhead       per-step ms and overhead vs plain on a 1-layer d 16 GPT (launch-bound), fp32
    precision      plain and isotrain in fp32, bf16 autocast, fp16 + GradScaler (the trainer's
                   --precision option; the plain loop uses torch.amp.GradScaler the usual way)
    compile        eager vs per-block torch.compile (inductor), plain and isotrain, bf16
    checkpointing  peak torch.cuda.max_memory_allocated of one step and step time for the
                   policies none / full / selective (isotrain's --checkpointing.policy)
    mfu            measured bf16 / fp32 matmul peak and the MFU of plain and isotrain, bf16 / fp32

Variants and statistics come from bench_trainer.py (rounds interleaved, order rotating, paired
ratios to the plain loop; wall time after torch.cuda.synchronize).

    python benchmarks/gpu_suite.py              # on a machine with CUDA
    python benchmarks/gpu_suite.py --dry-run    # tiny versions on the CPU: every code path runs
    python benchmarks/gpu_suite.py --only trainer,mfu

Without a CUDA device (and without --dry-run) it exits with a message saying so.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench_mfu import best_of, matmul_rates, step_flops
from bench_trainer import table as throughput_table
from bench_trainer import throughput as throughput_rows
from common import QUICK_ROOT, RESULTS, command_line, machine, machine_line, write_results
from isotrain.train.config import TrainConfig
from loops import (
    PROBE,
    SMALL,
    VARIANTS,
    Isotrain,
    Plain,
    Shape,
    Variant,
    interleave,
    train_config,
)
from loops import build as build_variants
from stats import fmt_ci, paired_diffs, paired_ratios, summarize

SECTIONS = ("trainer", "overhead", "precision", "compile", "checkpointing", "mfu")
NO_CUDA = (
    "gpu_suite.py needs a CUDA device, and torch.cuda.is_available() is False here "
    "(torch {torch}). Run it on a machine with an NVIDIA GPU and a CUDA build of torch, or "
    "pass --dry-run to run tiny versions of every section on the CPU."
)


@dataclasses.dataclass
class Plan:
    """Sizes for one run: the real GPU suite or the CPU dry run."""

    device: str
    shape: Shape  # trainer, precision, compile, checkpointing, mfu
    probe: Shape  # overhead
    rounds: int
    steps: int
    warmup: int
    probe_rounds: int
    probe_steps: int
    backend: str  # torch.compile backend
    peak_sizes: tuple[int, ...]


def plan(args: argparse.Namespace) -> Plan:
    if args.dry_run:
        tiny = Shape(n_layer=2, n_head=2, d_model=32, block_size=32, batch_size=2)
        return Plan("cpu", tiny, PROBE, 2, 2, 1, 2, 3, "eager", (64,))
    return Plan(
        "cuda", SMALL, PROBE, args.rounds, args.steps, 2, 30, 20, args.backend, (4096, 8192)
    )


class PlainCompiled(Plain):
    """The plain loop with each transformer block compiled in place (as isotrain does)."""

    name = "plain+compile"

    def __init__(self, cfg: TrainConfig, corpus: Any) -> None:
        super().__init__(cfg, corpus)
        for block in self.model.blocks:  # type: ignore[union-attr]
            block.compile(backend=cfg.compile.backend)


def timed_section(
    title: str,
    specs: dict[str, tuple[type[Variant], TrainConfig]],
    p: Plan,
    shape: Shape,
    *,
    rounds: int,
    steps: int,
    base: str = "plain",
) -> dict[str, Any]:
    """Interleave `specs`, then tokens/s, ms/step and paired ratios to `base` (wall clock)."""
    variants = build_variants(specs)
    timing = interleave(variants, rounds=rounds, steps=steps, warmup=p.warmup)
    if base != "plain":  # throughput() pairs against "plain": rename the base for it
        timing = {
            c: {("plain" if n == base else n): t for n, t in d.items()} for c, d in timing.items()
        }
    res = throughput_rows(timing["wall"], timing["wall"], shape.tokens, steps=steps)
    if base != "plain":
        res = {(base if n == "plain" else n): r for n, r in res.items()}
    for name, v in variants.items():
        if isinstance(v, Isotrain):
            res[name]["skipped"] = v.skipped()
    return {
        "title": title,
        "shape": shape.label(),
        "rounds": rounds,
        "steps": steps,
        "variants": res,
    }


# ------------------------------------------------------------------------------------ sections
def sec_trainer(p: Plan) -> dict[str, Any]:
    cfg = train_config(p.shape, device=p.device, precision="bf16")
    names = ("plain", "nanogpt", "isotrain", "fabric", "accelerate")
    specs = {n: (VARIANTS[n], cfg) for n in names}
    return timed_section(
        "Throughput, bf16 autocast",
        specs,
        p,
        p.shape,
        rounds=p.rounds,
        steps=p.steps,
    )


def sec_overhead(p: Plan) -> dict[str, Any]:
    cfg = train_config(p.probe, device=p.device)
    names = ("plain", "nanogpt", "isotrain", "isotrain-noguard", "fabric", "accelerate")
    specs = {n: (VARIANTS[n], cfg) for n in names}
    res = timed_section(
        "Per-step overhead (launch-bound model), fp32",
        specs,
        p,
        p.probe,
        rounds=p.probe_rounds,
        steps=p.probe_steps,
    )
    per_round = {n: r["seconds_per_round"] for n, r in res["variants"].items()}
    for n, extra in paired_diffs(per_round, "plain", scale=1e3 / p.probe_steps).items():
        res["variants"][n]["overhead_ms"] = summarize(extra)
    return res


def sec_precision(p: Plan) -> dict[str, Any]:
    specs = {}
    for prec in ("fp32", "bf16", "fp16"):
        cfg = train_config(p.shape, device=p.device, precision=prec)
        specs[f"plain {prec}"] = (Plain, cfg)
        specs[f"isotrain {prec}"] = (Isotrain, cfg)
    return timed_section(
        "Precision: fp32, bf16 autocast, fp16 autocast + GradScaler",
        specs,
        p,
        p.shape,
        rounds=p.rounds,
        steps=p.steps,
        base="plain fp32",
    )


def sec_compile(p: Plan) -> dict[str, Any]:
    eager = train_config(p.shape, device=p.device, precision="bf16")
    comp = train_config(p.shape, device=p.device, precision="bf16", compile_backend=p.backend)
    specs = {
        "plain": (Plain, eager),
        "plain+compile": (PlainCompiled, comp),
        "isotrain": (Isotrain, eager),
        "isotrain+compile": (Isotrain, comp),
    }
    t0 = time.perf_counter()
    res = timed_section(
        f"Per-block torch.compile ({p.backend}), bf16 autocast",
        specs,
        p,
        p.shape,
        rounds=p.rounds,
        steps=p.steps,
    )
    res["wall_seconds_incl_compile"] = time.perf_counter() - t0
    return res


def peak_step_memory(v: Variant) -> dict[str, float | None]:
    """Peak bytes allocated during one step, absolute and above the memory held before it."""
    if v.device.type != "cuda":
        v.step()
        return {"peak_mib": None, "step_extra_mib": None}  # no allocator statistics on the CPU
    torch.cuda.synchronize(v.device)
    before = torch.cuda.memory_allocated(v.device)
    torch.cuda.reset_peak_memory_stats(v.device)
    v.step()
    torch.cuda.synchronize(v.device)
    peak = torch.cuda.max_memory_allocated(v.device)
    return {"peak_mib": peak / 2**20, "step_extra_mib": (peak - before) / 2**20}


def sec_checkpointing(p: Plan) -> dict[str, Any]:
    policies = ("none", "full", "selective")
    specs = {}
    for pol in policies:
        cfg = train_config(p.shape, device=p.device, precision="bf16", checkpointing=pol)
        specs[pol] = (Isotrain, cfg)
    variants = build_variants(specs)
    memory = {}
    for name, v in variants.items():  # one at a time: each peak is its own step's
        v.step()
        memory[name] = peak_step_memory(v)
    timing = interleave(variants, rounds=p.rounds, steps=p.steps, warmup=p.warmup)
    ratios = paired_ratios(timing["wall"], "none", speed=False)
    rows = {}
    for name, secs in timing["wall"].items():
        rows[name] = {
            **memory[name],
            "ms_per_step": 1e3 * statistics.median(secs) / p.steps,
            "time_ratio_to_none": summarize(ratios[name]) if name in ratios else None,
        }
    title = "Activation checkpointing (isotrain), bf16 autocast"
    return {
        "title": title,
        "shape": p.shape.label(),
        "rounds": p.rounds,
        "steps": p.steps,
        "policies": rows,
    }


def sec_mfu(p: Plan) -> dict[str, Any]:
    """MFU of each precision against the device's best matmul rate in any of them."""
    sizes = [(n, n, n) for n in p.peak_sizes]
    rates = {
        prec: matmul_rates(prec, sizes, reps=5, clock_name="wall", budget=2.0, device=p.device)
        for prec in ("bf16", "fp32")
    }
    core = best_of([r for rs in rates.values() for r in rs])
    runs = []
    for prec in ("bf16", "fp32"):
        cfg = train_config(p.shape, device=p.device, precision=prec)
        variants = build_variants({"plain": (Plain, cfg), "isotrain": (Isotrain, cfg)})
        flops = {n: step_flops(v) for n, v in variants.items()}
        timing = interleave(variants, rounds=p.rounds, steps=p.steps, warmup=p.warmup)
        own = best_of(rates[prec])
        row = {"precision": prec, "peak_tflops": core["gflops"] / 1e3, "peak": core,
               "dtype_peak_tflops": own["gflops"] / 1e3}  # fmt: skip
        for name, secs in timing["wall"].items():
            per_round = [flops[name] * p.steps / s / 1e12 / row["peak_tflops"] for s in secs]
            row[name] = {
                "gflop_per_step": flops[name] / 1e9,
                "mfu": summarize(per_round),
                "ms_per_step": 1e3 * statistics.median(secs) / p.steps,
            }
        runs.append(row)
    return {"title": "Model FLOPs utilisation", "shape": p.shape.label(), "runs": runs}


# -------------------------------------------------------------------------------- markdown
def md_section(name: str, res: dict[str, Any], meta: dict[str, Any]) -> str:
    rounds = "."
    if "rounds" in res:
        rounds = f"; {res['rounds']} interleaved rounds of {res['steps']} steps."
    head = [
        f"# GPU suite: {res['title']}",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {machine_line(meta)}  ",
        f"Model: GPT, {res['shape']}; fused AdamW; wall time after torch.cuda.synchronize" + rounds,
        "",
    ]
    if name == "checkpointing":
        body = [
            "| policy | peak MiB in the step (all three models resident) | MiB above the "
            "pre-step level (activations + grads) | ms/step | time vs none |",
            "|---|---|---|---|---|",
        ]
        for pol, r in res["policies"].items():
            mib = "n/a (CPU)" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
            extra = "n/a" if r["step_extra_mib"] is None else f"{r['step_extra_mib']:.0f}"
            ratio = fmt_ci(r["time_ratio_to_none"]) if r["time_ratio_to_none"] else "1"
            body.append(f"| {pol} | {mib} | {extra} | {r['ms_per_step']:.2f} | {ratio} |")
    elif name == "mfu":
        peak = res["runs"][0]["peak"]
        body = [
            f"MFU denominator: the best matmul rate measured here in any dtype, "
            f"{peak['gflops'] / 1e3:.3g} TFLOP/s ({peak['dtype']} {peak['op']}, {peak['n']}).",
            "",
            "| precision | this dtype's matmul peak TFLOP/s | variant | GFLOP/step | ms/step "
            "| MFU % of the device peak [95% CI] |",
            "|---|---|---|---|---|---|",
        ]
        for r in res["runs"]:
            for v in ("plain", "isotrain"):
                body.append(
                    f"| {r['precision']} | {r['dtype_peak_tflops']:.3g} | {v} "
                    f"| {r[v]['gflop_per_step']:.3g} | {r[v]['ms_per_step']:.2f} "
                    f"| {fmt_ci(r[v]['mfu'], 1, scale=100)} |"
                )
    else:
        body = throughput_table(res["variants"])
        if name == "overhead":
            body += ["", "| variant | overhead vs plain, ms/step [IQR; 95% CI] |", "|---|---|"]
            rows = [(n, r) for n, r in res["variants"].items() if n != "plain"]
            body += [f"| {n} | {fmt_ci(r['overhead_ms'])} |" for n, r in rows]
    return "\n".join(head + body) + "\n"


# ------------------------------------------------------------------------------------- main
RUNNERS: dict[str, Callable[[Plan], dict[str, Any]]] = {
    "trainer": sec_trainer,
    "overhead": sec_overhead,
    "precision": sec_precision,
    "compile": sec_compile,
    "checkpointing": sec_checkpointing,
    "mfu": sec_mfu,
}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny versions on the CPU")
    ap.add_argument("--quick", action="store_true", help="fewer rounds (on CUDA)")
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument(
        "--out", type=Path, default=None, help="default: results/cuda-<gpu>/ (dry run: temp dir)"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 3, 5
    bad = [s for s in args.only.split(",") if s not in SECTIONS]
    if bad:
        ap.error(f"--only: unknown section(s) {bad}; choose from {', '.join(SECTIONS)}")
    return args


def gpu_kind() -> str:
    """results/ directory name of this GPU: "cuda-" and its name in lower case, dashed."""
    name = torch.cuda.get_device_name().lower()
    return "cuda-" + "-".join("".join(c if c.isalnum() else " " for c in name).split())


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print(NO_CUDA.format(torch=torch.__version__), file=sys.stderr)
        return 2
    p = plan(args)
    out = args.out or (QUICK_ROOT / "gpu-dry-run" if args.dry_run else RESULTS / gpu_kind())
    if p.device == "cpu":
        torch.set_num_threads(1)  # tiny models: more threads only add contention
    else:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (the CPU runs agree)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "ind"))
    t_start = time.perf_counter()
    for name in args.only.split(","):
        t0 = time.perf_counter()
        load = os.getloadavg()[0]
        res = RUNNERS[name](p)
        meta = machine(p.device)
        meta.update(
            load_before=round(load, 2),
            load_after=meta.pop("load_avg_1m"),
            command=command_line("gpu_suite.py", argv),
            seconds=time.perf_counter() - t0,
        )
        res["meta"] = meta
        stem = f"gpu_{name}" + ("_dry_run" if args.dry_run else "")
        write_results(out, stem, res, md_section(name, res, meta))
        print(f"[{name}] {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"gpu suite: {time.perf_counter() - t_start:.1f} s in all, results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
