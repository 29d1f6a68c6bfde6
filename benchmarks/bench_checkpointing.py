"""Activation checkpointing trade-off: saved-activation bytes against step time, per policy.

A 12-layer pre-LN GPT-like model (d_model 384, 6 heads) at sequence lengths 512 and 1024.
Bytes and FLOPs are exact (saved-tensor hooks, FlopCounterMode); step times are medians of
interleaved rounds, reported as ratios to the unwrapped model of the same round set.

    .venv/bin/python benchmarks/bench_checkpointing.py            # full run (~3-4 min idle)
    .venv/bin/python benchmarks/bench_checkpointing.py --quick    # seconds-long smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from isotrain.checkpointing import apply_activation_checkpointing, measure_activation_memory

POLICIES = ["none", "full", "every:2", "selective", "budget:50%"]
TARGETS = {"full": (0.85, 1.35), "selective": (0.40, 1.15)}  # min byte cut, max time ratio
RESULTS = Path(__file__).resolve().parent / "results"


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
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    loss_of(model(idx), idx).backward()
    if idx.is_cuda:
        torch.cuda.synchronize()  # sync: timing boundary
    return time.perf_counter() - t0


def run_length(base: GPT, idx: torch.Tensor, rounds: int) -> dict[str, dict]:
    """Wrap one copy per policy, measure bytes/FLOPs, then time interleaved rounds."""
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
            "peak_bytes": rep.peak_bytes,
            "times_s": [],
        }
    for r in range(rounds):
        order = POLICIES[r % len(POLICIES) :] + POLICIES[: r % len(POLICIES)]  # rotate
        for pol in order:
            out[pol]["times_s"].append(step_time(models[pol], idx))
    none = out["none"]
    base_flops = none["forward_flops"] + none["backward_flops"]
    for res in out.values():
        res["step_s_median"] = statistics.median(res["times_s"])
        # Pair each round with the unwrapped step of the same round: load drifts cancel.
        ratios = [t / b for t, b in zip(res["times_s"], none["times_s"], strict=True)]
        res["time_ratio"] = statistics.median(ratios)
        res["best_ratio"] = min(res["times_s"]) / min(none["times_s"])  # least-contended steps
        res["byte_cut"] = 1 - res["saved_bytes"] / none["saved_bytes"]
        flops = res["forward_flops"] + res["backward_flops"]
        res["recompute_flops"] = flops - base_flops  # the unwrapped run is the baseline
        res["flop_ratio"] = flops / base_flops
    return out


def verdicts(results: dict[int, dict]) -> list[str]:
    lines = []
    for pol, (cut, ratio) in TARGETS.items():
        for T, res in results.items():
            r = res[pol]
            ok_b, ok_t = r["byte_cut"] >= cut, r["time_ratio"] <= ratio
            lines.append(
                f"- `{pol}` at T={T}: bytes -{r['byte_cut']:.1%} (target >= {cut:.0%}: "
                f"{'met' if ok_b else 'MISSED'}), time x{r['time_ratio']:.2f} (target <= "
                f"x{ratio:.2f}: {'met' if ok_t else 'MISSED'}; best-step ratio "
                f"x{r['best_ratio']:.2f}), FLOPs x{r['flop_ratio']:.2f}"
            )
    return lines


def markdown(results: dict[int, dict], meta: dict) -> str:
    lines = [
        "# Activation checkpointing: saved bytes vs step time",
        "",
        f"Model: {meta['layers']} pre-LN blocks, d_model {meta['d_model']}, {meta['heads']} heads,"
        f" batch per length {meta['batch']}, fp32 on {meta['device']} ({meta['threads']} threads). "
        f"Rounds: {meta['rounds']}. Load average before/after: {meta['load_before']} / "
        f"{meta['load_after']}.",
        "",
        f"Command: `{meta['command']}`",
        "",
        "| T | policy | ckpt blocks | saved MB | bytes cut | step s | time x | best x | FLOPs x |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for T, res in results.items():
        for pol, r in res.items():
            lines.append(
                f"| {T} | {pol} | {r['checkpointed_blocks']} | {r['saved_bytes'] / 1e6:.1f} | "
                f"{r['byte_cut']:.1%} | {r['step_s_median']:.3f} | {r['time_ratio']:.2f} | "
                f"{r['best_ratio']:.2f} | {r['flop_ratio']:.2f} |"
            )
    lines += ["", "Targets (benchmark goals, not tests):", *verdicts(results), ""]
    lines.append(
        "`step s`: median step time; `time x`: median over rounds of the step time divided by "
        "the unwrapped step of the same round; `best x`: fastest step over fastest unwrapped step. "
        "Bytes and FLOPs are exact and deterministic; step-time ratios carry the noise of a "
        "shared machine (see the load average), so read them with the FLOPs ratio beside them."
    )
    return "\n".join(lines) + "\n"


def plot(results: dict[int, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for T, res in results.items():
        xs = [r["time_ratio"] for r in res.values()]
        ys = [r["saved_bytes"] / 1e6 for r in res.values()]
        (line,) = ax.plot(xs, ys, "o", label=f"T={T}: measured step time")
        fl = [r["flop_ratio"] for r in res.values()]
        ax.plot(fl, ys, "x", color=line.get_color(), label=f"T={T}: FLOPs (noise-free)")
        for pol, x, y in zip(res, xs, ys, strict=True):
            ax.annotate(pol, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel("ratio to the unwrapped model (step time: median of paired rounds)")
    ax.set_ylabel("activation bytes saved for backward (MB)")
    ax.set_title("Activation checkpointing: memory vs time per policy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, one round: a smoke run")
    ap.add_argument("--rounds", type=int, default=6, help="rounds at T=512 (one less at 1024)")
    ap.add_argument("--out", type=Path, default=None, help="results dir (quick: a temp dir)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.quick:
        cfg = {"d_model": 64, "heads": 2, "layers": 2, "batch": {64: 2, 128: 2}}
        rounds = {64: 1, 128: 1}
    else:
        # Equal tokens per step at both lengths (2 x 512, 1 x 1024): shorter steps, more rounds.
        cfg = {"d_model": 384, "heads": 6, "layers": 12, "batch": {512: 2, 1024: 1}}
        rounds = {512: args.rounds, 1024: max(1, args.rounds - 1)}
    torch.manual_seed(0)
    base = GPT(vocab=256, d=cfg["d_model"], h=cfg["heads"], layers=cfg["layers"], max_len=1024)
    base = base.to(device)
    load_before = os.getloadavg()[0]
    results = {}
    for T, batch in cfg["batch"].items():
        idx = torch.randint(0, 256, (batch, T), device=device)
        results[T] = run_length(base, idx, rounds[T])
    meta = {
        **cfg,
        "rounds": rounds,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_before": round(load_before, 1),
        "load_after": round(os.getloadavg()[0], 1),
        "command": "python benchmarks/bench_checkpointing.py" + (" --quick" if args.quick else ""),
    }
    out = args.out or (Path(tempfile.gettempdir()) / "isotrain-bench" if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    name = "checkpointing"
    text = markdown(results, meta)
    (out / f"{name}.md").write_text(text)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    plot(results, out / f"{name}.png")
    print(text)


if __name__ == "__main__":
    main()
