"""Training throughput: the isotrain step against plain loops, Lightning Fabric and Accelerate.

The loops are those of loops.py: `plain` (tuned: parameter list kept, fused AdamW, grads set
to None) is the reference of every ratio; `nanogpt` (nanoGPT's loop as written) stands beside
it. Same model, seed, batches, optimizer groups, LR schedule and clipping; fp32 by default.

Rounds interleave the variants, one step each (the order rotates), so neighbouring steps share
the machine's state and its slow drift cancels in the per-round paired ratio. Rounds continue
until every ratio's 95% interval is within +-2% of its median (stats.Stopper), between
--min-rounds and --rounds. One torch thread and process CPU time by default (a shared machine).

    python benchmarks/bench_trainer.py            # ~5-15 minutes on 2 cores, tiny preset
    python benchmarks/bench_trainer.py --quick    # seconds: a smoke run into a temp dir

Writes trainer.{md,json,png} into benchmarks/results/<cpu-kind>/. Checks: every loop starts
from the same loss and ends at the same loss (they train alike), and the guard skipped nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

from common import (
    CLOCKS,
    add_common_args,
    check,
    checks_md,
    default_clock,
    machine_line,
    out_dir,
    run_meta,
    steady_malloc,
    torch_threads,
    write_results,
)
from figures import dot_plot, pyplot
from loops import (
    EARLIER_REFERENCE,
    QUICK,
    REFERENCE,
    TINY,
    Shape,
    interleave,
    loss_check,
    losses,
    make_variants,
    skipped,
)
from loops import train_config as make_config
from stats import Stopper, fmt_ci, half_width, judge, paired_ratios, summarize

VARIANTS = "plain,nanogpt,isotrain,fabric,accelerate"
COLUMNS = [
    "variant",
    "tokens/s (median)",
    "ms/step",
    "speed vs plain, paired per round [95% CI]",
    "CI half-width",
    "wall tokens/s",
]
# NOTE [loss tolerance]: isotrain runs plain's kernels in plain's order, so it must end bit for
# bit where plain ends (checked exactly). nanoGPT's CPU AdamW is the for-loop kernel and Fabric
# clips through its own path: their rounding differs from the first step and, over hundreds of
# rounds, compounds to about 1% of the loss (a broken loop differs by far more).
LOSS_TOL = {"fp32": 2e-2, "bf16": 3e-2, "fp16": 3e-2}


def throughput(
    times: dict[str, list[float]], wall: dict[str, list[float]], tokens: int, *, steps: int = 1
) -> dict[str, dict[str, Any]]:
    """Per variant: median tokens/s and ms/step, and the paired speed ratio to plain.

    `times` and `wall` hold seconds per round of `steps` steps (the clock used, and wall time).
    """
    ratios = paired_ratios(times, "plain") if "plain" in times else {}
    out: dict[str, dict[str, Any]] = {}
    for name, secs in times.items():
        per_step = statistics.median(secs) / steps
        out[name] = {
            "tokens_per_s": tokens / per_step,
            "ms_per_step": 1e3 * per_step,
            "wall_tokens_per_s": tokens * steps / statistics.median(wall[name]),
            "seconds_per_round": secs,
        }
        if name in ratios:
            out[name]["ratio"] = summarize(ratios[name])
            out[name]["ratio_per_round"] = ratios[name]
    return out


def table(variants: dict[str, Any]) -> list[str]:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for name, r in variants.items():
        ratio = r.get("ratio")
        cell = fmt_ci(ratio) if ratio else "1 (reference)"
        hw = f"+-{100 * half_width(ratio):.1f}%" if ratio else ""
        lines.append(
            f"| {name} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.1f} | {cell} | {hw} "
            f"| {r['wall_tokens_per_s']:,.0f} |"
        )
    return lines


def verdicts(res: dict[str, Any]) -> list[str]:
    v = res["variants"]
    if "isotrain" not in v or "plain" not in v:
        return []
    iso = v["isotrain"]["ratio"]
    lines = [
        f"- isotrain vs the tuned plain loop: {fmt_ci(iso)} -> target (>= 1.0x) {judge(iso, 1.0)}."
    ]
    for peer in ("nanogpt", "fabric", "accelerate"):
        if peer in v:
            lines.append(f"- {peer} vs the tuned plain loop: {fmt_ci(v[peer]['ratio'])}.")
    return lines


def markdown(res: dict[str, Any]) -> str:
    m, a = res["meta"], res["args"]
    stop = res["stopping"]
    lines = [
        "# Training throughput: isotrain vs plain loops, Lightning Fabric, Accelerate",
        "",
        f"Command: `{m['command']}`  ",
        f"Machine: {machine_line(m)}  ",
        f"Model: GPT, {res['shape']} ({res['params']:,} parameters), {a['precision']}, "
        f"AdamW, clip 1.0, device {a['device']}. {stop['rounds']} interleaved rounds (order "
        f"rotating) of one step per variant; {stop['reason']}.",
        "",
        f"Clock: {CLOCKS[a['clock']]}. `plain` is the tuned loop (parameter list kept, fused "
        "AdamW, grads set to None), the reference of every ratio; `nanogpt` is nanoGPT's loop "
        "as written (`clip_grad_norm_(model.parameters())`, AdamW fused only on CUDA).",
        "",
        *table(res["variants"]),
        "",
        *res["notes"],
        "",
        *checks_md(res["checks"]),
    ]
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    rows = {n: r["ratio"] for n, r in res["variants"].items() if "ratio" in r}
    if plt is None or not rows:
        return
    fig, ax = plt.subplots(figsize=(6.5, 0.7 * len(rows) + 1.4))
    ref = res.get("reference", EARLIER_REFERENCE)
    dot_plot(ax, rows, ref=1.0, xlabel=f"tokens/s relative to {ref} (1 = same)")
    ax.set_title(f"median and 95% CI of per-round paired ratios\n{res['shape']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    shape = Shape(
        n_layer=args.layers,
        n_head=args.heads,
        d_model=args.d_model,
        block_size=args.block,
        batch_size=args.batch,
    )
    cfg = make_config(shape, device=args.device, precision=args.precision)
    load_before = os.getloadavg()[0]
    variants = make_variants(args.variants.split(","), cfg)
    before = losses(variants)
    times: dict[str, dict[str, list[float]]] = {}
    stopper = Stopper(
        lambda: paired_ratios(times.get(args.clock, {"plain": []}), "plain"),
        min_rounds=min(args.min_rounds, args.rounds),
        max_rounds=args.rounds,
    )

    def progress(r: int, row: dict[str, float]) -> None:
        cells = " ".join(f"{n} {shape.tokens / t:,.0f}" for n, t in row.items())
        print(f"round {r + 1} tok/s: {cells}", flush=True)

    times.update(
        interleave(variants, rounds=args.rounds, until=stopper, on_round=progress, first_warmup=2)
    )
    after = losses(variants)
    exact = ("isotrain",) if args.precision == "fp32" else ()
    ok, detail = loss_check(before, after, rel_tol=LOSS_TOL[args.precision], exact=exact)
    skips = skipped(variants)
    res: dict[str, Any] = {
        "meta": run_meta("bench_trainer.py", argv, load_before, args.device),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "shape": shape.label(),
        "reference": REFERENCE,
        "params": sum(p.numel() for p in next(iter(variants.values())).raw_model().parameters()),
        "variants": throughput(times[args.clock], times["wall"], shape.tokens),
        "stopping": stopper.record(len(times[args.clock]["plain"])),
        "losses": {"before": before, "after": after},
        "skipped": skips,
        "checks": {
            "equal losses": check(ok, detail),
            "no skipped steps": check(not any(skips.values()), f"skipped per variant: {skips}"),
        },
    }
    missing = [n for n in args.variants.split(",") if n not in variants]
    res["notes"] = verdicts(res) + (
        [f"- Not run (library missing): {', '.join(missing)}."] if missing else []
    )
    return res


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--variants", default=VARIANTS)
    p.add_argument("--rounds", type=int, default=400, help="the most rounds")
    p.add_argument("--min-rounds", type=int, default=60, help="rounds before the first CI check")
    p.add_argument("--layers", type=int, default=TINY.n_layer)
    p.add_argument("--heads", type=int, default=TINY.n_head)
    p.add_argument("--d-model", type=int, default=TINY.d_model)
    p.add_argument("--block", type=int, default=TINY.block_size)
    p.add_argument("--batch", type=int, default=TINY.batch_size)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--clock", choices=["cpu", "wall"], default=None, help="default: cpu on CPU")
    p.add_argument("--render", action="store_true", help="only redraw the png from the JSON")
    args = p.parse_args(argv)
    args.clock = args.clock or default_clock(args.device, args.threads)
    if args.quick:
        q = QUICK
        args.layers, args.heads, args.d_model, args.block, args.batch = (
            q.n_layer, q.n_head, q.d_model, q.block_size, q.batch_size
        )  # fmt: skip
        args.rounds = args.min_rounds = 3
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = out_dir(args)
    if args.render:  # redraw from an earlier run's JSON (no timing)
        plot(json.loads((out / "trainer.json").read_text()), out / "trainer.png")
        return 0
    with torch_threads(args.threads):
        res = run(args, argv)
    code = write_results(out, "trainer", res, markdown(res))
    plot(res, out / "trainer.png")
    return code


if __name__ == "__main__":
    steady_malloc()
    raise SystemExit(main())
