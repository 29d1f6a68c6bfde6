"""Quantization-aware training: validation loss at 8 and 4 bits beside full precision.

Trains the same GPT on the same batches (same seed, same steps) with `--quant.bits` 0, 8 and 4
through the trainer, and writes qat.{md,json} into benchmarks/results/<cpu-kind>/ (losses do
not depend on the machine's speed; the kind is kept for the torch kernels that computed them).
Check: every run finished its steps with a finite validation loss.

    python benchmarks/bench_qat.py            # tiny preset shape, 300 steps per run (~4 min)
    python benchmarks/bench_qat.py --quick    # seconds: smoke preset, temp dir
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import tempfile
import time
from pathlib import Path

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
from isotrain.train.config import PRESETS, QuantConfig
from isotrain.train.loop import train
from isotrain.train.rundir.metrics import read_metrics

COLUMNS = ["weights", "val loss (nats/byte)", "vs fp32", "unigram baseline", "wall s"]


def run(bits: int, *, quick: bool, steps: int, out: Path) -> dict:
    """Train one configuration; return its final validation loss and time."""
    base = PRESETS["smoke" if quick else "tiny"]()
    cfg = dataclasses.replace(
        base,
        quant=QuantConfig(bits=bits),
        steps=steps,
        eval_every=steps,
        log_every=max(steps // 10, 1),
        sample_tokens=0,
        progress=False,
        out_dir=str(out / f"bits{bits}"),
    )
    t0 = time.perf_counter()
    state = train(cfg)
    seconds = time.perf_counter() - t0
    evals = [r for r in read_metrics(cfg.out_dir) if r["kind"] == "eval"]
    return {
        "bits": bits or "fp32",
        "steps": state.step,
        "val_loss": state.last_val,
        "unigram_baseline": evals[-1]["unigram_baseline"],
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, threads=None)
    p.add_argument("--steps", type=int, default=None)
    args = p.parse_args(argv)
    steps = args.steps or (4 if args.quick else 300)
    out = out_dir(args)
    load_before = os.getloadavg()[0]
    with torch_threads(None), tempfile.TemporaryDirectory() as tmp:  # threads restored after
        rows = [run(bits, quick=args.quick, steps=steps, out=Path(tmp)) for bits in (0, 8, 4)]
    meta = run_meta("bench_qat.py", argv, load_before)
    fp = rows[0]["val_loss"]
    lines = [
        "# Quantization-aware training: validation loss by weight precision",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {machine_line(meta)}  ",
        f"{'smoke' if args.quick else 'tiny'} preset, {steps} steps, same seed and batches. "
        "Linear weights fake-quantized per output channel (absmax) through a straight-through "
        "estimator; the tied embedding / LM head stays fp32.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['bits']}{'' if r['bits'] == 'fp32' else '-bit'} | {r['val_loss']:.4f} | "
            f"{r['val_loss'] - fp:+.4f} | {r['unigram_baseline']:.4f} | {r['seconds']:.0f} |"
        )
    ok = all(r["steps"] == steps and math.isfinite(r["val_loss"]) for r in rows)
    detail = f"steps {[r['steps'] for r in rows]} of {steps}, losses " + str(
        [round(r["val_loss"], 4) for r in rows]
    )
    checks = {"finished, finite": check(ok, detail)}
    md = "\n".join([*lines, "", *checks_md(checks)])
    return write_results(out, "qat", {"meta": meta, "rows": rows, "checks": checks}, md)


if __name__ == "__main__":
    steady_malloc()
    raise SystemExit(main())
