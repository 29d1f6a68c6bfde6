"""Activation checkpointing trade-off: saved-activation bytes against step time, per policy.

A 12-layer pre-LN GPT-like model (d_model 384, 6 heads) at sequence lengths 512 and 1024.
Bytes and FLOPs are exact (saved-tensor hooks, FlopCounterMode); step time is the per-round
paired ratio to the unwrapped model (one step per policy per round, order rotating), with its
95% interval; rounds continue until every interval is within +-2% (stats.Stopper). One torch
thread and process CPU time by default. Checks: every policy gives the unwrapped model's loss
and gradients exactly.

    python benchmarks/bench_checkpointing.py            # ~5-10 minutes on 2 cores
    python benchmarks/bench_checkpointing.py --quick    # seconds, a smoke run into a temp dir
    python benchmarks/bench_checkpointing.py --render --out DIR   # redraw DIR's md and png

Writes checkpointing.{md,json,png} into benchmarks/results/<cpu-kind>/.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
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
from figures import pyplot
from isotrain.checkpointing import apply_activation_checkpointing, measure_activation_memory
from stats import Stopper, fmt_ci, paired_ratios, summarize

POLICIES = ["none", "full", "every:2", "selective", "budget:50%"]
TARGETS = {"full": (0.85, 1.35), "selective": (0.40, 1.15)}  # min byte cut, max time ratio
COLUMNS = [
    "T",
    "policy",
    "ckpt blocks",
    "saved MB",
    "bytes cut",
    "step s",
    "step time x [95% CI]",
    "FLOPs x",
]


class Block(nn.Module):
    """Pre-LN GPT block: causal self-attention (SDPA) and a 4x GELU MLP."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, C/H)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, *, vocab: int, d: int, h: int, layers: int, max_len: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))  # (B, T, vocab)


def loss_of(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), idx.flatten())


def step_time(model: nn.Module, idx: torch.Tensor) -> float:
    """One forward + backward, in process CPU time (wall time after a sync on CUDA)."""
    model.zero_grad(set_to_none=True)
    now = time.perf_counter if idx.is_cuda else time.process_time
    t0 = now()
    loss_of(model(idx), idx).backward()
    if idx.is_cuda:
        torch.cuda.synchronize()  # sync: timing boundary
    return now() - t0


def same_as_unwrapped(models: dict[str, nn.Module], idx: torch.Tensor) -> dict[str, float]:
    """Largest |loss or gradient difference| of each policy against the unwrapped model."""
    ref: list[torch.Tensor] = []
    out = {}
    for pol, m in models.items():
        m.zero_grad(set_to_none=True)
        loss = loss_of(m(idx), idx)
        loss.backward()
        vals = [loss.detach(), *(p.grad for p in m.parameters() if p.grad is not None)]
        if pol == "none":
            ref = vals
        out[pol] = max(float((a - b).abs().max()) for a, b in zip(vals, ref, strict=True))
    return out


