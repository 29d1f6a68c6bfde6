"""Fixed per-step cost of each training loop, on a model so small that the step is milliseconds.

The loops of loops.py (tuned plain loop, nanoGPT's loop, isotrain train_step, isotrain with the
guard off, Lightning Fabric, Accelerate) on a 1-layer GPT (d 16, T 16, B 2). Interleaved rounds
of one step per variant (order rotating): per-step ms, and the per-round paired difference to
the tuned plain loop in ms with its 95% interval. Then three attributions of isotrain's extra
cost, each less noisy than the step time:

1. ATen operators dispatched per step (torch.profiler; a count, so it does not depend on load);
2. the update phase alone with fixed gradients: clip + fused AdamW.step vs StepGuard.step, with
   and without the spike detector, interleaved;
3. cProfile of the guarded step: per-step time and calls of each StepGuard phase (cProfile
   inflates Python-heavy code, so read it as a split, not as absolute times).

    python benchmarks/bench_overhead.py          # ~3 minutes on 2 cores
    python benchmarks/bench_overhead.py --quick  # seconds, a smoke run into a temp dir

Writes overhead.{md,json,png} into benchmarks/results/<cpu-kind>/. Checks: equal losses across
the loops, and no step skipped by the guard.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

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
from isotrain.guard import StepGuard
from isotrain.train.update.optim import build_optimizer
from isotrain.train.weights.load import build_model
from loops import (
    EARLIER_REFERENCE,
    PROBE,
    REFERENCE,
    Shape,
    Variant,
    interleave,
    loss_check,
    losses,
    make_variants,
    skipped,
    train_config,
)
from stats import fmt_ci, paired_diffs, summarize

VARIANTS = "plain,nanogpt,isotrain,isotrain-noguard,fabric,accelerate"
COLUMNS = [
    "variant",
    "ms/step (median)",
    "extra ms/step vs plain, paired [95% CI]",
    "ATen ops/step",
    "Python calls/step",
    "wall ms/step",
]
TARGET_MS = 0.05


# ----------------------------------------------------------------------------- op counting
def _outer_aten(prof: Any) -> Counter[str]:
    """ATen ops that no other ATen op called (the dispatches a loop makes itself)."""
    names: Counter[str] = Counter()
    for e in prof.events():
        parent = e.cpu_parent
        if e.name.startswith("aten::") and not (parent and parent.name.startswith("aten::")):
            names[e.name] += 1
    return names


def aten_ops_per_step(v: Variant, steps: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            v.step()
        v.sync()
    names = _outer_aten(prof)
    return {
        "per_step": sum(names.values()) / steps,
        "top": {k: n / steps for k, n in names.most_common(8)},
    }


# ------------------------------------------------------------------------- update phase alone
class UpdateOnly:
    """The update phase with fixed gradients: what a step adds after backward."""

    KINDS = ("clip + step", "StepGuard", "StepGuard, no spike detector")

    def __init__(self, shape: Shape, kind: str) -> None:
        cfg = train_config(shape)
        torch.manual_seed(0)
        self.model = build_model(cfg.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = build_optimizer(self.model, cfg.optim)
        x = torch.randint(0, 256, (shape.batch_size, shape.block_size))
        self.model(x, x).backward()
        self.grads = [p.grad.clone() for p in self.params]  # type: ignore[union-attr]
        self.kind, self.guard = kind, None
        if kind != "clip + step":
            spike_k = cfg.guard.spike_k if kind == "StepGuard" else None
            self.guard = StepGuard(self.opt, self.model, max_norm=1.0, spike_k=spike_k)

    def __call__(self) -> float:
        for p, g in zip(self.params, self.grads, strict=True):
            p.grad = g.clone()
        loss = torch.tensor(3.0)
        t0 = time.process_time()  # one thread on a busy machine: CPU time, see loops.interleave
        if self.guard is not None:
            self.guard.step(loss)
        else:
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return time.process_time() - t0

    def ops(self) -> float:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                self()
        # the g.clone() of each call is outside the phase: subtract it
        return sum(_outer_aten(prof).values()) / 3 - len(self.grads)


def update_phase(shape: Shape, reps: int) -> dict[str, Any]:
    kinds = UpdateOnly.KINDS
    runs = {k: UpdateOnly(shape, k) for k in kinds}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(reps + 3):  # the first three rounds warm up
        for k in kinds[r % 3 :] + kinds[: r % 3]:
            t = runs[k]()
            if r >= 3:
                times[k].append(t)
    extra = paired_diffs(times, kinds[0], scale=1e3)
    return {
        k: {
            "ms": 1e3 * statistics.median(ts),
            "extra_ms": summarize(extra[k]) if k in extra else None,
            "ops": runs[k].ops(),
        }
        for k, ts in times.items()
    }


# --------------------------------------------------------------------------- cProfile split
def python_calls(v: Variant, steps: int) -> float:
    """Python and builtin function calls per step (cProfile's count: it does not depend on load)."""
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        v.step()
    pr.disable()
    return sum(nc for (_, nc, _, _, _) in pstats.Stats(pr).stats.values()) / steps  # type: ignore[attr-defined]


PHASES = {  # label: "file suffix:function"; a phase whose function is gone is left out
    "StepGuard.step (all)": "guard/_step.py:step",
    "_host_step (CPU mode)": "guard/_step.py:_host_step",
    "_device_step (device modes)": "guard/_step.py:_device_step",
    "_loss32": "guard/_step.py:_loss32",
    "_unscale": "guard/_step.py:_unscale",
    "_grad_norm (foreach norms)": "guard/_step.py:_grad_norm",
    "_decide (device decision)": "guard/_step.py:_decide",
    "_host_reason (host decision, with the window)": "guard/_outcome.py:_host_reason",
    "HostSpikeDetector.observe (spike window)": "guard/_spikes.py:observe",
    "SpikeDetector.is_spike": "guard/_spikes.py:is_spike",
    "SpikeDetector.update": "guard/_spikes.py:update",
    "clip_grads_with_norm_": "clip_grad.py:_clip_grads_with_norm_",
    "AdamW.step (fused)": "adam.py:step",
    "_count": "guard/_step.py:_count",
    "zero_grad": "optimizer.py:zero_grad",
    "train_step (all)": "train/step.py:train_step",
    "batch (Batches.get)": "train/state.py:get",
    "GPT.forward": "model.py:forward",
    "backward": "_tensor.py:backward",
    "lr_at + set_lr": "optim.py:set_lr",
}


def cprofile_split(v: Variant, steps: int) -> dict[str, dict[str, float]]:
    """cProfile ms and calls per step of the phases above (cumulative, profiler-inflated)."""
    pr = cProfile.Profile(time.process_time)  # CPU time: see loops.interleave
    pr.enable()
    for _ in range(steps):
        v.step()
    pr.disable()
    stats = pstats.Stats(pr).stats  # type: ignore[attr-defined]
    out: dict[str, dict[str, float]] = {}
    for label, key in PHASES.items():
        fname, func = key.split(":")
        hits = [
            (ct, nc)
            for (path, _, name), (_, nc, _, ct, _) in stats.items()
            if path.endswith(fname) and name == func
        ]
        if hits:
            ct, nc = max(hits)  # the outermost entry of a recursive name
            out[label] = {"ms": 1e3 * ct / steps, "calls": nc / steps}
    return out


# ------------------------------------------------------------------------------------ report
def markdown(res: dict[str, Any]) -> str:
    m, a = res["meta"], res["args"]
    lines = [
        "# Per-step overhead of each training loop",
        "",
        f"Command: `{m['command']}`  ",
        f"Machine: {machine_line(m)}  ",
        f"Model: GPT, {res['shape']} (a step is a few ms, so fixed costs show), fp32, AdamW, "
        f"clip 1.0. {a['rounds']} interleaved rounds of one step per variant. "
        f"Clock: {CLOCKS[a['clock']]}. `plain` is the tuned loop (parameter list kept, fused "
        "AdamW), the reference; `nanogpt` is nanoGPT's loop as written.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for name, r in res["variants"].items():
        over = fmt_ci(r["overhead_ms"]) if r.get("overhead_ms") else "0 (reference)"
        lines.append(
            f"| {name} | {r['ms_per_step']:.3f} | {over} | {r['ops_per_step']:.0f} "
            f"| {r['python_calls_per_step']:.0f} | {r['wall_ms_per_step']:.3f} |"
        )
    if res.get("guard_ms"):
        lines += ["", f"The guard inside a full step (isotrain minus isotrain-noguard, paired per "
                  f"round): {fmt_ci(res['guard_ms'])} ms."]  # fmt: skip
    lines += [
        "",
        "Update phase alone (fixed gradients, interleaved reps, CPU time): clip + fused "
        "AdamW.step vs StepGuard.step (skip_mode auto = host on CPU)",
        "",
        "| update | ms (median) | extra vs clip + step, ms [95% CI] | ATen ops |",
        "|---|---|---|---|",
    ]
    for k, u in res["update_phase"].items():
        extra = fmt_ci(u["extra_ms"]) if u["extra_ms"] else "0 (reference)"
        lines.append(f"| {k} | {u['ms']:.3f} | {extra} | {u['ops']:.0f} |")
    lines += [
        "",
        "cProfile of the isotrain step and of the tuned plain step (cumulative ms per step and "
        "calls per step; cProfile inflates Python calls, read as a split):",
        "",
        "| phase | isotrain ms/step | calls/step | plain ms/step |",
        "|---|---|---|---|",
    ]
    plain = res["cprofile_plain"]
    for k, v in res["cprofile_isotrain"].items():
        p = f"{plain[k]['ms']:.3f}" if k in plain else ""
        lines.append(f"| {k} | {v['ms']:.3f} | {v['calls']:.1f} | {p} |")
    lines += ["", *res["notes"], "", *checks_md(res["checks"])]
    return "\n".join(lines)


def load_note(res: dict[str, Any]) -> list[str]:
    """A line when other work shared the cores: absolute times inflate, fractions less so."""
    m, v = res["meta"], res["variants"]
    if max(m["load_before"], m["load_after"]) <= m["cores"] / 2 or "plain" not in v:
        return []
    plain = v["plain"]["ms_per_step"]
    extra = [
        f"{name} {100 * r['overhead_ms']['median'] / plain:+.1f}%"
        for name, r in v.items()
        if r.get("overhead_ms")
    ]
    return [
        f"- Shared machine: the 1-minute load average was {m['load_before']} -> "
        f"{m['load_after']} on {m['cores']} cores, so other processes held the cores and caches "
        f"and every time here is inflated (plain's step: {plain:.3f} ms). The paired extras as a "
        f"fraction of plain's step travel better: {', '.join(extra)}."
    ]


def verdicts(res: dict[str, Any]) -> list[str]:
    v, out = res["variants"], []
    iso = v.get("isotrain", {}).get("overhead_ms")
    if iso:
        met = iso["ci95_hi"] <= TARGET_MS
        verdict = (
            "met"
            if met
            else ("met on the median only" if iso["median"] <= TARGET_MS else "not met")
        )
        out.append(
            f"- Target: isotrain's guarded step costs at most {TARGET_MS} ms more than the tuned "
            f"plain step: {fmt_ci(iso)} ms -> {verdict}."
        )
    if res.get("guard_ms"):
        on, off = v["isotrain"], v["isotrain-noguard"]
        ops = on["ops_per_step"] - off["ops_per_step"]
        calls = on["python_calls_per_step"] - off["python_calls_per_step"]
        why = ": its cost is Python, not tensor work" if ops <= 0 < calls else ""
        out.append(
            f"- Of that, the guard (on minus off, paired): {fmt_ci(res['guard_ms'])} ms, with "
            f"{ops:+.0f} ATen ops and {calls:+.0f} Python calls per step{why}."
        )
    for peer in ("isotrain", "isotrain-noguard", "nanogpt"):
        if v.get(peer, {}).get("overhead_ms"):
            o, ops = v[peer]["overhead_ms"], v[peer]["ops_per_step"] - v["plain"]["ops_per_step"]
            calls = v[peer]["python_calls_per_step"] - v["plain"]["python_calls_per_step"]
            out.append(
                f"- {peer} vs tuned plain: {fmt_ci(o)} ms/step, {ops:+.0f} ATen ops, "
                f"{calls:+.0f} Python calls per step."
            )
    u = res["update_phase"]
    g, plain = u["StepGuard"], u["clip + step"]
    spike = g["ms"] - u["StepGuard, no spike detector"]["ms"]
    out.append(
        f"- Update phase alone: the guard dispatches {g['ops']:.0f} ATen ops against "
        f"{plain['ops']:.0f} for clip + step and costs {fmt_ci(g['extra_ms'])} ms more "
        f"(the spike window: {spike:.3f} ms of it)."
    )
    return out


def run(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    variants = make_variants(args.variants.split(","), train_config(PROBE))
    before = losses(variants)
    timing = interleave(variants, rounds=args.rounds, first_warmup=20)
    after = losses(variants)
    per_step = {n: [1e3 * t for t in ts] for n, ts in timing[args.clock].items()}
    extra = paired_diffs(per_step, "plain")
    out: dict[str, Any] = {}
    for name, ms in per_step.items():
        out[name] = {
            "ms_per_step": statistics.median(ms),
            "wall_ms_per_step": 1e3 * statistics.median(timing["wall"][name]),
            "overhead_ms": summarize(extra[name]) if name in extra else None,
            "overhead_per_round": extra.get(name),
            "ops_per_step": aten_ops_per_step(variants[name], args.profile_steps)["per_step"],
            "python_calls_per_step": python_calls(variants[name], args.profile_steps),
        }
    skips = skipped(variants)
    ok, detail = loss_check(before, after, rel_tol=1e-3)
    res: dict[str, Any] = {
        "meta": run_meta("bench_overhead.py", argv, load_before),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "shape": PROBE.label(),
        "reference": REFERENCE,
        "variants": out,
        "isotrain_top_ops": aten_ops_per_step(variants["isotrain"], args.profile_steps)["top"],
        "update_phase": update_phase(PROBE, args.update_reps),
        "cprofile_isotrain": cprofile_split(variants["isotrain"], args.profile_steps * 5),
        "cprofile_plain": cprofile_split(variants["plain"], args.profile_steps * 5),
        "skipped": skips,
        "checks": {
            "equal losses": check(ok, detail),
            "no skipped steps": check(not any(skips.values()), f"skipped per variant: {skips}"),
        },
    }
    if "isotrain-noguard" in per_step:
        guard = paired_diffs(per_step, "isotrain-noguard")["isotrain"]
        res["guard_ms"] = summarize(guard)
    res["notes"] = verdicts(res) + load_note(res)
    return res


def plot(res: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    rows = {n: r["overhead_ms"] for n, r in res["variants"].items() if r["overhead_ms"]}
    if plt is None or not rows:
        return
    fig, ax = plt.subplots(figsize=(6.5, 0.7 * len(rows) + 1.4))
    ref = res.get("reference", EARLIER_REFERENCE)
    dot_plot(ax, rows, ref=0.0, xlabel=f"extra ms per step vs {ref} (0 = same)")
    ax.axvline(TARGET_MS, color="#c44", lw=0.8, ls=":", label=f"target +{TARGET_MS} ms")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(
        f"per-step overhead, median and 95% CI of paired rounds\n{res['shape']}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--variants", default=VARIANTS)
    p.add_argument("--rounds", type=int, default=3000)
    p.add_argument("--update-reps", type=int, default=300, help="reps of the update-only part")
    p.add_argument("--profile-steps", type=int, default=10)
    p.add_argument("--render", action="store_true", help="only redraw the png from the JSON")
    args = p.parse_args(argv)
    args.clock = default_clock("cpu", args.threads)
    if args.quick:
        args.rounds, args.update_reps, args.profile_steps = 3, 6, 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = out_dir(args)
    if args.render:  # redraw from an earlier run's JSON (no timing)
        plot(json.loads((out / "overhead.json").read_text()), out / "overhead.png")
        return 0
    with torch_threads(args.threads):
        res = run(args, argv)
    code = write_results(out, "overhead", res, markdown(res))
    plot(res, out / "overhead.png")
    return code


if __name__ == "__main__":
    steady_malloc()
    raise SystemExit(main())
