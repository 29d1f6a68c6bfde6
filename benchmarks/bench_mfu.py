"""Model FLOPs utilisation against the hardware, and which precision is fastest on this core.

MFU = model FLOPs per step / seconds per step / the core's peak. The peak is the best matmul
rate this core reaches in any dtype it has (fp32, bf16, fp16): torch.mm with each operand
storage order and F.linear, at large squares and at the model's own products, on the same
threads and clock as the steps, measured before and after the steps (the better of the two
per entry). The table names the peak (dtype, op, shape) and lists each dtype's own best beside
it, so a dtype whose kernels are slow on this core (bf16 on AVX2-only x86) is not measured
against its own slowness. Model FLOPs per step: FlopCounterMode over one full step.

The tuned plain loop and the isotrain step run in fp32, in bf16 autocast and in bf16-matmul
(bf16 autocast with attention in fp32, `autocast_if_available(attention="fp32")`), all six
interleaved in one set of one-step rounds (order rotating), so every comparison is paired,
fp32 against each bf16 mode included. Rounds continue until each ratio's 95% interval is within +-2%
(stats.Stopper). Model: the `small` preset's shape (6 layers, d 384, T 256) at batch 2, dropout
off (so the loops compute the same losses, which is checked).

    python benchmarks/bench_mfu.py          # ~5-15 minutes on 2 cores (slowest on AVX2)
    python benchmarks/bench_mfu.py --quick  # seconds, a smoke run into a temp dir
    python benchmarks/bench_mfu.py --subnormals keep   # IEEE subnormals: mfu-subnormals.*

Writes mfu.{md,json,png} into benchmarks/results/<cpu-kind>/.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from common import (
    CLOCKS,
    add_common_args,
    check,
    checks_md,
    clock,
    default_clock,
    machine_line,
    out_dir,
    run_meta,
    steady_malloc,
    torch_threads,
    write_results,
)
from figures import pyplot
from isotrain.contexts import flush_subnormals
from loops import SMALL, VARIANTS, Variant, build, interleave, loss_check, losses, skipped
from loops import train_config as make_config
from stats import Stopper, fmt_ci, paired_ratios, summarize

DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COLUMNS = [
    "precision",
    "loop",
    "ms/step [95% CI]",
    "tokens/s",
    "model GFLOP/step",
    "achieved GFLOP/s",
    "MFU % of the core peak [95% CI]",
    "this dtype's best matmul, GFLOP/s",
    "speed vs plain, same precision [95% CI]",
]
LOSS_TOL = {"fp32": 1e-3, "bf16": 2e-2, "bf16-matmul": 2e-2, "fp16": 2e-2}
MATMUL_DTYPE = {"bf16-matmul": "bf16"}  # whose matmul peak a precision is measured against


# ---------------------------------------------------------------------------------- peaks
def _ops(m: int, k: int, n: int, dtype: torch.dtype, gen: torch.Generator) -> dict[str, Any]:
    dev = gen.device
    a = torch.randn(m, k, dtype=dtype, generator=gen, device=dev)
    b = torch.randn(k, n, dtype=dtype, generator=gen, device=dev)
    bias = torch.zeros(n, dtype=dtype, device=dev)
    a_col, b_col = a.t().contiguous().t(), b.t().contiguous().t()  # column-major storage
    return {
        "mm": functools.partial(torch.mm, a, b),
        "mm A col-major": functools.partial(torch.mm, a_col, b),
        "mm B col-major": functools.partial(torch.mm, a, b_col),
        "mm both col-major": functools.partial(torch.mm, a_col, b_col),
        "linear": functools.partial(F.linear, a, b_col.t(), bias),
    }


def matmul_rates(
    precision: str,
    sizes: list[tuple[int, int, int]],
    *,
    reps: int,
    clock_name: str,
    budget: float,
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """GFLOP/s of each op at each (m, k, n), the fastest of `reps` runs.

    An op whose estimated run (from its rate at an earlier size) exceeds `budget` seconds is
    left out at that size and says so: emulated kernels can be 100x slower than the best.
    """
    gen = torch.Generator(device=device).manual_seed(0)
    cuda = torch.device(device).type == "cuda"
    tick = clock(clock_name)

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()  # sync: timing boundary
        return tick()

    rows: list[dict[str, Any]] = []
    rate: dict[str, float] = {}  # op -> GFLOP/s at the last size measured
    for m, k, n in sizes:
        label = str(n) if m == k == n else f"{m}x{k}x{n}"
        flop = 2 * m * k * n
        for op, fn in _ops(m, k, n, DTYPE[precision], gen).items():
            if op in rate and flop / (rate[op] * 1e9) > budget:
                rows.append({"dtype": precision, "op": op, "n": label, "gflops": None})
                continue
            fn()  # warm-up: kernel selection, packing
            best = float("inf")
            for _ in range(reps):
                t0 = now()
                fn()
                best = min(best, now() - t0)
                if best > budget:
                    break
            rate[op] = flop / best / 1e9
            rows.append({"dtype": precision, "op": op, "n": label, "gflops": rate[op]})
    return rows


def peaks(args: argparse.Namespace, before: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Every dtype's matmul rates; with `before`, the better of the two per entry."""
    m, d = args.batch * args.block, args.d_model  # the model's own products, fwd and bwd
    sizes = [(n, n, n) for n in args.sizes] + [(m, d, 4 * d), (m, 4 * d, d), (d, m, 4 * d)]
    rows = []
    for dt in args.peak_dtypes.split(","):
        rows += matmul_rates(dt, sizes, reps=args.peak_reps, clock_name=args.clock, budget=2.0)
    if before is not None:
        for row, old in zip(rows, before, strict=True):
            row["gflops"] = max((r for r in (row["gflops"], old["gflops"]) if r), default=None)
    return rows


