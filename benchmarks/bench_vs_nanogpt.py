"""isotrain's trainer against nanoGPT's own train.py: same bytes, same recipe, whole processes.

Writes isotrain's default corpus as nanoGPT's data/<dataset>/train.bin and val.bin (uint16,
with meta.pkl: vocab 256), then runs `python train.py CONFIG` (a copy of the checkout with its
seed line patched, configured through its configurator) and `python -m isotrain train`, one
after the other in rounds whose order alternates, one seed per round. Both final models are
scored by one evaluator (this script, isotrain's GPT; nanoGPT's ckpt.pt mapped through GPT-2's
layout) on every non-overlapping window of the validation split: the exact loss of the split,
no sampled windows. Step times come from each run's own log, in the same blocks of steps, with
evaluation excluded on both sides. Ratios isotrain / nanoGPT carry 95% t intervals: step time
paired by round, validation loss Welch's over seeds. Writes vs_nanogpt.{md,json}.

`--recipe speedrun` trains isotrain's side with `--preset speedrun` (docs/benchmarks.md) for its
own, fewer steps (`--recipe-steps`, default the preset's) and reports the time to nanoGPT's
validation loss: isotrain's whole training time (its steps x its ms per step) over nanoGPT's
(1000 x its ms per step), paired by round, with isotrain's final loss against nanoGPT's.
Writes vs_nanogpt_speedrun.{md,json}.

    python benchmarks/bench_vs_nanogpt.py --nanogpt ~/src/nanoGPT     # 3 seeds x 1000 steps
    python benchmarks/bench_vs_nanogpt.py --nanogpt ~/src/nanoGPT --recipe speedrun
    python benchmarks/bench_vs_nanogpt.py --quick     # the stand-in of nanogpt_standin/, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pickle
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import isotrain
from common import (
    HERE,
    add_common_args,
    check,
    checks_md,
    machine_line,
    out_dir,
    run_meta,
    steady_malloc,
    write_results,
)
from isotrain.train.config import PRESETS
from isotrain.train.data.batches import load_corpus
from isotrain.train.model.gpt import GPT, GPTConfig
from isotrain.train.model.hf import from_gpt2_state
from isotrain.train.rundir.metrics import read_metrics
from isotrain.train.weights.load import load_model

STANDIN = HERE / "nanogpt_standin"
SEED_LINE = "torch.manual_seed(1337 + seed_offset)"
LINEAR = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
ITER = re.compile(r"^iter (\d+): loss \S+, time ([\d.]+)ms", re.M)
EVAL = re.compile(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)", re.M)
COLUMNS = ["", "nanoGPT train.py", "isotrain train", "isotrain / nanoGPT [95% CI]"]


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """The one recipe both trainers are given (nanoGPT's names in comments)."""

    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128  # n_embd
    block_size: int = 128
    batch_size: int = 16
    steps: int = 1000  # max_iters, lr_decay_iters
    lr: float = 4e-3  # learning_rate
    min_lr: float = 2e-4
    warmup_steps: int = 50  # warmup_iters
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    max_bytes: int = 4_000_000  # isotrain's default corpus budget
    log_every: int = 10  # isotrain's metrics cadence: the blocks step times are compared in
    own_eval_iters: int = 200  # nanoGPT's eval_iters at its final evaluation
    agree: float = 0.05  # nats: a run's own (sampled) evaluation against the exact one
    preset: str = "tiny"  # isotrain's side: nanoGPT's recipe, or "speedrun" (docs/benchmarks.md)
    iso_steps: int | None = None  # isotrain's steps when they differ from nanoGPT's


QUICK = Recipe(
    n_layer=2, n_head=2, d_model=32, block_size=32, batch_size=4, steps=20, warmup_steps=2,
    max_bytes=200_000, log_every=5, own_eval_iters=10, agree=0.15,
)  # fmt: skip


# ------------------------------------------------------------------------------ the data
def write_data(folder: Path, recipe: Recipe) -> dict[str, Any]:
    """isotrain's default corpus as nanoGPT's train.bin / val.bin (uint16) and meta.pkl."""
    corpus = load_corpus(None, max_bytes=recipe.max_bytes, val_fraction=0.1)
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        np.asarray(getattr(corpus, split), dtype=np.uint16).tofile(folder / f"{split}.bin")
    with (folder / "meta.pkl").open("wb") as f:
        pickle.dump({"vocab_size": corpus.vocab_size}, f)
    return {"source": corpus.source, "train_tokens": len(corpus.train), "val": corpus.val}


# ------------------------------------------------------------------------------ nanoGPT
def nanogpt_config(recipe: Recipe, out: Path, data: Path) -> str:
    """A config file for nanoGPT's configurator: the recipe, fp32 on the CPU, no compile."""
    r = recipe
    values = {
        "out_dir": str(out), "dataset": str(data),  # an absolute path: os.path.join keeps it
        "eval_interval": r.steps, "eval_iters": r.own_eval_iters, "log_interval": 1,
        "always_save_checkpoint": True, "gradient_accumulation_steps": 1,
        "batch_size": r.batch_size, "block_size": r.block_size, "n_layer": r.n_layer,
        "n_head": r.n_head, "n_embd": r.d_model, "dropout": 0.0, "bias": True,
        "learning_rate": r.lr, "max_iters": r.steps, "weight_decay": r.weight_decay,
        "beta1": r.beta1, "beta2": r.beta2, "grad_clip": r.grad_clip, "decay_lr": True,
        "warmup_iters": r.warmup_steps, "lr_decay_iters": r.steps, "min_lr": r.min_lr,
        "device": "cpu", "dtype": "float32", "compile": False, "wandb_log": False,
    }  # fmt: skip
    return "".join(f"{k} = {v!r}\n" for k, v in values.items())


def patched_copy(checkout: Path, dest: Path, seed: int) -> Path:
    """The checkout's top-level .py files in `dest`, train.py seeded with `seed`."""
    dest.mkdir(parents=True)
    for f in checkout.glob("*.py"):
        shutil.copyfile(f, dest / f.name)
    train = (dest / "train.py").read_text()
    if train.count(SEED_LINE) != 1:
        raise SystemExit(f"{checkout}/train.py: no line {SEED_LINE!r} to seed; is it nanoGPT's?")
    (dest / "train.py").write_text(train.replace(SEED_LINE, f"torch.manual_seed({seed})"))
    return dest


def run_nanogpt(checkout: Path, recipe: Recipe, seed: int, work: Path, data: Path) -> dict:
    """One nanoGPT run as its own process: per-iteration ms, its own val loss, its ckpt.pt."""
    code = patched_copy(checkout, work / f"nanogpt-{seed}", seed)
    out = work / f"nanogpt-{seed}-out"
    (code / "bench_config.py").write_text(nanogpt_config(recipe, out, data))
    proc = _run([sys.executable, "train.py", "bench_config.py"], cwd=code)
    iters = {int(i): float(ms) for i, ms in ITER.findall(proc["stdout"])}
    evals = {int(i): float(v) for i, v in EVAL.findall(proc["stdout"])}
    ckpt = torch.load(out / "ckpt.pt", map_location="cpu", weights_only=True)
    return {
        **_process(proc),
        "steps": int(ckpt["iter_num"]),
        "block_ms": blocks([iters.get(i, math.nan) for i in range(recipe.steps)], recipe.log_every),
        "own_val": evals.get(recipe.steps, math.nan),
        "model": nanogpt_model(ckpt["model"], recipe),
    }


def nanogpt_model(state: dict[str, torch.Tensor], recipe: Recipe) -> GPT:
    """nanoGPT's weights in isotrain's GPT (GPT-2's layout, whose Conv1D weights are (in, out))."""
    gpt2 = {k: v.t() if k.endswith(LINEAR) else v for k, v in state.items()}
    model = GPT(model_config(recipe))
    model.load_state_dict(from_gpt2_state(gpt2, model.cfg, where="nanoGPT ckpt.pt"))
    return model


def blocks(step_ms: list[float], size: int) -> list[float]:
    """Mean ms per step of each block of `size` steps, the first (warm-up) block left out."""
    return [statistics.fmean(step_ms[i : i + size]) for i in range(size, len(step_ms), size)]


# ----------------------------------------------------------------------------- isotrain
def model_config(recipe: Recipe) -> GPTConfig:
    r = recipe
    return GPTConfig(n_layer=r.n_layer, n_head=r.n_head, d_model=r.d_model, block_size=r.block_size)


def isotrain_flags(recipe: Recipe, seed: int, out: Path) -> list[str]:
    """`isotrain train`'s flags: the recipe in full (the speedrun preset's model and optimizer
    on the same shape, data and schedule), fp32, evaluation only at the end."""
    r = recipe
    steps = r.iso_steps or r.steps
    flags = {
        "--preset": r.preset, "--precision": "fp32", "--seed": seed, "--out-dir": out,
        "--steps": steps, "--eval-every": steps, "--log-every": r.log_every,
        "--sample-tokens": 0, "--model.n-layer": r.n_layer, "--model.n-head": r.n_head,
        "--model.d-model": r.d_model, "--model.block-size": r.block_size,
        "--data.batch-size": r.batch_size, "--data.max-bytes": r.max_bytes,
    }  # fmt: skip
    if r.preset == "tiny":  # nanoGPT's optimizer and schedule; the speedrun preset keeps its own
        flags |= {
            "--optim.lr": r.lr, "--optim.min-lr": r.min_lr, "--optim.warmup-steps": r.warmup_steps,
            "--optim.weight-decay": r.weight_decay, "--optim.beta1": r.beta1,
            "--optim.beta2": r.beta2, "--optim.grad-clip": r.grad_clip,
        }  # fmt: skip
    return [*(s for k, v in flags.items() for s in (k, str(v))), "--no-progress"]


def run_isotrain(recipe: Recipe, seed: int, work: Path) -> dict:
    """One `isotrain train` as its own process: ms per step by block, its own val loss, model."""
    out = work / f"isotrain-{seed}"
    proc = _run([sys.executable, "-m", "isotrain", "train", *isotrain_flags(recipe, seed, out)])
    records = read_metrics(out)
    tokens = recipe.batch_size * recipe.block_size
    train = [r for r in records if r["kind"] == "train" and r["step"] > recipe.log_every]
    summary = next(r for r in records if r["kind"] == "summary")
    config = next(r for r in records if r["kind"] == "config")["config"]
    return {
        **_process(proc),
        "steps": summary["steps"],
        "block_ms": [1e3 * tokens / r["tokens_per_s"] for r in train],
        "own_val": summary["val_loss"],
        "own_eval_batches": config["eval_batches"],
        "skipped": summary["skipped_steps"],
        "config": config,
        "model": load_model(str(out)),
    }


def _waited(runs: list[dict[str, Any]], meta: dict[str, Any]) -> bool:
    """Whether some run waited for a core: its CPU time under 95% of wall x its threads."""
    return any(r["cpu_s"] < 0.95 * r["wall_s"] * meta["threads"] for r in runs)


def _run(cmd: list[str], cwd: Path | None = None) -> dict[str, Any]:
    """Run a trainer; its stdout, wall seconds and CPU seconds (children's rusage)."""
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, env=_child_env(), capture_output=True, text=True)
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {"stdout": p.stdout, "wall_s": wall, "cpu_s": cpu}