def run_length(base: GPT, idx: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """Wrap one copy per policy, measure bytes/FLOPs, check equality, then time rounds."""
    models, out = {}, {}
    for pol in POLICIES:
        m = copy.deepcopy(base)
        apply_activation_checkpointing(m, policy=pol, modules=(Block,), example_inputs=(idx,))
        rep = measure_activation_memory(
            m, idx, modules=(Block,), loss_fn=lambda o: loss_of(o, idx), recompute=False
        )
        models[pol] = m  # the measurement's forward+backward passes double as warm-up
        out[pol] = {
            "saved_bytes": rep.total_bytes,
            "checkpointed_blocks": sum(b.checkpointed for b in rep.blocks),
            "forward_flops": rep.forward_flops,
            "backward_flops": rep.backward_flops,
            "times_s": [],
        }
    diffs = same_as_unwrapped(models, idx)
    times = {pol: out[pol]["times_s"] for pol in POLICIES}
    stopper = Stopper(lambda: paired_ratios(times, "none", speed=False),
                      min_rounds=args.min_rounds, max_rounds=args.rounds)  # fmt: skip
    r = 0
    while not stopper(r):
        for pol in POLICIES[r % len(POLICIES) :] + POLICIES[: r % len(POLICIES)]:
            out[pol]["times_s"].append(step_time(models[pol], idx))
        r += 1
    for pol in POLICIES:
        out[pol]["max_abs_diff_vs_unwrapped"] = diffs[pol]
    return {"policies": derive(out), "stopping": stopper.record(r)}


def derive(out: dict[str, Any]) -> dict[str, Any]:
    """Ratios to the unwrapped model: bytes and FLOPs exact, step time paired per round."""
    none = out["none"]
    base_flops = none["forward_flops"] + none["backward_flops"]
    ratios = paired_ratios({p: r["times_s"] for p, r in out.items()}, "none", speed=False)
    for pol, res in out.items():
        res["step_s_median"] = sorted(res["times_s"])[len(res["times_s"]) // 2]
        res["time_ratio"] = summarize(ratios[pol]) if pol in ratios else None
        res["byte_cut"] = 1 - res["saved_bytes"] / none["saved_bytes"]
        flops = res["forward_flops"] + res["backward_flops"]
        res["flop_ratio"] = flops / base_flops
    return out


def verdicts(results: dict[str, Any]) -> list[str]:
    lines = []
    for pol, (cut, ratio) in TARGETS.items():
        for T, res in results.items():
            r = res["policies"][pol]
            t = r["time_ratio"]
            lines.append(
                f"- `{pol}` at T={T}: bytes -{r['byte_cut']:.1%} (target >= {cut:.0%}: "
                f"{'met' if r['byte_cut'] >= cut else 'MISSED'}), time x{fmt_ci(t, 2)} (target "
                f"<= x{ratio:.2f}: {'met' if t['ci95_hi'] <= ratio else 'MISSED'}), "
                f"FLOPs x{r['flop_ratio']:.2f}"
            )
    return lines


def markdown(res: dict[str, Any]) -> str:
    m, c = res["meta"], res["config"]
    lines = [
        "# Activation checkpointing: saved bytes vs step time",
        "",
        f"Command: `{m['command']}`  ",
        f"Machine: {machine_line(m)}  ",
        f"Model: {c['layers']} pre-LN blocks, d_model {c['d_model']}, {c['heads']} heads, "
        f"batch per length {c['batch']}, fp32. Clock: process CPU time.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---:|" * len(COLUMNS),
    ]
    for T, res_t in res["results"].items():
        for pol, r in res_t["policies"].items():
            t = fmt_ci(r["time_ratio"], 2) if r["time_ratio"] else "1 (reference)"
            lines.append(
                f"| {T} | {pol} | {r['checkpointed_blocks']} | {r['saved_bytes'] / 1e6:.1f} | "
                f"{r['byte_cut']:.1%} | {r['step_s_median']:.3f} | {t} | {r['flop_ratio']:.2f} |"
            )
    stops = [f"T={T}: {r['stopping']['reason']}" for T, r in res["results"].items()]
    lines += ["", f"Rounds: {'; '.join(stops)}.", "", "Targets (benchmark goals, not tests):"]
    lines += [*verdicts(res["results"]), ""]
    lines.append(
        "`step time x`: median over one-step rounds of each policy's step time over the unwrapped "
        "model's in the same round, with its 95% interval. Bytes and FLOPs are exact."
    )
    return "\n".join([*lines, "", *checks_md(res["checks"])])


def plot(results: dict[str, Any], path: Path) -> None:
    """Saved MB per policy (left); step time with its 95% CI and exact FLOPs, as ratios (right).

    Policies are the rows (tick labels), each marker kind is in the legend: no annotations
    that could overlap.
    """
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.6), sharey=True)
    lengths = list(results)
    ys = list(range(len(POLICIES)))[::-1]
    h = 0.8 / len(lengths)
    for i, T in enumerate(lengths):
        pols = results[T]["policies"]
        off = [y + (len(lengths) / 2 - i - 0.5) * h for y in ys]
        left.barh(off, [pols[p]["saved_bytes"] / 1e6 for p in POLICIES], height=h, label=f"T={T}")
        t = [time_summary(pols, p) for p in POLICIES]
        err = [[s["median"] - s["ci95_lo"] for s in t], [s["ci95_hi"] - s["median"] for s in t]]
        line = right.errorbar([s["median"] for s in t], off, xerr=err, fmt="o", capsize=3,
                              label=f"T={T}: step time (median, 95% CI)")  # fmt: skip
        right.plot([pols[p]["flop_ratio"] for p in POLICIES], off, "x", ms=8,
                   color=line[0].get_color(), label=f"T={T}: FLOPs (exact)")  # fmt: skip
    left.set_yticks(ys, POLICIES)
    left.set_xlabel("activation bytes saved for backward (MB)")
    left.legend(fontsize=8)
    right.axvline(1.0, color="grey", lw=0.8, ls="--")
    right.set_xlabel("ratio to the unwrapped model (1 = no cost)")
    right.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    right.grid(axis="x", alpha=0.3)
    fig.suptitle("Activation checkpointing: memory against time, per policy", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def time_summary(pols: dict[str, Any], pol: str) -> dict[str, float]:
    """A policy's step-time ratio summary (the unwrapped model: exactly 1)."""
    if pol == "none":
        return {"median": 1.0, "ci95_lo": 1.0, "ci95_hi": 1.0}
    if isinstance(pols[pol].get("time_ratio"), dict):
        return pols[pol]["time_ratio"]  # type: ignore[no-any-return]
    # results of the earlier script (a median only): pair its per-round times here
    ratios = paired_ratios({p: r["times_s"] for p, r in pols.items()}, "none", speed=False)
    return summarize(ratios[pol])


def checks(results: dict[str, Any]) -> dict[str, Any]:
    worst = max(
        r["max_abs_diff_vs_unwrapped"] for res in results.values() for r in res["policies"].values()
    )
    return {
        "same loss and gradients as unwrapped": check(
            worst == 0.0, f"largest |difference| over policies and lengths: {worst:.1e}"
        )
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--rounds", type=int, default=60, help="the most rounds per length")
    ap.add_argument("--min-rounds", type=int, default=15)
    ap.add_argument("--render", action="store_true", help="only redraw the png from the JSON")
    args = ap.parse_args(argv)
    if args.quick:
        args.config = {"d_model": 64, "heads": 2, "layers": 2, "batch": {64: 2, 128: 2}}
        args.rounds = args.min_rounds = 2
    else:
        # Equal tokens per step at both lengths (2 x 512, 1 x 1024).
        args.config = {"d_model": 384, "heads": 6, "layers": 12, "batch": {512: 2, 1024: 1}}
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = out_dir(args)
    if args.render:  # redraw from an earlier run's JSON (no timing)
        res = json.loads((out / "checkpointing.json").read_text())
        results = {T: r if "policies" in r else {"policies": r} for T, r in res["results"].items()}
        plot(results, out / "checkpointing.png")
        return 0
    cfg, device = args.config, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    load_before = os.getloadavg()[0]
    with torch_threads(args.threads):
        torch.manual_seed(0)
        base = GPT(vocab=256, d=cfg["d_model"], h=cfg["heads"], layers=cfg["layers"], max_len=1024)
        base = base.to(device)
        results = {}
        for T, batch in cfg["batch"].items():
            idx = torch.randint(0, 256, (batch, T), device=device)
            results[T] = run_length(base, idx, args)
        meta = run_meta("bench_checkpointing.py", argv, load_before, str(device))
    res = {"meta": meta, "config": cfg, "results": results, "checks": checks(results)}
    code = write_results(out, "checkpointing", res, markdown(res))
    plot(results, out / "checkpointing.png")
    return code


if __name__ == "__main__":
    steady_malloc()
    raise SystemExit(main())
