"""Where a training step goes, by op category: fp32, bf16 and bf16-matmul, eager and compiled.

The isotrain step (train_step, guard on) on the tiny preset in six variants: fp32, bf16
autocast and bf16-matmul (bf16 autocast with attention in fp32), each eager and with
per-block torch.compile (inductor, in place). Three parts:

1. Timing: interleaved one-step rounds (order rotating) until every ratio's 95% interval is
   within +-2% (stats.Stopper): tokens/s, each bf16 mode against fp32, compiled against eager,
   and the model FLOP rate against the best matmul rate of each dtype on this core.
2. Profile: torch.profiler over a few steps per variant. Each op's self CPU time goes to a
   category by its name (`category`): matmul, attention, norms and elementwise, casts and
   copies, compiled kernels (inductor's fused code, inside its compiled regions), and the
   optimizer (the whole update phase: guard, clip and AdamW, marked by a record_function
   range around the updater). What no op covers is "Python and framework" (the trainer's and
   autograd's own code). The profiler inflates small ops; the table gives the profiled and the
   unprofiled step time.
3. Ops: the step's big ops one by one, fp32 against bf16, forward and forward + backward, at
   the `small` preset's shapes (`op_times.py`): which ops gain from bf16 on this core, so
   whether bf16-matmul (attention kept in fp32) can beat both.

On a CPU with native bf16, bf16 matmuls are fast, so a step that is barely faster in bf16
spends its time outside the matmuls: the table says where.

    python benchmarks/bench_profile.py          # ~10 minutes on 2 cores (three inductor compiles)
    python benchmarks/bench_profile.py --quick  # seconds: "eager" compile backend, temp dir

Writes profile.{md,json,png} into benchmarks/results/<cpu-kind>/.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench_mfu import matmul_rates
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
from figures import pyplot
from isotrain.compile import compile_available
from loops import QUICK, TINY, Isotrain, build, interleave, skipped
from loops import train_config as make_config
from op_times import OP_SHAPE, QUICK_SHAPE, op_rows, op_table
from stats import Stopper, fmt_ci, paired_ratios, summarize

CATEGORIES = (
    "matmul",
    "attention",
    "norms & elementwise",
    "casts & copies",
    "compiled kernels",
    "optimizer",
    "Python & framework",
)
COLUMNS = ["variant", "ms/step (profiled)", *CATEGORIES]
MATMUL = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addmv", "mv", "dot", "layout_mm"}
CASTS = {"_to_copy", "to", "copy_", "clone", "contiguous", "_copy_from", "_copy_from_and_resize"}
UPDATE = "isotrain.update"
PRECISIONS = ("fp32", "bf16", "bf16-matmul")


def category(name: str) -> str | None:
    """The category of one profiler event; None for events that are not ops (Python, ranges)."""
    low = name.lower()
    if "compiled" in low or "cpp_fused" in low or "inductor" in low:
        return "compiled kernels"  # inductor's regions: their self time is its fused code
    if "::" not in name or low.startswith(("autograd::", "profiler", "isotrain.")):
        return None
    op = low.split("::", 1)[1]
    if op in MATMUL or "mkldnn" in low or "onednn" in low:
        return "matmul"
    if "attention" in op or "softmax" in op:
        return "attention"
    if op in CASTS:
        return "casts & copies"
    return "norms & elementwise"


def _inside(event: Any, name: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == name:
            return True
        parent = parent.cpu_parent
    return False


def split(events: Any, steps: int) -> dict[str, float]:
    """ms per step in each category (see the module docstring)."""
    out: dict[str, float] = defaultdict(float)
    total = update = 0.0
    for e in events:
        if e.name == "isotrain.step":
            total += e.cpu_time_total
        elif e.name == UPDATE:
            update += e.cpu_time_total
        elif (cat := category(e.name)) is not None and not _inside(e, UPDATE):
            out[cat] += e.self_cpu_time_total
    out["optimizer"] = update
    out["Python & framework"] = total - update - sum(v for k, v in out.items() if k != "optimizer")
    return {k: out.get(k, 0.0) / 1e3 / steps for k in CATEGORIES} | {"total": total / 1e3 / steps}


@contextlib.contextmanager
def marked_update(v: Isotrain) -> Iterator[None]:
    """Wrap this variant's updater.step in a record_function range, then take it off again."""
    updater, original = v.run.updater, v.run.updater.step

    def step(loss: torch.Tensor, i: int) -> Any:
        with record_function(UPDATE):
            return original(loss, i)

    updater.step = step  # type: ignore[method-assign]  # this instance only
    try:
        yield
    finally:
        del updater.step