def best_of(rows: list[dict[str, Any]], dtype: str | None = None) -> dict[str, Any]:
    ok = [r for r in rows if r["gflops"] and (dtype is None or r["dtype"] == dtype)]
    return max(ok, key=lambda r: r["gflops"])


def step_flops(v: Variant) -> float:
    """FLOPs of one full training step (forward + backward + update) by FlopCounterMode."""
    counter = FlopCounterMode(display=False)
    with counter:
        v.step()
    v.sync()
    return float(counter.get_total_flops())


# ------------------------------------------------------------------------------------ run
def run(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    shape = dataclasses.replace(
        SMALL, batch_size=args.batch, n_layer=args.layers, d_model=args.d_model,
        n_head=args.heads, block_size=args.block, dropout=0.0,
    )  # fmt: skip
    precisions, loops = args.precisions.split(","), args.loops.split(",")
    specs = {}
    for prec in precisions:
        cfg = make_config(shape, precision=prec)
        for loop in loops:
            specs[f"{loop} {prec}"] = (VARIANTS[loop], cfg)
    variants = build(specs)
    before = losses(variants)
    flops = {n: step_flops(v) for n, v in variants.items()}
    first = peaks(args, None)
    times: dict[str, dict[str, list[float]]] = {}
    stopper = Stopper(
        lambda: tracked(times.get(args.clock, {}), precisions, loops),
        min_rounds=min(args.min_rounds, args.rounds),
        max_rounds=args.rounds,
        check_every=5,
    )
    times.update(interleave(variants, rounds=args.rounds, until=stopper, first_warmup=1))
    rows = peaks(args, first)
    after = losses(variants)
    res: dict[str, Any] = {
        "meta": run_meta("bench_mfu.py", argv, load_before),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "shape": shape.label(),
        "tokens_per_step": shape.tokens,
        "peaks": rows,
        "core_peak": best_of(rows),
        "dtype_peaks": {dt: best_of(rows, dt) for dt in {r["dtype"] for r in rows}},
        "flops": flops,
        "variants": variants_table(times[args.clock], flops, best_of(rows)["gflops"], shape.tokens),
        "stopping": stopper.record(len(next(iter(times[args.clock].values())))),
        "losses": {"before": before, "after": after},
    }
    ratios = tracked(times[args.clock], precisions, loops)
    res["ratios"] = {k: summarize(v) for k, v in ratios.items()}
    res["checks"] = checks(before, after, precisions, skipped(variants))
    res["notes"] = verdicts(res)
    return res


def tracked(
    times: dict[str, list[float]], precisions: list[str], loops: list[str]
) -> dict[str, list[float]]:
    """The paired ratios the stopping rule watches and the table reports."""
    if not times or not next(iter(times.values())):
        return {}
    out = {}
    for prec in precisions:
        for loop in (x for x in loops if x != "plain"):
            pair = {k: times[f"{k} {prec}"] for k in ("plain", loop)}
            out[f"{loop} vs plain, {prec}"] = paired_ratios(pair, "plain")[loop]
    for prec in precisions[1:] if "isotrain" in loops else []:  # relative to the first (fp32)
        pair = {k: times[f"isotrain {k}"] for k in (precisions[0], prec)}
        out[f"isotrain {prec} vs {precisions[0]}"] = paired_ratios(pair, precisions[0])[prec]
    return out


def variants_table(
    times: dict[str, list[float]], flops: dict[str, float], peak: float, tokens: int
) -> dict[str, Any]:
    out = {}
    for name, secs in times.items():
        per_round = [100 * flops[name] / s / 1e9 / peak for s in secs]
        out[name] = {
            "s_per_step": summarize(secs),
            "tokens_per_s": tokens / statistics.median(secs),
            "gflops": flops[name] / statistics.median(secs) / 1e9,
            "mfu_pct": summarize(per_round),
            "seconds_per_round": secs,
        }
    return out


def checks(
    before: dict[str, float], after: dict[str, float], precisions: list[str], skips: dict[str, int]
) -> dict[str, Any]:
    out = {}
    for prec in precisions:
        keys = [k for k in before if k.endswith(f" {prec}")]
        ok, detail = loss_check(
            {k: before[k] for k in keys}, {k: after[k] for k in keys}, rel_tol=LOSS_TOL[prec]
        )
        out[f"equal losses, {prec}"] = check(ok, detail)
    out["no skipped steps"] = check(not any(skips.values()), f"skipped per variant: {skips}")
    return out


# --------------------------------------------------------------------------------- report
def fastest(res: dict[str, Any]) -> tuple[str, float]:
    name = min(res["variants"], key=lambda n: res["variants"][n]["s_per_step"]["median"])
    return name, res["variants"][name]["s_per_step"]["median"]


def verdicts(res: dict[str, Any]) -> list[str]:
    name, secs = fastest(res)
    lines = [f"- Fastest on this machine: **{name}** ({1e3 * secs:.1f} ms/step)."]
    lines += [
        f"- {k}: {fmt_ci(s)} (speed ratio, paired per round)." for k, s in res["ratios"].items()
    ]
    return lines


# Subnormals (NOTE [subnormals] in isotrain/contexts/_subnormals.py): as this model trains in
# fp32 they appear, and the fp32 step of this shape went from 320 to over 600 ms between steps 50
# and 100, while bf16 dot products flush them in hardware (mfu-subnormals.md, `--subnormals
# keep`). By default every loop runs inside flush_subnormals(): the table then times kernels,
# not microcode assists, and fp32 against bf16 is not decided by how long the run has trained.
SUBNORMALS = {
    "flush": "flushed to zero in every loop (`isotrain.flush_subnormals`, one torch thread)",
    "keep": "kept (IEEE default): the fp32 step slows as they appear (NOTE [subnormals])",
}


def markdown(res: dict[str, Any]) -> str:
    m, a, peak = res["meta"], res["args"], res["core_peak"]
    lines = [
        "# Model FLOPs utilisation (MFU) against the core's peak",
        "",
        f"Command: `{m['command']}`  ",
        f"Machine: {machine_line(m)}  ",
        f"Model: GPT, {res['shape']}, dropout 0, AdamW, clip 1.0; "
        f"{res['stopping']['rounds']} interleaved rounds of one step per loop; "
        f"{res['stopping']['reason']}. Clock: {CLOCKS[a['clock']]}. "
        f"Subnormals: {SUBNORMALS[a.get('subnormals', 'keep')]}.",
        "",
        f"**Core peak (the MFU denominator): {peak['gflops']:.1f} GFLOP/s** "
        f"({peak['dtype']} {peak['op']}, {peak['n']}): the best matmul rate measured on this "
        "core in any dtype, before and after the steps.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for name, v in res["variants"].items():
        loop, prec = name.split(" ")
        own = res["dtype_peaks"][MATMUL_DTYPE.get(prec, prec)]["gflops"]
        ratio = res["ratios"].get(f"{loop} vs plain, {prec}")
        lines.append(
            f"| {prec} | {loop} | {fmt_ci(v['s_per_step'], 1, scale=1e3)} "
            f"| {v['tokens_per_s']:,.0f} "
            f"| {res['flops'][name] / 1e9:.1f} | {v['gflops']:.1f} | {fmt_ci(v['mfu_pct'], 1)} "
            f"| {own:.1f} | {fmt_ci(ratio) if ratio else '1 (reference)'} |"
        )
    lines += ["", *res["notes"], "", "Matmul rates (GFLOP/s, the better of before and after):"]
    lines += ["", "| dtype | op | size (n or MxKxN) | GFLOP/s |", "|---|---|---|---|"]
    for r in res["peaks"]:
        rate = f"{r['gflops']:.2f}" if r["gflops"] else "not run (estimated > 2 s)"
        lines.append(f"| {r['dtype']} | {r['op']} | {r['n']} | {rate} |")
    return "\n".join([*lines, "", *checks_md(res["checks"])])


def plot(res: dict[str, Any], path: Path) -> None:
    """Achieved GFLOP/s beside the core's and each dtype's peak; step time per loop."""
    plt = pyplot()
    if plt is None:
        return
    names = list(res["variants"])
    v = res["variants"]
    ys = list(range(len(names)))[::-1]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 0.55 * len(names) + 2.2))
    left.barh(ys, [v[n]["gflops"] for n in names], color="#3a7")
    core = res["core_peak"]
    where = f"{core['dtype']} {core['op']}, {core['n']}"
    left.axvline(
        core["gflops"], color="#c33", lw=1.5, label=f"core peak {core['gflops']:.1f} ({where})"
    )
    styles = iter([":", "--", "-."])
    for dt, p in sorted(res["dtype_peaks"].items()):
        if p["gflops"] == core["gflops"]:
            continue  # the core peak's own dtype: already drawn
        left.axvline(p["gflops"], color="#555", lw=1, ls=next(styles, ":"),
                     label=f"{dt} best {p['gflops']:.1f} ({p['op']}, {p['n']})")  # fmt: skip
    labels = [f"{n}\nMFU {v[n]['mfu_pct']['median']:.1f}%" for n in names]
    left.set_yticks(ys, labels, fontsize=8)
    left.set_xlabel("GFLOP/s (model FLOPs per second of step)", fontsize=9)
    left.legend(fontsize=7, loc="lower right")
    left.set_title("achieved rate against the measured peaks", fontsize=9)
    s = [v[n]["s_per_step"] for n in names]
    err = [[x["median"] - x["ci95_lo"] for x in s], [x["ci95_hi"] - x["median"] for x in s]]
    right.barh(ys, [x["median"] for x in s], xerr=err, color="#58b", capsize=3)
    right.set_yticks(ys, [f"{n}\n{1e3 * x['median']:.1f} ms" for n, x in zip(names, s)], fontsize=8)
    right.set_xlabel("seconds per step (median, 95% CI); shorter is faster", fontsize=9)
    right.set_title(f"fastest on this machine: {fastest(res)[0]}", fontsize=9)
    fig.suptitle(f"{res['shape']}; {res['meta']['cpu']} [{res['meta']['cpu_kind']}]", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument(
        "--precisions", default="fp32,bf16,bf16-matmul", help="step precisions, fp32 first"
    )
    p.add_argument(
        "--loops", default="plain,isotrain", help="plain first; nanogpt too if time allows"
    )
    p.add_argument("--peak-dtypes", default="fp32,bf16,fp16", help="dtypes for the core peak")
    p.add_argument("--layers", type=int, default=SMALL.n_layer)
    p.add_argument("--heads", type=int, default=SMALL.n_head)
    p.add_argument("--d-model", type=int, default=SMALL.d_model)
    p.add_argument("--block", type=int, default=SMALL.block_size)
    p.add_argument("--batch", type=int, default=2, help="the preset's is 16: kept small for time")
    p.add_argument("--rounds", type=int, default=120, help="the most rounds")
    p.add_argument("--min-rounds", type=int, default=20)
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048], help="square matmul n")
    p.add_argument("--peak-reps", type=int, default=3)
    p.add_argument(
        "--subnormals", choices=["flush", "keep"], default="flush", help="NOTE [subnormals]"
    )
    args = p.parse_args(argv)
    args.clock = default_clock("cpu", args.threads)
    if args.quick:
        args.layers, args.heads, args.d_model, args.block, args.batch = 2, 2, 64, 64, 2
        args.rounds = args.min_rounds = 2
        args.sizes, args.peak_reps = [128], 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = out_dir(args)
    stem = "mfu" if args.subnormals == "flush" else "mfu-subnormals"
    with torch_threads(args.threads), flush_subnormals(args.subnormals == "flush"):
        res = run(args, argv)
    code = write_results(out, stem, res, markdown(res))
    plot(res, out / f"{stem}.png")
    return code


if __name__ == "__main__":
    steady_malloc()
    raise SystemExit(main())