def _process(proc: dict[str, Any]) -> dict[str, float]:
    return {"wall_s": proc["wall_s"], "cpu_s": proc["cpu_s"]}


def _child_env() -> dict[str, str]:
    """This environment, the thread count for both trainers, and isotrain on the path."""
    src = str(Path(isotrain.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    threads = str(torch.get_num_threads())
    return {
        **os.environ,
        "PYTHONPATH": path,
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
    }


# ---------------------------------------------------------------------------- evaluator
@torch.no_grad()
def exact_val_loss(model: GPT, val: np.ndarray, block: int, batch: int = 64) -> float:
    """Mean loss per token over every non-overlapping window of `val`: each token once."""
    n = (len(val) - 1) // block
    tokens = torch.from_numpy(np.asarray(val[: n * block + 1], dtype=np.int64))
    x, y = tokens[:-1].view(n, block), tokens[1:].view(n, block)  # (windows, T)
    model.eval()
    total = 0.0
    for i in range(0, n, batch):
        total += float(model(x[i : i + batch], y[i : i + batch])) * len(x[i : i + batch])
    return total / n


# -------------------------------------------------------------------------------- stats
def t_quantile(p: float, df: float) -> float:
    """Student's t quantile (p > 0.5): bisection on the CDF, integrated by Simpson's rule."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(t: float, n: int = 2000) -> float:
        h = t / n
        f = [c * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i in range(n + 1)]
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    lo, hi = 0.0, 1000.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def paired_ratio(num: list[float], den: list[float]) -> dict[str, float]:
    """Geometric mean of num/den paired by round, with its 95% t interval."""
    logs = [math.log(a / b) for a, b in zip(num, den, strict=True)]
    m, n = statistics.fmean(logs), len(logs)
    half = t_quantile(0.975, n - 1) * statistics.stdev(logs) / math.sqrt(n) if n > 1 else math.inf
    return {"ratio": math.exp(m), "lo": math.exp(m - half), "hi": math.exp(m + half), "n": n}


def welch_ratio(num: list[float], den: list[float]) -> dict[str, float]:
    """Ratio of geometric means num / den, with Welch's 95% t interval (unpaired seeds); one
    seed on a side gives no interval: [0, inf]."""
    a, b = [math.log(v) for v in num], [math.log(v) for v in den]
    if min(len(a), len(b)) < 2:
        return {"ratio": math.exp(statistics.fmean(a) - statistics.fmean(b)), "lo": 0.0,
                "hi": math.inf, "df": 0.0}  # fmt: skip
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1)) if se else 1.0
    m = statistics.fmean(a) - statistics.fmean(b)
    half = t_quantile(0.975, df) * se
    return {"ratio": math.exp(m), "lo": math.exp(m - half), "hi": math.exp(m + half), "df": df}


def fmt_ratio(r: dict[str, float]) -> str:
    return f"{r['ratio']:.4f} [{r['lo']:.4f}, {r['hi']:.4f}]"


def fmt_side(xs: list[float], digits: int) -> str:
    """Mean over seeds, then each seed's value."""
    each = ", ".join(f"{x:.{digits}f}" for x in xs)
    return f"{statistics.fmean(xs):.{digits}f} ({each})"


# --------------------------------------------------------------------------------- main
def rounds(checkout: Path, recipe: Recipe, seeds: list[int], work: Path) -> dict[str, list]:
    """Both trainers once per seed, the order alternating; every final model scored alike."""
    data = write_data(work / "data", recipe)
    runs: dict[str, list] = {"nanogpt": [], "isotrain": []}
    for i, seed in enumerate(seeds):
        order = ("nanogpt", "isotrain") if i % 2 == 0 else ("isotrain", "nanogpt")
        for side in order:
            load = os.getloadavg()[0]
            run = (
                run_nanogpt(checkout, recipe, seed, work, work / "data")
                if side == "nanogpt"
                else run_isotrain(recipe, seed, work)
            )
            run.update(seed=seed, round=i, load_1m=round(load, 2))
            run["val"] = exact_val_loss(run.pop("model"), data["val"], recipe.block_size)
            run["ms_per_step"] = statistics.median(run["block_ms"])
            runs[side].append(run)
            ms, val = run["ms_per_step"], run["val"]
            print(f"round {i} {side} seed {seed}: val {val:.4f}, {ms:.1f} ms/step, load {load:.2f}")
    runs["data"] = [
        {k: v for k, v in data.items() if k != "val"} | {"val_tokens": len(data["val"])}
    ]
    return runs


def recipe_checks(
    recipe: Recipe, runs: dict[str, list], *, quick: bool = False
) -> dict[str, dict[str, Any]]:
    """Every run finished the recipe's steps with isotrain's config equal to it; one evaluator
    agrees with each run's own (sampled) evaluation; a speedrun (not a smoke run, too short to
    learn) reached nanoGPT's mean validation loss."""
    everyone = runs["nanogpt"] + runs["isotrain"]
    steps = [r["steps"] for r in everyone]
    wanted = [recipe.steps] * len(runs["nanogpt"]) + [recipe.iso_steps or recipe.steps] * len(
        runs["isotrain"]
    )
    cfgs = [r["config"] for r in runs["isotrain"]]
    same = all(
        c["model"]["n_layer"] == recipe.n_layer and c["model"]["d_model"] == recipe.d_model
        and c["model"]["block_size"] == recipe.block_size and c["model"]["dropout"] == 0.0
        and c["model"]["bias"] and c["data"]["batch_size"] == recipe.batch_size
        and c["precision"] == "fp32"
        and (recipe.preset != "tiny" or (
            c["optim"]["lr"] == recipe.lr and c["optim"]["min_lr"] == recipe.min_lr
            and c["optim"]["grad_clip"] == recipe.grad_clip and c["optim"]["name"] == "adamw"))
        for c in cfgs
    )  # fmt: skip
    gaps = [abs(r["val"] - r["own_val"]) for r in everyone]
    reached = {}
    if recipe.preset != "tiny" and not quick:
        iso, nano = (statistics.fmean(r["val"] for r in runs[k]) for k in ("isotrain", "nanogpt"))
        reached["reached nanoGPT's val"] = check(
            iso <= nano, f"isotrain {iso:.4f} <= nanoGPT {nano:.4f} (means over seeds)"
        )
    return reached | {
        "finished every step": check(steps == wanted, f"steps {steps}"),
        "same recipe": check(
            same,
            "isotrain's resolved config against the recipe; nanoGPT's "
            "weights load strictly into the recipe's GPT",
        ),
        "one evaluator agrees with each run's own": check(
            max(gaps) <= recipe.agree,
            f"largest |exact - own| {max(gaps):.4f} nats (<= {recipe.agree})",
        ),
    }


def own_eval(run: dict, recipe: Recipe, summary: dict) -> str:
    """What isotrain's own evaluation covered: the whole split, or a number of batches."""
    if run["own_eval_batches"] * recipe.batch_size >= summary["eval_windows"]:
        return "every window of the split: exact"
    return f"{run['own_eval_batches']} batches"


def train_seconds(run: dict) -> float:
    """A run's training time: its steps at its median ms per step (evaluation excluded)."""
    return run["steps"] * run["ms_per_step"] / 1e3


def speedrun_rows(recipe: Recipe, runs: dict[str, list], summary: dict) -> list[str]:
    """With `--recipe speedrun`: the time to nanoGPT's loss, wall and process CPU."""
    if "time_to_val" not in summary:
        return []
    nano, iso = runs["nanogpt"], runs["isotrain"]
    t = [[train_seconds(r) for r in side] for side in (nano, iso)]
    cpu = [[r["cpu_s"] for r in side] for side in (nano, iso)]
    return [
        f"| time to nanoGPT's {recipe.steps}-step val: training s ({recipe.steps} against "
        f"{recipe.iso_steps} steps x ms/step) | {fmt_side(t[0], 0)} | {fmt_side(t[1], 0)} | "
        f"{fmt_ratio(summary['time_to_val'])} (paired by round, t) |",
        f"| whole process CPU s (start-up and evaluations included) | {fmt_side(cpu[0], 0)} | "
        f"{fmt_side(cpu[1], 0)} | {fmt_ratio(summary['cpu_to_val'])} (paired by round, t) |",
    ]


def markdown(meta: dict, recipe: Recipe, runs: dict[str, list], summary: dict, quick: bool) -> str:
    """The result file: the comparison table, each run, and what the numbers can and cannot say."""
    nano, iso = runs["nanogpt"], runs["isotrain"]
    val = [[r["val"] for r in side] for side in (nano, iso)]
    ms = [[r["ms_per_step"] for r in side] for side in (nano, iso)]
    own = [[r["own_val"] for r in side] for side in (nano, iso)]
    loads = [r["load_1m"] for r in nano + iso]
    lines = [
        "# isotrain against nanoGPT's train.py, same bytes and recipe",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {machine_line(meta)}  ",
        f"{'Stand-in (benchmarks/nanogpt_standin/), a smoke run: not nanoGPT. ' if quick else ''}"
        f"Recipe: {recipe.n_layer} layers, d {recipe.d_model}, {recipe.n_head} heads, context "
        f"{recipe.block_size}, batch {recipe.batch_size}, bias, dropout 0, AdamW {recipe.lr:g} "
        f"cosine to {recipe.min_lr:g}, warmup {recipe.warmup_steps}, wd {recipe.weight_decay:g}, "
        f"betas {recipe.beta1}/{recipe.beta2}, clip {recipe.grad_clip:g}, {recipe.steps} steps, "
        f"fp32, no compile, CPU; {len(nano)} seed{'s' if len(nano) > 1 else ''} each "
        f"({', '.join(str(r['seed']) for r in nano)}), whole processes in interleaved rounds."
        + (
            f" isotrain's side: `--preset {recipe.preset}` (its own model and optimizer, "
            f"docs/benchmarks.md) for {recipe.iso_steps} steps."
            if recipe.preset != "tiny"
            else ""
        ),
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|---|---:|---:|---:|",
        f"| val loss {'at equal tokens' if recipe.preset == 'tiny' else 'at the end'}, one "
        f"evaluator (nats/byte) | {fmt_side(val[0], 4)} | "
        f"{fmt_side(val[1], 4)} | {fmt_ratio(summary['val_ratio'])} (Welch t, over seeds) |",
        f"| step time, ms (median of {recipe.log_every}-step blocks, evaluation excluded) | "
        f"{fmt_side(ms[0], 1)} | {fmt_side(ms[1], 1)} | {fmt_ratio(summary['time_ratio'])} "
        "(paired by round, t) |",
        f"| its own evaluation | {fmt_side(own[0], 4)} ({recipe.own_eval_iters} random batches) "
        f"| {fmt_side(own[1], 4)} ({own_eval(iso[0], recipe, summary)}) | |",
        *speedrun_rows(recipe, runs, summary),
        "",
        f"One evaluator: isotrain's GPT (nanoGPT's ckpt.pt mapped through GPT-2's layout) on all "
        f"{summary['eval_windows']} non-overlapping {recipe.block_size}-byte windows of the "
        f"validation split ({runs['data'][0]['val_tokens']:,} bytes): the split's exact loss, the "
        "same for both. Step times: nanoGPT's logged per-iteration ms and isotrain's metrics.jsonl "
        f"(evaluation paused out), both wall time, both averaged over the same {recipe.log_every}"
        "-step blocks with the first block (warm-up, nanoGPT's first evaluation) left out.",
        "",
        f"**Load.** 1-minute load average at each run's start: {min(loads):.2f} to "
        f"{max(loads):.2f} on {meta['cores']} cores; before {meta['load_before']}, after "
        f"{meta['load_after']}. "
        + (
            "The machine was shared while this ran: the step times and their ratio are not a "
            "speed result; the losses do not depend on load."
            if _waited(nano + iso, meta)
            else "Each process had its threads' cores (CPU s >= 95% of wall s x threads), so no "
            "run waited; the load above includes the run before it."
        ),
        "",
        "| round | trainer | seed | val (one evaluator) | own eval | ms/step | process wall s "
        "| process CPU s | skipped | load |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(nano + iso, key=lambda r: (r["round"], "skipped" in r)):
        lines.append(
            f"| {r['round']} | {'isotrain' if 'skipped' in r else 'nanoGPT'} | {r['seed']} | "
            f"{r['val']:.4f} | {r['own_val']:.4f} | {r['ms_per_step']:.1f} | {r['wall_s']:.0f} | "
            f"{r['cpu_s']:.0f} | {r.get('skipped', '-')} | {r['load_1m']:.2f} |"
        )
    return "\n".join([*lines, ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument(
        "--nanogpt",
        type=Path,
        default=os.environ.get("NANOGPT"),
        help="a nanoGPT checkout (default: $NANOGPT; --quick: the stand-in)",
    )
    p.add_argument("--seeds", type=int, default=None, help="rounds, one seed each (3; quick 1)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: recipe's)")
    p.add_argument(
        "--keep", type=Path, default=None, help="keep the runs here (default: a temp dir)"
    )
    p.add_argument(
        "--recipe",
        choices=("nanogpt", "speedrun"),
        default="nanogpt",
        help="isotrain's side: nanoGPT's recipe, or --preset speedrun for fewer steps",
    )
    p.add_argument(
        "--recipe-steps", type=int, default=None, help="speedrun's steps (the preset's; quick 10)"
    )
    args = p.parse_args(argv)
    recipe = QUICK if args.quick else Recipe()
    if args.steps:
        recipe = dataclasses.replace(recipe, steps=args.steps)
    if args.recipe == "speedrun":
        own = args.recipe_steps or (
            recipe.steps // 2 if args.quick else PRESETS["speedrun"]().steps
        )
        recipe = dataclasses.replace(recipe, preset="speedrun", iso_steps=own)
    if args.nanogpt is None and not args.quick:
        raise SystemExit("no nanoGPT checkout: pass --nanogpt PATH or set NANOGPT=PATH")
    checkout = Path(args.nanogpt or STANDIN).expanduser().resolve()
    if not (checkout / "train.py").is_file():
        raise SystemExit(f"--nanogpt {checkout}: no train.py; pass a nanoGPT checkout")
    if args.keep and args.keep.exists() and any(args.keep.iterdir()):
        raise SystemExit(f"--keep {args.keep}: not empty (isotrain would resume its runs)")
    if args.seeds is not None and args.seeds < 1:
        raise SystemExit(f"--seeds {args.seeds}: run at least 1 seed per side")
    seeds = [1337 + i for i in range(args.seeds or (1 if args.quick else 3))]
    out = out_dir(args)
    load_before = os.getloadavg()[0]
    old = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        with tempfile.TemporaryDirectory(prefix="vs-nanogpt-") as tmp:
            work = args.keep or Path(tmp)
            work.mkdir(parents=True, exist_ok=True)
            runs = rounds(checkout, recipe, seeds, work)
        meta = run_meta("bench_vs_nanogpt.py", argv, load_before)
    finally:
        torch.set_num_threads(old)
    meta["nanogpt"] = str(checkout) + (" (the stand-in)" if checkout == STANDIN else "")
    nano, iso = runs["nanogpt"], runs["isotrain"]
    summary = {
        "val_ratio": welch_ratio([r["val"] for r in iso], [r["val"] for r in nano]),
        "time_ratio": paired_ratio(
            [r["ms_per_step"] for r in sorted(iso, key=lambda r: r["round"])],
            [r["ms_per_step"] for r in sorted(nano, key=lambda r: r["round"])],
        ),
        "val_difference": statistics.fmean(r["val"] for r in iso)
        - statistics.fmean(r["val"] for r in nano),
        "eval_windows": (runs["data"][0]["val_tokens"] - 1) // recipe.block_size,
    }
    if recipe.preset != "tiny":
        by_round = [sorted(side, key=lambda r: r["round"]) for side in (iso, nano)]
        summary["time_to_val"] = paired_ratio(*([train_seconds(r) for r in s] for s in by_round))
        summary["cpu_to_val"] = paired_ratio(*([r["cpu_s"] for r in s] for s in by_round))
    checks = recipe_checks(recipe, runs, quick=args.quick)
    md = markdown(meta, recipe, runs, summary, checkout == STANDIN)
    for r in iso:
        r.pop("config")
    payload = {
        "meta": meta,
        "recipe": dataclasses.asdict(recipe),
        "summary": summary,
        "runs": runs,
        "checks": checks,
    }
    stem = "vs_nanogpt" if recipe.preset == "tiny" else f"vs_nanogpt_{recipe.preset}"
    return write_results(out, stem, payload, "\n".join([md, *checks_md(checks)]))


if __name__ == "__main__":
    steady_malloc()
    raise SystemExit(main())
