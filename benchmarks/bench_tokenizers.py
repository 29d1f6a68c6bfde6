"""Tokenizers on the default corpus: bytes against byte-level BPE at two vocabulary sizes.

Each variant trains the same model shape (vocabulary aside) for the same wall-time budget:
a short calibration measures its seconds per step, then the trainer runs as many steps as fit
(so each cosine schedule completes). Reported: validation loss per token and in bits per byte
(comparable across tokenizers), the unigram baseline in bits per byte, steps, bytes of text
per second, and the start of a sample. Writes benchmarks/results/tokenizers.{md,json}.
Run it on an idle machine: the budget is wall time.

    python benchmarks/bench_tokenizers.py                  # tiny preset, 300 s per variant
    python benchmarks/bench_tokenizers.py --budget 600 --vocab 1024 4096
    python benchmarks/bench_tokenizers.py --quick          # seconds: smoke preset, small BPEs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from isotrain.train.config import PRESETS, TrainConfig
from isotrain.train.loop import setup, train
from isotrain.train.model.sampling import sample
from isotrain.train.rundir.metrics import read_metrics
from isotrain.train.step import train_step
from isotrain.train.weights.load import load_with_tokenizer

RESULTS = Path(__file__).parent / "results"


def _config(quick: bool, tokenizer: str, vocab: int, out: Path, steps: int) -> TrainConfig:
    base = PRESETS["smoke" if quick else "tiny"]()
    data = dataclasses.replace(base.data, max_bytes=200_000) if quick else base.data
    return dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, vocab_size=vocab),
        data=data,
        tokenizer=tokenizer,
        steps=steps,
        eval_every=steps,
        log_every=max(steps // 10, 1),
        sample_tokens=0,
        progress=False,
        out_dir=str(out),
    )


def calibrate(cfg: TrainConfig, seconds: float) -> tuple[float, float]:
    """Seconds per step (timed over `seconds`, at least 4 steps, after one warm-up step) and
    the seconds setup took (BPE training and tokenizing included)."""
    t0 = time.perf_counter()
    run = setup(cfg)
    prep = time.perf_counter() - t0
    train_step(run)
    t0, n = time.perf_counter(), 0
    while n < 4 or time.perf_counter() - t0 < seconds:
        train_step(run)
        n += 1
    return (time.perf_counter() - t0) / n, prep


def run_variant(kind: str, vocab: int, *, quick: bool, budget: float, out: Path) -> dict[str, Any]:
    """Calibrate, then train one tokenizer for `budget` seconds; return its row."""
    calib = out / f"{kind}{vocab}_calibrate"
    per_step, prep = calibrate(_config(quick, kind, vocab, calib, 10**6), budget / 20)
    steps = max(2, int(budget / per_step))
    tok_spec = str(calib / "tokenizer.json") if kind == "bpe" else "bytes"  # no second BPE
    cfg = _config(quick, tok_spec, vocab, out / f"{kind}{vocab}", steps)
    train(cfg)
    summary = read_metrics(cfg.out_dir)[-1]
    model, tok = load_with_tokenizer(cfg.out_dir)
    text = sample(model, "def ", 48, tokenizer=tok, seed=0)
    tokens_per_byte = summary["val_bpb"] * math.log(2) / summary["val_loss"]  # of val text
    return {
        "tokenizer": "bytes" if kind == "bytes" else f"BPE {vocab}",
        "vocab": vocab,
        "steps": steps,
        "train_seconds": summary["train_seconds"],
        "setup_seconds": prep,
        "val_loss_per_token": summary["val_loss"],
        "val_bpb": summary["val_bpb"],
        "unigram_bpb": summary["unigram_baseline_bpb"],
        "bytes_per_token": 1 / tokens_per_byte,
        "bytes_per_s": summary["tokens_seen"] / tokens_per_byte / summary["train_seconds"],
        "sample": ("def " + text)[:60],
    }


def _median_rows(runs: list[dict[str, Any]]) -> dict[str, Any]:
    row = dict(runs[0])
    for key in ("steps", "train_seconds", "val_loss_per_token", "val_bpb", "bytes_per_s"):
        row[key] = statistics.median(r[key] for r in runs)
    return row


def _table(rows: list[dict[str, Any]], command: str, budget: float) -> list[str]:
    lines = [
        "# Tokenizers: bytes against BPE, same wall-time budget, bits per byte",
        "",
        f"`{command}` ({budget:g} s of training per variant; torch {torch.__version__}, "
        f"{platform.machine()}, {torch.get_num_threads()} threads). Lower bits per byte is better; "
        "the sample starts from `def ` with the trained model (temperature 0.8, top-k 50).",
        "",
        "| tokenizer | bytes/token | steps | text bytes/s | val nats/token | val bits/byte "
        "| unigram bits/byte | sample |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        sample_md = r["sample"].replace("\n", "⏎").replace("|", "\\|")
        lines.append(
            f"| {r['tokenizer']} | {r['bytes_per_token']:.2f} | {r['steps']:.0f} | "
            f"{r['bytes_per_s']:,.0f} | {r['val_loss_per_token']:.4f} | {r['val_bpb']:.4f} | "
            f"{r['unigram_bpb']:.4f} | `{sample_md}` |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--budget", type=float, default=None, help="training seconds per variant")
    p.add_argument("--vocab", type=int, nargs=2, default=None, help="the two BPE sizes")
    p.add_argument("--repeats", type=int, default=1, help="runs per variant (order rotates)")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    budget = args.budget or (1.0 if args.quick else 300.0)
    vocab = args.vocab or ((300, 512) if args.quick else (1024, 4096))
    variants = [("bytes", 256), ("bpe", vocab[0]), ("bpe", vocab[1])]
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for kind, size in variants[r % 3 :] + variants[: r % 3]:
                out = Path(tmp) / f"r{r}"
                runs[(kind, size)].append(
                    run_variant(kind, size, quick=args.quick, budget=budget, out=out)
                )
    rows = [_median_rows(runs[v]) for v in variants]
    flags = sys.argv[1:] if argv is None else argv
    command = " ".join(["python benchmarks/bench_tokenizers.py", *flags])
    lines = _table(rows, command, budget)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "tokenizers_quick" if args.quick else "tokenizers"
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    meta = {"command": command, "budget_s": budget, "threads": torch.get_num_threads()}
    (args.out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
