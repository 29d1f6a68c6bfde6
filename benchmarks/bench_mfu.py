"""Model FLOPs utilisation: achieved model FLOP/s of a training step against the measured peak.

Peak: the best FLOP/s of matmuls (torch.mm with each operand storage order, and F.linear: on
the CPU they take different kernels) in fp32 and bf16, large squares and the model's own
shapes, on the same threads and clock as the steps, measured before and after the steps.
Model FLOPs per step: torch.utils.flop_counter.FlopCounterMode over one full step (forward +
backward; matmuls and attention, as MFU counts them). MFU = FLOPs per step / seconds per step
/ peak, for the plain loop and the isotrain step (bench_trainer's variants), fp32 and bf16
autocast, on the `small` preset's model (6 layers, d 384, T 256). Rounds interleave the two
variants.

On CPUs without native bf16 (AVX2 only, e.g. AMD Zen 3) PyTorch multiplies bf16 in a portable
kernel whose speed depends on the operands' storage order (see the peak table): the plain
loop's nn.Linear gets the slow orders, isotrain's trainer converts its layers to
isotrain.Bf16Linear, which takes the fast one. The default batch is 2 (not the preset's 16)
to keep a plain bf16 step near 10 s.

    .venv/bin/python benchmarks/bench_mfu.py          # ~3-4 minutes on 2 shared cores
    .venv/bin/python benchmarks/bench_mfu.py --quick  # seconds, a smoke run

Writes benchmarks/results/mfu.{md,json,png}.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from bench_trainer import (
    CLOCKS,
    RESULTS,
    SMALL,
    Shape,
    Variant,
    command_line,
    default_clock,
    fmt_ci,
    interleave,
    machine,
    machine_line,
    make_variants,
    paired_ratios,
    summarize,
    train_config,
    write_results,
)

DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _timed(fn: Any, device: torch.device, clock: str) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    now = time.process_time if clock == "cpu" else time.perf_counter
    t0 = now()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return now() - t0


def matmul_peak(
    precision: str,
    *,
    device: str = "cpu",
    sizes: tuple[int | tuple[int, int, int], ...],
    reps: int,
    clock: str,
) -> dict[str, Any]:
    """Best FLOP/s over mm (each operand storage order) and F.linear at each size.

    A size is n (square) or (m, k, n), such as the model's own products. Each op's figure is
    the fastest of `reps` runs; the peak is the best of them all.
    """
    dev, dtype = torch.device(device), DTYPE[precision]
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for size in sizes:
        m, k, n = size if isinstance(size, tuple) else (size, size, size)
        a = torch.randn(m, k, device=dev, dtype=dtype, generator=gen)
        b = torch.randn(k, n, device=dev, dtype=dtype, generator=gen)
        bias = torch.zeros(n, device=dev, dtype=dtype)
        a_col, b_col = a.t().contiguous().t(), b.t().contiguous().t()  # column-major storage
        ops = {
            "mm": (torch.mm, (a, b)),
            "mm A col-major": (torch.mm, (a_col, b)),
            "mm B col-major": (torch.mm, (a, b_col)),
            "mm both col-major": (torch.mm, (a_col, b_col)),
            "linear": (F.linear, (a, b_col.t(), bias)),
        }
        label = f"{m}x{k}x{n}" if (m, k) != (n, n) else str(n)
        for op, (f, inputs) in ops.items():
            fn = functools.partial(f, *inputs)
            fn()  # warm-up: kernel selection, packing
            best = min(_timed(fn, dev, clock) for _ in range(reps))
            rows.append({"op": op, "n": label, "tflops": 2 * m * k * n / best / 1e12})
    peak = max(rows, key=lambda r: r["tflops"])
    return {"precision": precision, "peak_tflops": peak["tflops"], "best": peak, "all": rows}


def step_flops(v: Variant) -> dict[str, Any]:
    """FLOPs of one full training step (forward + backward + update) by FlopCounterMode."""
    counter = FlopCounterMode(display=False)
    with counter:
        v.step()
    v.sync()
    by_op = {str(k): n for k, n in counter.get_flop_counts()["Global"].items()}
    return {"total": counter.get_total_flops(), "by_op": by_op}


def mfu_for(
    precision: str, shape: Shape, args: argparse.Namespace, measure_peak: Any
) -> dict[str, Any]:
    """Time both variants between two peak measurements; MFU is against the higher peak.

    A busy moment during one peak measurement would understate the peak (and overstate MFU),
    so the peak is measured before and after the steps and the better one is used.
    """
    cfg = train_config(shape, device=args.device, precision=precision)
    variants = make_variants(["plain", "isotrain"], cfg, args.threads)
    flops = {n: step_flops(v) for n, v in variants.items()}
    before = measure_peak()
    timing = interleave(variants, rounds=args.rounds, steps=args.steps, warmup=0, first_warmup=1)
    after = measure_peak()
    peak = max(before, after, key=lambda p: p["peak_tflops"])
    print(f"{precision} peak {peak['peak_tflops'] * 1e3:.2f} GFLOP/s", flush=True)
    times = timing[args.clock]
    out: dict[str, Any] = {"precision": precision, "peak": peak, "flops": flops, "variants": {}}
    out["peak_before_after_tflops"] = [before["peak_tflops"], after["peak_tflops"]]
    ratios = paired_ratios(times)
    for name, secs in times.items():
        f = flops[name]["total"]
        per_round = [f * args.steps / s / 1e12 / peak["peak_tflops"] for s in secs]
        out["variants"][name] = {
            "s_per_step": statistics.median(secs) / args.steps,
            "tflops": f * args.steps / statistics.median(secs) / 1e12,
            "mfu": summarize(per_round),
            "mfu_per_round": per_round,
            "ratio_to_plain": summarize(ratios[name]) if name in ratios else None,
        }
    return out


def markdown(res: dict[str, Any]) -> str:
    m, a = res["meta"], res["args"]
    lines = [
        "# Model FLOPs utilisation (MFU)",
        "",
        f"Command: `{m['command']}`  ",
        f"Machine: {machine_line(m)}  ",
        f"Model: GPT, {res['shape']}, fused AdamW; {a['rounds']} interleaved rounds of "
        f"{a['steps']} step(s). Peak: the higher of two measurements, before and after the "
        "steps. FLOPs per step: FlopCounterMode over forward + backward. "
        f"Clock: {CLOCKS[a['clock']]}.",
        "",
        "| precision | measured matmul peak | model GFLOP/step | variant | s/step | achieved "
        "TFLOP/s | MFU % (median [IQR; 95% CI]) | speed ratio to plain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["runs"]:
        p = r["peak"]
        peak = f"{p['peak_tflops'] * 1e3:.1f} GFLOP/s ({p['best']['op']}, {p['best']['n']})"
        for name, v in r["variants"].items():
            gf = r["flops"][name]["total"] / 1e9
            mfu = {k: 100 * x if isinstance(x, float) else x for k, x in v["mfu"].items()}
            ratio = v["ratio_to_plain"]
            lines.append(
                f"| {r['precision']} | {peak} | {gf:.1f} | {name} | {v['s_per_step']:.3f} "
                f"| {v['tflops']:.4f} | {fmt_ci(mfu, 1)} | "
                + (f"{ratio['median']:.3f}" if ratio else "1")
                + " |"
            )
    lines += ["", "Matmul peak measurements (GFLOP/s, best of the reps):", ""]
    lines += ["| precision | op | size (n or MxKxN) | GFLOP/s |", "|---|---|---|---|"]
    for r in res["runs"]:
        for row in r["peak"]["all"]:
            lines.append(
                f"| {r['precision']} | {row['op']} | {row['n']} | {row['tflops'] * 1e3:.2f} |"
            )
    lines += ["", *res["notes"], ""]
    return "\n".join(lines)


def verdicts(res: dict[str, Any]) -> list[str]:
    out = []
    for r in res["runs"]:
        iso = r["variants"]["isotrain"]["mfu"]["median"] * 100
        plain = r["variants"]["plain"]["mfu"]["median"] * 100
        line = f"- {r['precision']}: isotrain MFU {iso:.1f}%, plain {plain:.1f}%"
        if r["precision"] == "bf16":
            line += " -> target (isotrain >= 45% of the bf16 peak) " + (
                "met" if iso >= 45 else "not met"
            )
        out.append(line + ".")
    return out


def run(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    shape = dataclasses.replace(
        SMALL,
        batch_size=args.batch,
        n_layer=args.layers,
        d_model=args.d_model,
        n_head=args.heads,
        block_size=args.block,
    )
    runs = []
    for precision in args.precisions.split(","):
        sizes = args.bf16_sizes if precision != "fp32" and args.device == "cpu" else args.sizes
        m, d = args.batch * args.block, args.d_model  # the model's own products, fwd and bwd
        sizes = [*sizes, (m, d, 4 * d), (m, 4 * d, d), (d, m, 4 * d)]
        measure = functools.partial(
            matmul_peak,
            precision,
            device=args.device,
            sizes=tuple(sizes),
            reps=args.peak_reps,
            clock=args.clock,
        )
        runs.append(mfu_for(precision, shape, args, measure))
    meta = machine(args.device)
    meta.update(
        load_before=round(load_before, 2),
        load_after=meta.pop("load_avg_1m"),
        command=command_line("bench_mfu.py", argv),
    )
    res = {"meta": meta, "args": vars(args), "shape": shape.label(), "runs": runs}
    res["notes"] = verdicts(res)
    return res


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="seconds-long smoke run")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--layers", type=int, default=SMALL.n_layer)
    p.add_argument("--heads", type=int, default=SMALL.n_head)
    p.add_argument("--d-model", type=int, default=SMALL.d_model)
    p.add_argument("--block", type=int, default=SMALL.block_size)
    p.add_argument("--batch", type=int, default=2, help="the preset's is 16; see the docstring")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=1, help="timed steps per variant per round")
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048], help="peak matmul n")
    p.add_argument("--bf16-sizes", type=int, nargs="+", default=[512, 1024], help="CPU bf16 n")
    p.add_argument("--peak-reps", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=["cpu", "wall"], default=None, help="default: cpu on CPU")
    p.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    args = p.parse_args(argv)
    args.clock = args.clock or default_clock(args.device, args.threads)
    if args.quick:
        args.layers, args.heads, args.d_model, args.block, args.batch = 2, 2, 64, 64, 2
        args.rounds, args.sizes, args.bf16_sizes, args.peak_reps = 2, [256], [128], 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    res = run(args, argv)
    stem = "mfu_quick" if args.quick else "mfu"
    write_results(args.out, stem, res, markdown(res))
    plot(res, args.out / f"{stem}.png")


def plot(res: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels, values = [], []
    for r in res["runs"]:
        for name, v in r["variants"].items():
            labels.append(f"{name}\n{r['precision']}")
            values.append(100 * v["mfu"]["median"])
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(labels, values, color=["#888", "#3a7"] * len(res["runs"]))
    ax.set_ylabel("MFU % of measured matmul peak")
    ax.set_title(f"MFU ({res['shape']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
