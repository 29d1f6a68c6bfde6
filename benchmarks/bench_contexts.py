"""Cost of entering + exiting each isotrain context, next to the seed-style / plain-torch version.

Run:  python benchmarks/bench_contexts.py            (about a minute)
      python benchmarks/bench_contexts.py --quick    (seconds, smoke run into a temp dir)

Variants are interleaved round by round; the table reports the median over rounds of the mean
time per enter+exit, in microseconds. Check: every isotrain context leaves the global state
(StateAudit) as it found it. Writes contexts.{md,json} into benchmarks/results/<cpu-kind>/.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
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
from isotrain.contexts import (
    StateAudit,
    autocast_if_available,
    eval_mode,
    frozen,
    rng_isolated,
    train_mode,
)

COLUMNS = ["context", "isotrain (µs)", "% of a tiny step", "reference", "reference (µs)", "ratio"]


# ------------------------------------------------------------- seed-style reference versions


@contextmanager
def seed_eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        model.train(was_training)


@contextmanager
def seed_autocast_if_available(dtype: torch.dtype = torch.bfloat16) -> Iterator[None]:
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        with torch.autocast("cuda", dtype=dtype):
            yield
    else:
        yield


@contextmanager
def plain_train_mode(model: nn.Module) -> Iterator[nn.Module]:
    was_training = model.training
    model.train()
    try:
        with torch.enable_grad():
            yield model
    finally:
        model.train(was_training)


@contextmanager
def plain_frozen(model: nn.Module) -> Iterator[nn.Module]:
    params = list(model.parameters())
    for p in params:
        p.requires_grad_(False)
    try:
        yield model
    finally:
        for p in params:
            p.requires_grad_(True)


def plain_cpu_autocast() -> AbstractContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _fork_rng() -> AbstractContextManager:
    return torch.random.fork_rng(devices=[])


# ---------------------------------------------------------------------------------- models


def small_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.1), nn.Linear(16, 3))


def gpt_like(n_layers: int = 12, d: int = 64) -> nn.Module:
    """Module tree shaped like a 12-layer GPT (about 100 modules, 150 parameters)."""

    def block() -> nn.Module:
        return nn.ModuleDict(
            {
                "ln1": nn.LayerNorm(d),
                "attn": nn.ModuleDict({"qkv": nn.Linear(d, 3 * d), "proj": nn.Linear(d, d)}),
                "ln2": nn.LayerNorm(d),
                "mlp": nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)),
                "drop": nn.Dropout(0.1),
            }
        )

    return nn.ModuleDict(
        {"emb": nn.Embedding(256, d), "blocks": nn.ModuleList(block() for _ in range(n_layers))}
    )


def cases() -> dict[str, dict[str, Callable[[], AbstractContextManager]]]:
    small, gpt = small_model(), gpt_like()
    return {
        "eval_mode (4-module MLP)": {
            "isotrain": lambda: eval_mode(small),
            "seed-style": lambda: seed_eval_mode(small),
        },
        "eval_mode (12-layer GPT tree)": {
            "isotrain": lambda: eval_mode(gpt),
            "seed-style": lambda: seed_eval_mode(gpt),
        },
        "train_mode (12-layer GPT tree)": {
            "isotrain": lambda: train_mode(gpt),
            "plain": lambda: plain_train_mode(gpt),
        },
        "frozen (12-layer GPT tree)": {
            "isotrain": lambda: frozen(gpt),
            "plain": lambda: plain_frozen(gpt),
        },
        "autocast_if_available (cpu)": {
            "isotrain": lambda: autocast_if_available(device="cpu"),
            "plain": plain_cpu_autocast,
            "seed-style": seed_autocast_if_available,  # a no-op without CUDA
        },
        "rng_isolated": {"isotrain": rng_isolated, "plain": _fork_rng},
        "StateAudit (no modules)": {"isotrain": lambda: StateAudit(warn=False)},
        "StateAudit (12-layer GPT tree)": {"isotrain": lambda: StateAudit(gpt, warn=False)},
    }


def tiny_step() -> Callable[[], None]:
    """One eager training step of a 2-layer transformer (d=32, T=32, B=4): the scale to beat."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=128, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 32, 32)

    def step() -> None:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    return step


def time_calls(fn: Callable[[], None], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def time_enter_exit(make: Callable[[], AbstractContextManager], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        with make():
            pass
    return (time.perf_counter() - t0) / n * 1e6


def run(rounds: int, n: int) -> tuple[dict, float]:
    results: dict = {}
    step, step_samples = tiny_step(), []
    time_calls(step, 3)  # warm-up
    for name, variants in cases().items():
        for make in variants.values():  # warm-up
            time_enter_exit(make, 10)
        samples: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(rounds):
            for variant, make in variants.items():  # interleaved
                samples[variant].append(time_enter_exit(make, n))
            step_samples.append(time_calls(step, 2))  # same machine load as the contexts
        results[name] = {v: statistics.median(s) for v, s in samples.items()}
    return results, statistics.median(step_samples)


def restored(cases_: dict[str, dict[str, Callable[[], AbstractContextManager]]]) -> list[str]:
    """The isotrain contexts that left global state changed (none should)."""
    bad = []
    for name, variants in cases_.items():
        with StateAudit(warn=False) as audit, variants["isotrain"]():
            pass
        if audit.differences:
            bad.append(name)
    return bad


def markdown(results: dict, step_us: float, meta: dict[str, Any], checks: dict) -> str:
    lines = [
        "# Context enter+exit cost",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {machine_line(meta)}  ",
        f"Rounds {meta['rounds']}, n={meta['n']}: median over rounds of the mean per enter+exit.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for name, r in results.items():
        refs = [(v, t) for v, t in r.items() if v != "isotrain"] or [("—", float("nan"))]
        for ref, t in refs:
            ratio = f"{r['isotrain'] / t:.1f}x" if t == t and t > 0 else "—"
            ref_t = f"{t:.1f}" if t == t else "—"
            pct = f"{100 * r['isotrain'] / step_us:.1f}%"
            lines.append(f"| {name} | {r['isotrain']:.1f} | {pct} | {ref} | {ref_t} | {ratio} |")
    lines += [
        "",
        "References: seed-style = the seed's versions (top-level flag only; its autocast is a "
        "no-op without CUDA); plain = the minimal hand-written equivalent (`plain` for "
        "rng_isolated is `torch.random.fork_rng(devices=[])`, which saves the torch CPU state "
        "only, while rng_isolated also saves Python `random` and numpy, whose state access "
        "is ~100 µs each way).",
        "",
        f"Scale: one eager training step of a 2-layer transformer (d=32, T=32, B=4), timed "
        f"between the rounds under the same load, took {step_us:,.0f} µs (median).",
        "",
    ]
    return "\n".join([*lines, *checks_md(checks)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds per case")
    parser.add_argument("--n", type=int, default=200, help="enter+exit per round")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.n = 2, 10
    out = out_dir(args)
    load_before = os.getloadavg()[0]
    with torch_threads(args.threads):  # the contexts are pure Python; this steadies the step
        results, step_us = run(args.rounds, args.n)
        bad = restored(cases())
        meta = run_meta("bench_contexts.py", argv, load_before)
    meta.update(rounds=args.rounds, n=args.n, unit="us", tiny_step_us=step_us)
    checks = {"state restored": check(not bad, f"contexts that leaked: {bad or 'none'}")}
    res = {"meta": meta, "results": results, "checks": checks}
    return write_results(out, "contexts", res, markdown(results, step_us, meta, checks))


if __name__ == "__main__":
    steady_malloc()
    raise SystemExit(main())