def profile_variant(v: Isotrain, steps: int) -> dict[str, float]:
    with marked_update(v), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function("isotrain.step"):
                v.step()
    return split(prof.events(), steps)


# ------------------------------------------------------------------------------------ run
def specs(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    shape = QUICK if args.quick else TINY
    notes = []
    backend = args.backend
    ok, why = compile_available(backend, device="cpu")
    out = {}
    for prec in PRECISIONS:
        out[f"{prec} eager"] = (Isotrain, make_config(shape, precision=prec))
        if ok:
            out[f"{prec} compiled"] = (
                Isotrain, make_config(shape, precision=prec, compile_backend=backend)
            )  # fmt: skip
    if not ok:
        notes.append(f"- Compiled variants not run: backend {backend!r} cannot run here ({why}).")
    return {"shape": shape, "specs": out}, notes


def ratio_series(times: dict[str, list[float]]) -> dict[str, list[float]]:
    pairs = [
        (f"{p} {mode}", f"fp32 {mode}") for mode in ("eager", "compiled") for p in PRECISIONS[1:]
    ]
    pairs += [(f"{p} compiled", f"{p} eager") for p in PRECISIONS]
    out = {}
    for a, b in pairs:
        if a in times and b in times and times[a]:
            out[f"{a} vs {b}"] = paired_ratios({"b": times[b], "a": times[a]}, "b")["a"]
    return out


def run(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    plan, notes = specs(args)
    shape = plan["shape"]
    variants = build(plan["specs"])
    times: dict[str, dict[str, list[float]]] = {}
    stopper = Stopper(
        lambda: ratio_series(times.get(args.clock, {})),
        min_rounds=min(args.min_rounds, args.rounds),
        max_rounds=args.rounds,
    )
    times.update(interleave(variants, rounds=args.rounds, until=stopper, first_warmup=2))
    m, d = shape.batch_size * shape.block_size, shape.d_model
    sizes = [(n, n, n) for n in args.sizes] + [(m, d, 4 * d), (m, 4 * d, d)]
    peaks = {p: matmul_rates(p, sizes, reps=args.peak_reps, clock_name=args.clock, budget=2.0)
             for p in ("fp32", "bf16")}  # fmt: skip
    rows = {}
    for name, v in variants.items():
        secs = times[args.clock][name]
        rows[name] = {
            "ms_per_step": summarize([1e3 * s for s in secs]),
            "tokens_per_s": shape.tokens / statistics.median(secs),
            "profile_ms": profile_variant(v, args.profile_steps),  # type: ignore[arg-type]
        }
    skips = skipped(variants)
    shape_ops = QUICK_SHAPE if args.quick else OP_SHAPE
    ops = op_rows(shape_ops, rounds=args.op_rounds, clock_name=args.clock)
    res: dict[str, Any] = {
        "meta": run_meta("bench_profile.py", argv, load_before),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "shape": shape.label(),
        "variants": rows,
        "ratios": {k: summarize(v) for k, v in ratio_series(times[args.clock]).items()},
        "matmul_best_gflops": {
            p: max(r["gflops"] for r in rs if r["gflops"]) for p, rs in peaks.items()
        },
        "stopping": stopper.record(len(times[args.clock][next(iter(variants))])),
        "ops": {"shape": shape_ops, "rounds": args.op_rounds, "rows": ops},
        "checks": {
            "no skipped steps": check(not any(skips.values()), f"skipped per variant: {skips}"),
            "profile categories": check(*_adds_up(rows)),
        },
    }
    res["notes"] = notes + verdicts(res)
    return res


def _adds_up(rows: dict[str, Any]) -> tuple[bool, str]:
    """Every variant's profile found matmuls and an update phase, and no share is negative
    (ops counted twice, or from another thread, would push "Python & framework" below 0)."""
    bad = [
        n
        for n, r in rows.items()
        if r["profile_ms"]["matmul"] <= 0
        or r["profile_ms"]["optimizer"] <= 0
        or min(r["profile_ms"][c] for c in CATEGORIES) < 0
    ]
    return not bad, f"variants with a missing or negative share: {bad or 'none'}"


def verdicts(res: dict[str, Any]) -> list[str]:
    return [
        f"- {k}: {fmt_ci(s)} (speed ratio, paired per round)." for k, s in res["ratios"].items()
    ]


def markdown(res: dict[str, Any]) -> str:
    m, a = res["meta"], res["args"]
    lines = [
        "# Where the step goes: fp32, bf16 and bf16-matmul, eager and per-block compiled",
        "",
        f"Command: `{m['command']}`  ",
        f"Machine: {machine_line(m)}  ",
        f"Model: GPT, {res['shape']}, isotrain train_step (guard on). "
        f"{res['stopping']['rounds']} interleaved one-step rounds; {res['stopping']['reason']}. "
        f"Clock: {CLOCKS[a['clock']]}. Best matmul rate on this core (GFLOP/s, squares and the "
        "model's shapes): "
        + ", ".join(f"{p} {g:.1f}" for p, g in res["matmul_best_gflops"].items())
        + ".",
        "",
        "| variant | tokens/s | ms/step (unprofiled) [95% CI] |",
        "|---|---|---|",
        *(
            f"| {n} | {r['tokens_per_s']:,.0f} | {fmt_ci(r['ms_per_step'], 2)} |"
            for n, r in res["variants"].items()
        ),
        "",
        f"Profile: ms per step by category ({a['profile_steps']} profiled steps per variant; "
        "self CPU time of each op; optimizer = the whole update phase):",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for n, r in res["variants"].items():
        p = r["profile_ms"]
        cells = [f"{p[c]:.2f} ({100 * p[c] / p['total']:.0f}%)" for c in CATEGORIES]
        lines.append(f"| {n} | {p['total']:.2f} | " + " | ".join(cells) + " |")
    o = res["ops"]
    lines += ["", *res["notes"], "", f"Ops one by one ({_shape_words(o['shape'])}; {o['rounds']} "
              "interleaved rounds of one call each; each dtype's own tensors, no autocast "
              "casts; a time ratio: below 1, bf16 is faster):", "",
              *op_table(o["rows"], fmt_ci)]  # fmt: skip
    return "\n".join([*lines, "", *checks_md(res["checks"])])


def _shape_words(s: dict[str, int]) -> str:
    return (f"B {s['batch']}, T {s['block']}, d {s['d_model']}, {s['heads']} heads, "
            f"vocabulary {s['vocab']}")  # fmt: skip


def plot(res: dict[str, Any], path: Path) -> None:
    """One stacked bar per variant: ms per step by category, each segment in the legend."""
    plt = pyplot()
    if plt is None:
        return
    names = list(res["variants"])
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(names) + 2.2))
    left = [0.0] * len(names)
    colors = ["#d62", "#e93", "#5a8", "#9b5", "#58b", "#a6c", "#999"]
    ys = list(range(len(names)))[::-1]
    for cat, col in zip(CATEGORIES, colors, strict=True):
        w = [res["variants"][n]["profile_ms"][cat] for n in names]
        ax.barh(ys, w, left=left, color=col, label=cat)
        left = [a + b for a, b in zip(left, w, strict=True)]
    ax.set_yticks(ys, names, fontsize=8)
    ax.set_xlabel("ms per step under the profiler (shares are the point; times are inflated)")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    ax.set_title(f"where the step goes ({res['shape']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--rounds", type=int, default=200, help="the most rounds")
    p.add_argument("--min-rounds", type=int, default=30)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--sizes", type=int, nargs="+", default=[1024], help="square matmul n")
    p.add_argument("--peak-reps", type=int, default=3)
    p.add_argument("--op-rounds", type=int, default=30, help="rounds of the ops table")
    args = p.parse_args(argv)
    args.clock = default_clock("cpu", args.threads)
    if args.quick:
        args.backend = "eager" if args.backend == "inductor" else args.backend
        args.rounds = args.min_rounds = 2
        args.profile_steps, args.sizes, args.peak_reps, args.op_rounds = 2, [128], 1, 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = out_dir(args)
    cache = Path(tempfile.gettempdir()) / "isotrain-inductor-cache"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache))  # shared with bench_compile
    with torch_threads(args.threads):
        res = run(args, argv)
    code = write_results(out, "profile", res, markdown(res))
    plot(res, out / "profile.png")
    return code


if __name__ == "__main__":
    steady_malloc()
    raise SystemExit(main())
