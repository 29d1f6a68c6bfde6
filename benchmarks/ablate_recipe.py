"""The speedrun recipe's ablation: each NanoGPT-speedrun change alone on the tiny preset, and
each taken back from the whole recipe.

Runs `isotrain train` once per (variant, seed) as its own process, each variant the tiny preset
plus one change, the whole recipe (`--preset speedrun`), or the recipe with one change taken
back or its learning rate halved or doubled, all for the same number of steps with the cosine
schedule over them. Records the exact validation loss at the end (the trainer's own
evaluation covers every window of the default corpus's split), the process CPU and wall
seconds (the child's own rusage: CPU is robust to load), and, measured apart in this process,
each variant's CPU seconds per training step (`--time-steps` steps of `train_step`, one torch
thread, after 3 warm-up steps). Every run is appended to recipe_runs.jsonl as it ends, so
several invocations (other steps, seeds, variants) build one table: recipe_ablation.{md,json}.

    python benchmarks/ablate_recipe.py --steps 400 --seeds 2 --jobs 2
    python benchmarks/ablate_recipe.py --quick     # a smoke run: 2 variants, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from common import add_common_args, check, checks_md, machine_line, out_dir, run_meta, write_results
from isotrain.train.cli.main import parse_train_args
from isotrain.train.loop import setup
from isotrain.train.rundir.metrics import read_metrics
from isotrain.train.step import train_step

# variant -> the flags it adds to the tiny preset (one change each, then the whole recipe)
VARIANTS: dict[str, list[str]] = {
    "baseline (nanoGPT's recipe)": [],
    "Muon on hidden matrices": ["--optim.name", "muon"],
    "rotary positions": ["--model.positions", "rotary"],
    "QK-norm": ["--model.qk-norm"],
    "ReLU squared MLP": ["--model.activation", "relu2"],
    "untied head": ["--model.no-tie-head"],
    "zero-init projections": ["--model.zero-init"],
    "the recipe (--preset speedrun: Muon, rotary, QK-norm, ReLU squared)": ["--preset", "speedrun"],
    "no biases": ["--model.no-bias"],
}
RECIPE = "the recipe (--preset speedrun: Muon, rotary, QK-norm, ReLU squared)"
# the whole recipe with one change taken back (what each is worth inside it) or the speedrun's
# two it leaves out put in, and its learning rate (--optim.lr serves Muon and AdamW) halved
# and doubled
WITHOUT: dict[str, list[str]] = {
    "recipe without Muon (AdamW)": ["--optim.name", "adamw"],
    "recipe without rotary (learned positions)": ["--model.positions", "learned"],
    "recipe without QK-norm": ["--model.no-qk-norm"],
    "recipe without ReLU squared (GELU)": ["--model.activation", "gelu"],
    "recipe with zero-init projections": ["--model.zero-init"],
    "recipe with an untied head": ["--model.no-tie-head"],
    "recipe with zero-init and an untied head (the speedrun's)": [
        "--model.zero-init",
        "--model.no-tie-head",
    ],
    "recipe at lr 0.002": ["--optim.lr", "0.002"],
    "recipe at lr 0.008": ["--optim.lr", "0.008"],
}
VARIANTS |= {name: [*VARIANTS[RECIPE], *change] for name, change in WITHOUT.items()}
QUICK_FLAGS = ["--model.n-layer", "2", "--model.d-model", "32", "--model.n-head", "2",
               "--model.block-size", "32", "--data.batch-size", "4", "--data.max-bytes", "200000",
               "--eval-batches", "8"]  # fmt: skip


def flags(variant: list[str], steps: int, seed: int, out: Path, quick: bool) -> list[str]:
    """The run's command line: the tiny preset (or the variant's), the variant, fp32."""
    preset = [] if "--preset" in variant else ["--preset", "tiny"]
    return [
        *preset, *variant, "--steps", str(steps), "--eval-every", str(steps), "--seed", str(seed),
        "--precision", "fp32", "--sample-tokens", "0", "--log-every", "10" if not quick else "2",
        "--out-dir", str(out), "--no-progress", "--doctor.every", "0",
        *(QUICK_FLAGS if quick else []),
    ]  # fmt: skip


def run_one(name: str, seed: int, steps: int, work: Path, quick: bool) -> dict[str, Any]:
    """One training process: its exact val loss, CPU and wall seconds, ms per step."""
    out = work / f"{abs(hash(name)) % 10**8}-{seed}"
    cmd = [sys.executable, "-m", "isotrain", "train"]
    cmd += flags(VARIANTS[name], steps, seed, out, quick)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    load, t0 = os.getloadavg()[0], time.perf_counter()
    with (work / f"{out.name}.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if status:
        raise SystemExit(f"{' '.join(cmd)} failed; see {work / out.name}.log")
    records = read_metrics(out)
    summary = next(r for r in records if r["kind"] == "summary")
    train = [r for r in records if r["kind"] == "train" and r["step"] > 10]
    tokens = next(r for r in records if r["kind"] == "config")["config"]["data"]["batch_size"]
    tokens *= next(r for r in records if r["kind"] == "config")["config"]["model"]["block_size"]
    ms = statistics.median(1e3 * tokens / r["tokens_per_s"] for r in train) if train else 0.0
    print(f"{name} seed {seed}: val {summary['val_loss']:.4f}, {usage.ru_utime:.0f} CPU s")
    return {
        "variant": name, "seed": seed, "val": summary["val_loss"], "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime, "train_s": summary["train_seconds"],
        "ms_per_step": ms, "skipped": summary.get("skipped_steps", 0), "load_1m": round(load, 2),
    }  # fmt: skip


def cpu_per_step(name: str, steps: int, quick: bool) -> float:
    """CPU seconds per `train_step` of the variant, in this process (one thread), 3 warm-up."""
    with tempfile.TemporaryDirectory(prefix="recipe-time-") as tmp:
        cfg = parse_train_args(flags(VARIANTS[name], 1000, 1337, Path(tmp), quick))
        cfg = dataclasses.replace(cfg, doctor=dataclasses.replace(cfg.doctor, every=0))
        run = setup(cfg)
        for _ in range(3):
            train_step(run)
        t0 = time.process_time()
        for _ in range(steps):
            train_step(run)
        return (time.process_time() - t0) / steps


def table(runs: list[dict[str, Any]], cost: dict[str, float], *, taken_back: bool) -> list[str]:
    """One row per (variant, steps): val (mean, each seed), its change from the reference at
    the same steps (the baseline for a change alone; with `taken_back`, the whole recipe for
    one change taken back), CPU s per step and its ratio to the reference's."""
    first = RECIPE if taken_back else next(iter(VARIANTS))
    names = [RECIPE, *WITHOUT] if taken_back else [n for n in VARIANTS if n not in WITHOUT]
    head = (
        "the recipe, one change taken back" if taken_back else "change (alone, on the tiny preset)"
    )
    ref = "recipe" if taken_back else "baseline"
    lines = [
        f"| {head} | steps | val (mean; each seed) | vs {ref} | CPU s/step | CPU vs {ref} "
        "| process CPU s (mean) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    steps_run = {r["steps"] for r in runs if not taken_back or r["variant"] in WITHOUT}
    if not steps_run:
        return []
    for steps in sorted(steps_run):
        base = [r["val"] for r in runs if r["variant"] == first and r["steps"] == steps]
        for name in names:
            rs = [r for r in runs if r["variant"] == name and r["steps"] == steps]
            if not rs:
                continue
            val = statistics.fmean(r["val"] for r in rs)
            delta = f"{val - statistics.fmean(base):+.4f}" if base else "-"
            each = ", ".join(f"{r['val']:.4f}" for r in rs)
            c = cost.get(name)
            per = f"{c:.3f} | {c / cost[first]:.3f}" if c and first in cost else "- | -"
            cpu = statistics.fmean(r["cpu_s"] for r in rs)
            lines.append(f"| {name} | {steps} | {val:.4f} ({each}) | {delta} | {per} | {cpu:.0f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--steps", type=int, default=None, help="steps per run (500; quick 6)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per variant (2; quick 1)")
    p.add_argument("--jobs", type=int, default=1, help="processes at once (one thread each)")
    p.add_argument("--only", nargs="*", default=None, help="variants to run (default: all)")
    p.add_argument(
        "--time-steps",
        type=int,
        default=None,
        help="steps timed per variant (20; 0: keep the stored times)",
    )
    p.add_argument("--no-train", action="store_true", help="time the variants only")
    args = p.parse_args(argv)
    steps = args.steps or (6 if args.quick else 500)
    seeds = [1337 + i for i in range(args.seeds or (1 if args.quick else 2))]
    names = args.only or (list(VARIANTS)[:2] if args.quick else list(VARIANTS))
    out, load_before = out_dir(args), os.getloadavg()[0]
    log, costs = out / "recipe_runs.jsonl", out / "recipe_cost.json"
    if args.quick:  # a smoke run starts its own table
        log.unlink(missing_ok=True), costs.unlink(missing_ok=True)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    jobs = [] if args.no_train else [(n, s) for s in seeds for n in names]

    def one(job: tuple[str, int]) -> dict[str, Any]:
        r = run_one(*job, steps, Path(tmp), args.quick) | {"steps": steps, "command": command}
        with log.open("a") as f:
            f.write(json.dumps(r) + "\n")
        return r

    with tempfile.TemporaryDirectory(prefix="recipe-") as tmp, ThreadPoolExecutor(args.jobs) as ex:
        done = list(ex.map(one, jobs))
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n_timed = (2 if args.quick else 20) if args.time_steps is None else args.time_steps
        timed = {n: cpu_per_step(n, n_timed, args.quick) for n in names if n_timed}
    finally:
        torch.set_num_threads(old)
    runs = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    cost = {**(json.loads(costs.read_text()) if costs.exists() else {}), **timed}
    costs.write_text(json.dumps(cost, indent=2) + "\n")
    meta = run_meta("ablate_recipe.py", argv, load_before)
    checks = {
        "finished every run": check(len(done) == len(jobs), f"{len(done)} of {len(jobs)}"),
        "no run skipped more than 1% of its steps": check(
            all(r["skipped"] <= 0.01 * r["steps"] for r in runs),
            f"skips {[r['skipped'] for r in runs]}",
        ),
    }
    md = [
        "# The speedrun recipe, one change at a time",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {machine_line(meta)}  ",
        "Each run: `isotrain train --preset tiny` plus the change (or `--preset speedrun` less "
        "one change, in the second table), for its steps (cosine over them), fp32, one torch "
        "thread, its own process. Val: the trainer's exact loss over every validation window "
        "(nats/byte), deterministic given the seed. CPU s/step: "
        "`train_step` timed in one process with one thread (process CPU time, robust to load); "
        "process CPU s: a whole run's, start-up and its one evaluation included.",
        "",
        *table(runs, cost, taken_back=False),
        *(["", *back] if (back := table(runs, cost, taken_back=True)) else []),
        "",
        "| variant | steps | seed | val | process CPU s | wall s | ms/step | skipped | load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {r['variant']} | {r['steps']} | {r['seed']} | {r['val']:.4f} | {r['cpu_s']:.0f} "
            f"| {'-' if r['wall_s'] is None else round(r['wall_s'])} | {r['ms_per_step']:.0f} "
            f"| {r['skipped']} | {r['load_1m']} |"
            for r in runs
        ),
        "",
        "Commands that produced the runs: "
        + "; ".join(sorted({f"`python benchmarks/ablate_recipe.py {r['command']}`" for r in runs})),
        "",
    ]
    payload = {"meta": meta, "runs": runs, "cpu_per_step": cost, "checks": checks}
    return write_results(out, "recipe_ablation", payload, "\n".join([*md, *checks_md(checks)]))


if __name__ == "__main__":
    raise SystemExit(main())
