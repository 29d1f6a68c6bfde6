"""Training throughput: the isotrain step vs a plain PyTorch loop, Lightning Fabric, Accelerate.

Same model (isotrain.train.model.GPT, same seed), same data (isotrain.train.data.get_batch), same
optimizer (fused AdamW with the trainer's parameter groups), same LR schedule, same clipping,
fp32 by default. Variants:

    plain       a nanoGPT-style hand-written loop: forward, backward, clip, set lr, step, zero
    isotrain    isotrain.train.loop.setup(cfg) once, then train_step(run) (guard on, contexts on)
    fabric      the plain loop through lightning.fabric.Fabric (setup, backward, clip_gradients)
    accelerate  the plain loop through accelerate.Accelerator (prepare, backward, clip_grad_norm_)

Rounds interleave the variants (the order rotates each round); each round runs `--warmup` untimed
then `--steps` timed steps per variant. We report median tokens/s and, per round, the paired
ratio to the plain loop (median, IQR, min-max, and a bootstrap 95% interval of the median).
The default is many one-step rounds: neighbouring steps share the machine's state, so its slow
drift cancels in the pairs (180 rounds gave a 1.1% half-width where 36 five-step rounds gave
3.9%). One torch thread by default: the machine is shared, and two threads on two busy cores
thrash.

    .venv/bin/python benchmarks/bench_trainer.py            # ~3 minutes on 2 shared cores
    .venv/bin/python benchmarks/bench_trainer.py --quick    # seconds, a smoke run

Writes benchmarks/results/trainer.{md,json,png}. The other trainer benchmarks (bench_overhead,
bench_mfu, gpu_suite) import the variants and the statistics from here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from isotrain.train import data as data_mod
from isotrain.train.config import (
    CheckpointingConfig,
    CompileConfig,
    DataConfig,
    GuardConfig,
    ModelConfig,
    TrainConfig,
)
from isotrain.train.loop import setup
from isotrain.train.optim import build_optimizer, lr_at
from isotrain.train.step import train_step
from isotrain.train.weights import build_model

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# ------------------------------------------------------------------------------ configuration
@dataclass(frozen=True)
class Shape:
    """Model and batch shape shared by every variant of one comparison."""

    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    block_size: int = 256
    batch_size: int = 16
    dropout: float = 0.0

    @property
    def tokens(self) -> int:
        """Tokens per optimizer step."""
        return self.block_size * self.batch_size

    def label(self) -> str:
        return (
            f"{self.n_layer} layers, d {self.d_model}, {self.n_head} heads, "
            f"T {self.block_size}, B {self.batch_size}"
        )


TINY = Shape()  # the `tiny` preset
SMALL = Shape(n_layer=6, n_head=6, d_model=384, block_size=256, batch_size=16, dropout=0.1)
PROBE = Shape(n_layer=1, n_head=1, d_model=16, block_size=16, batch_size=2)


def train_config(
    shape: Shape,
    *,
    device: str = "cpu",
    precision: str = "fp32",
    guard: bool = True,
    compile_backend: str | None = None,
    checkpointing: str = "none",
) -> TrainConfig:
    """The TrainConfig every variant reads (the baselines use its model, optim and data)."""
    return TrainConfig(
        model=ModelConfig(
            n_layer=shape.n_layer,
            n_head=shape.n_head,
            d_model=shape.d_model,
            block_size=shape.block_size,
            dropout=shape.dropout,
        ),
        data=DataConfig(batch_size=shape.batch_size, max_bytes=1_000_000),
        guard=GuardConfig(enabled=guard),
        compile=CompileConfig(enabled=compile_backend is not None, backend=compile_backend or ""),
        checkpointing=CheckpointingConfig(policy=checkpointing),
        steps=100_000,  # only the LR schedule reads it: the same for every variant
        device=device,
        precision=precision,  # type: ignore[arg-type]
        progress=False,
        sample_tokens=0,
    )


# ------------------------------------------------------------------------------------ variants
class Variant:
    """One training setup: `step()` runs one optimizer step; `sync()` waits for the device."""

    name = "?"

    def __init__(self, cfg: TrainConfig, corpus: data_mod.Corpus | None) -> None:
        self.cfg, self.corpus, self.i = cfg, corpus, 0
        self.device = torch.device(cfg.device)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        x, y = data_mod.get_batch(
            self.corpus.train,  # type: ignore[union-attr]
            batch_size=c.data.batch_size,
            block_size=c.model.block_size,
            seed=c.seed,
            step=self.i,
        )
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.cfg.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[self.cfg.precision])

    def build(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(self.cfg.seed)  # the same initial weights in every variant
        model = build_model(self.cfg.model).to(self.device)
        return model, build_optimizer(model, self.cfg.optim)  # fused AdamW, decay groups

    def lr(self) -> float:
        return lr_at(self.i, self.cfg.optim, self.cfg.steps)

    def step(self) -> None:
        raise NotImplementedError


class Plain(Variant):
    """A nanoGPT-style loop, written out by hand."""

    name = "plain"

    def __init__(self, cfg: TrainConfig, corpus: data_mod.Corpus | None) -> None:
        super().__init__(cfg, corpus)
        self.model, self.opt = self.build()
        fp16 = cfg.precision == "fp16"
        self.scaler = torch.amp.GradScaler(self.device.type) if fp16 else None

    def step(self) -> None:
        x, y = self.batch()
        with self.autocast():
            loss = self.model(x, y)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.opt)
        else:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        for group in self.opt.param_groups:
            group["lr"] = self.lr()
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.i += 1


class Isotrain(Variant):
    """isotrain.train.loop: setup once (excluded from timing), then train_step per step."""

    name = "isotrain"

    def __init__(self, cfg: TrainConfig, corpus: data_mod.Corpus | None) -> None:
        super().__init__(cfg, corpus)
        torch.manual_seed(cfg.seed)  # the same initial weights as the baselines
        self.run = setup(cfg)
        if cfg.compile.enabled:
            from isotrain.compile import warmup

            x = torch.zeros(cfg.data.batch_size, cfg.model.block_size, dtype=torch.long)
            with self.autocast():
                warmup(self.run.model, [(x.to(self.device),) * 2])

    def step(self) -> None:
        train_step(self.run)

    def skipped(self) -> int:
        """Steps the guard skipped (a skipped update is cheaper: report it with the timing)."""
        return int(self.run.updater.totals().get("skipped_steps", 0))


class IsotrainNoGuard(Isotrain):
    """isotrain's train_step with `--guard.enabled False` (PlainUpdater): isolates the guard."""

    name = "isotrain-noguard"


class FabricLoop(Variant):
    """The plain loop through Lightning Fabric."""

    name = "fabric"
    PRECISION: ClassVar[dict[str, str]] = {
        "fp32": "32-true",
        "bf16": "bf16-mixed",
        "fp16": "16-mixed",
    }

    def __init__(self, cfg: TrainConfig, corpus: data_mod.Corpus | None) -> None:
        super().__init__(cfg, corpus)
        from lightning.fabric import Fabric

        accel = "cuda" if self.device.type == "cuda" else "cpu"
        self.fabric = Fabric(accelerator=accel, devices=1, precision=self.PRECISION[cfg.precision])
        model, opt = self.build()
        self.model, self.opt = self.fabric.setup(model, opt)

    def step(self) -> None:
        x, y = self.batch()
        loss = self.model(x, y)  # Fabric applies its precision's autocast in the forward
        self.fabric.backward(loss)
        self.fabric.clip_gradients(self.model, self.opt, max_norm=self.cfg.optim.grad_clip)
        for group in self.opt.param_groups:
            group["lr"] = self.lr()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.i += 1


class AccelerateLoop(Variant):
    """The plain loop through Hugging Face Accelerate."""

    name = "accelerate"
    PRECISION: ClassVar[dict[str, str]] = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}

    def __init__(self, cfg: TrainConfig, corpus: data_mod.Corpus | None) -> None:
        super().__init__(cfg, corpus)
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)  # a process-wide singleton: allow a new precision
        self.acc = Accelerator(
            cpu=self.device.type == "cpu", mixed_precision=self.PRECISION[cfg.precision]
        )
        model, opt = self.build()
        self.model, self.opt = self.acc.prepare(model, opt)

    def step(self) -> None:
        x, y = self.batch()
        loss = self.model(x, y)  # Accelerate wraps the forward in its autocast
        self.acc.backward(loss)
        self.acc.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        for group in self.opt.param_groups:
            group["lr"] = self.lr()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.i += 1


VARIANTS: dict[str, type[Variant]] = {
    v.name: v for v in (Plain, Isotrain, IsotrainNoGuard, FabricLoop, AccelerateLoop)
}


def make_variants(names: list[str], cfg: TrainConfig, threads: int) -> dict[str, Variant]:
    """Build each named variant; a missing library is reported and that variant left out."""
    corpus = data_mod.load_corpus(None, max_bytes=cfg.data.max_bytes, val_fraction=0.1)
    out: dict[str, Variant] = {}
    for name in names:
        c = train_config_for(name, cfg)
        try:
            out[name] = VARIANTS[name](c, corpus)
        except ImportError as e:
            print(f"[skip] {name}: {e} (pip install -e '.[bench]')", file=sys.stderr)
        torch.set_num_threads(threads)  # in case a library changed it
    return out


def train_config_for(name: str, cfg: TrainConfig) -> TrainConfig:
    if name == "isotrain-noguard":
        import dataclasses

        return dataclasses.replace(cfg, guard=GuardConfig(enabled=False))
    return cfg


# ---------------------------------------------------------------------------------- timing
def interleave(
    variants: dict[str, Variant],
    *,
    rounds: int,
    steps: int,
    warmup: int,
    first_warmup: int = 2,
    on_round: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, dict[str, list[float]]]:
    """Seconds for `steps` steps per variant per round, on two clocks; the order rotates.

    Returns {"wall": {name: [...]}, "cpu": {name: [...]}}. The CPU clock is this process's CPU
    time: on an oversubscribed machine it leaves out the time the process sat descheduled,
    which is most of the noise of wall time (with one torch thread, it equals wall time on an
    idle machine). On CUDA only wall time (after a synchronize) means anything.
    """
    names = list(variants)
    for v in variants.values():  # allocator, optimizer state, lazy init: outside every round
        for _ in range(first_warmup):
            v.step()
        v.sync()
    times: dict[str, dict[str, list[float]]] = {"wall": {n: [] for n in names}}
    times["cpu"] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        row = {}
        for name in names[k:] + names[:k]:
            v = variants[name]
            for _ in range(warmup):
                v.step()
            v.sync()
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                v.step()
            v.sync()
            c1, w1 = time.process_time(), time.perf_counter()
            times["wall"][name].append(w1 - w0)
            times["cpu"][name].append(c1 - c0)
            row[name] = w1 - w0
        if on_round is not None:
            on_round(r, row)
    return times


def default_clock(device: str, threads: int) -> str:
    """CPU time on a CPU device with one thread (robust to a busy machine), else wall time."""
    return "cpu" if torch.device(device).type == "cpu" and threads == 1 else "wall"


def quantiles(xs: list[float]) -> tuple[float, float]:
    """First and third quartiles (the values themselves when there are fewer than 2)."""
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def bootstrap_median_ci(xs: list[float], *, reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A percentile-bootstrap 95% interval of the median (a fixed seed: reproducible)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(reps))
    return meds[int(0.025 * reps)], meds[int(0.975 * reps) - 1]


def summarize(xs: list[float]) -> dict[str, float]:
    q1, q3 = quantiles(xs)
    lo, hi = bootstrap_median_ci(xs)
    return {
        "median": statistics.median(xs),
        "q1": q1,
        "q3": q3,
        "min": min(xs),
        "max": max(xs),
        "ci95_lo": lo,
        "ci95_hi": hi,
        "n": len(xs),
    }


def paired_ratios(times: dict[str, list[float]], base: str = "plain") -> dict[str, list[float]]:
    """Per round: base time / variant time, i.e. the variant's throughput relative to base."""
    return {n: [b / t for b, t in zip(times[base], ts)] for n, ts in times.items() if n != base}


def throughput(
    times: dict[str, dict[str, list[float]]], *, clock: str, tokens: int, steps: int
) -> dict[str, dict[str, Any]]:
    """Per variant: median tokens/s and ms/step on `clock`, paired ratios to plain (both clocks)."""
    out: dict[str, dict[str, Any]] = {}
    ts, wall = times[clock], times["wall"]
    ratios = paired_ratios(ts) if "plain" in ts else {}
    wall_ratios = paired_ratios(wall) if "plain" in wall else {}
    for name, secs in ts.items():
        per_step = statistics.median(secs) / steps
        out[name] = {
            "clock": clock,
            "tokens_per_s": tokens / per_step,
            "ms_per_step": 1e3 * per_step,
            "wall_tokens_per_s": tokens * steps / statistics.median(wall[name]),
            "seconds_per_round": secs,
            "wall_seconds_per_round": wall[name],
        }
        if name in ratios:
            out[name]["ratio"] = summarize(ratios[name])
            out[name]["ratio_per_round"] = ratios[name]
            out[name]["wall_ratio"] = summarize(wall_ratios[name])
    return out


# ----------------------------------------------------------------------------- reporting
def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine(device: torch.device | str = "cpu") -> dict[str, Any]:
    """What the numbers depend on: CPU or GPU, cores, threads, versions, load."""
    dev = torch.device(device)
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
    for lib in ("lightning", "accelerate"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            info[lib] = version(lib)
    return info


def machine_line(meta: dict[str, Any]) -> str:
    dev = f"GPU {meta['gpu']}, " if "gpu" in meta else ""
    libs = ", ".join(f"{k} {meta[k]}" for k in ("lightning", "accelerate") if k in meta)
    load = f"load average {meta.get('load_before')} -> {meta.get('load_after')} (1 min)"
    return (
        f"{dev}{meta['cpu']}, {meta['cores']} cores, {meta['threads']} torch thread(s), "
        f"torch {meta['torch']}, {libs}; {load}"
    )


def command_line(script: str, argv: list[str] | None) -> str:
    flags = sys.argv[1:] if argv is None else argv
    return " ".join([f"python benchmarks/{script}", *flags])


def fmt_ci(s: dict[str, float], digits: int = 3) -> str:
    f = f"{{:.{digits}f}}"
    return (
        f"{f.format(s['median'])} [IQR {f.format(s['q1'])}-{f.format(s['q3'])}; "
        f"95% CI {f.format(s['ci95_lo'])}-{f.format(s['ci95_hi'])}]"
    )


def write_results(out: Path, stem: str, payload: dict[str, Any], md: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    (out / f"{stem}.md").write_text(md)
    print(md)
    print(f"wrote {out / stem}.{{md,json}}")


def box_plot(path: Path, series: dict[str, list[float]], *, title: str, ylabel: str) -> None:
    """One box per variant (per-round values), with a line at 1.0 for ratio plots."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[skip] plot: matplotlib is not installed", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.boxplot(list(series.values()), tick_labels=list(series))
    for i, ys in enumerate(series.values(), start=1):
        ax.scatter([i] * len(ys), ys, s=10, alpha=0.6)
    if "ratio" in ylabel:
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------ main
def markdown(res: dict[str, Any]) -> str:
    m, a = res["meta"], res["args"]
    lines = [
        "# Training throughput: isotrain vs plain PyTorch, Lightning Fabric, Accelerate",
        "",
        f"Command: `{m['command']}`  ",
        f"Machine: {machine_line(m)}  ",
        f"Model: GPT, {res['shape']} ({res['params']:,} parameters), {a['precision']}, "
        f"fused AdamW, clip 1.0, device {a['device']}. {a['rounds']} interleaved rounds "
        f"(order rotating) of {a['warmup']} warm-up + {a['steps']} timed steps per variant.",
        "",
        f"Clock: {CLOCKS[a['clock']]}. The last two columns use wall time.",
        "",
        *throughput_table(res["variants"]),
        "",
        *res["notes"],
        "",
    ]
    return "\n".join(lines)


CLOCKS = {
    "cpu": "process CPU time (time.process_time): with one torch thread it equals wall time on an "
    "idle machine, and it leaves out the time a busy machine kept the process waiting",
    "wall": "wall time (time.perf_counter, after a device synchronize)",
}


def throughput_table(variants: dict[str, Any]) -> list[str]:
    lines = [
        "| variant | tokens/s (median) | ms/step | ratio to plain, paired per round "
        "[IQR; 95% CI of median] | min-max | wall tokens/s | wall ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in variants.items():
        ratio = r.get("ratio")
        cell = fmt_ci(ratio) if ratio else "1 (reference)"
        span = f"{ratio['min']:.3f}-{ratio['max']:.3f}" if ratio else ""
        wall = f"{r['wall_ratio']['median']:.3f}" if ratio else "1"
        lines.append(
            f"| {name} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.1f} | {cell} | {span} "
            f"| {r['wall_tokens_per_s']:,.0f} | {wall} |"
        )
    return lines


def judge(s: dict[str, float], target: float, *, higher: bool = True) -> str:
    """Met / not met on the median, and whether the 95% interval resolves it."""
    lo, hi = (s["ci95_lo"], s["ci95_hi"]) if higher else (-s["ci95_hi"], -s["ci95_lo"])
    med, t = (s["median"], target) if higher else (-s["median"], -target)
    if med >= t:
        return "met" if lo >= t else "met on the median, not resolved (the 95% CI crosses it)"
    return "not met, within noise (the 95% CI crosses it)" if hi >= t else "not met"


def verdicts(res: dict[str, Any]) -> list[str]:
    v = res["variants"]
    if "isotrain" not in v or "plain" not in v:
        return []
    iso = v["isotrain"]["ratio"]
    half = (iso["ci95_hi"] - iso["ci95_lo"]) / 2
    lines = [
        f"- Target: isotrain >= 1.0x plain (paired): median {iso['median']:.3f}, 95% CI "
        f"{iso['ci95_lo']:.3f}-{iso['ci95_hi']:.3f} -> {judge(iso, 1.0)}. Resolution: the "
        f"interval's half-width is {100 * half:.1f}%, so a 5% difference "
        + ("would show." if half < 0.05 else "would not show with this noise and round count.")
    ]
    for peer in ("fabric", "accelerate"):
        if peer in v:
            p = v[peer]["ratio"]
            ok = iso["median"] >= p["median"]
            overlap = iso["ci95_lo"] <= p["ci95_hi"] and p["ci95_lo"] <= iso["ci95_hi"]
            lines.append(
                f"- Target: isotrain >= {peer}: medians {iso['median']:.3f} vs {p['median']:.3f}"
                f" -> {'met' if ok else 'not met'} on the median"
                + ("; the 95% intervals overlap, so not resolved." if overlap else ".")
            )
    if "skipped" in v["isotrain"]:
        lines.append(
            f"- The guard skipped {v['isotrain']['skipped']} of the isotrain variant's steps "
            "(a skipped update is cheaper, so this must be 0 for a fair comparison)."
        )
    return lines


def run(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    shape = Shape(
        n_layer=args.layers,
        n_head=args.heads,
        d_model=args.d_model,
        block_size=args.block,
        batch_size=args.batch,
    )
    cfg = train_config(shape, device=args.device, precision=args.precision)
    load_before = os.getloadavg()[0]
    variants = make_variants(args.variants.split(","), cfg, args.threads)

    def progress(r: int, row: dict[str, float]) -> None:
        cells = " ".join(f"{n} {shape.tokens * args.steps / t:,.0f}" for n, t in row.items())
        print(f"round {r + 1}/{args.rounds} tok/s: {cells}", flush=True)

    times = interleave(
        variants, rounds=args.rounds, steps=args.steps, warmup=args.warmup, on_round=progress
    )
    meta = machine(args.device)
    meta.update(
        load_before=round(load_before, 2),
        load_after=meta.pop("load_avg_1m"),
        command=command_line("bench_trainer.py", argv),
    )
    out = throughput(times, clock=args.clock, tokens=shape.tokens, steps=args.steps)
    for name, v in variants.items():
        if isinstance(v, Isotrain):
            out[name]["skipped"] = v.skipped()
    params = next(iter(variants.values())).cfg
    res = {
        "meta": meta,
        "args": vars(args),
        "shape": shape.label(),
        "params": sum(p.numel() for p in build_model(params.model).parameters()),
        "variants": out,
        "notes": [],
    }
    missing = [n for n in args.variants.split(",") if n not in variants]
    res["notes"] = verdicts(res) + (
        [f"- Not run (library missing): {', '.join(missing)}."] if missing else []
    )
    return res


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="seconds-long smoke run (tiny model)")
    p.add_argument("--variants", default="plain,isotrain,fabric,accelerate")
    p.add_argument("--rounds", type=int, default=60, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=1, help="timed steps per variant per round")
    p.add_argument("--warmup", type=int, default=0, help="untimed steps before each timed block")
    p.add_argument("--layers", type=int, default=TINY.n_layer)
    p.add_argument("--heads", type=int, default=TINY.n_head)
    p.add_argument("--d-model", type=int, default=TINY.d_model)
    p.add_argument("--block", type=int, default=TINY.block_size)
    p.add_argument("--batch", type=int, default=TINY.batch_size)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: shared machine)")
    p.add_argument("--clock", choices=["cpu", "wall"], default=None, help="default: cpu on CPU")
    p.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    p.add_argument("--render", action="store_true", help="only redo md/png from the JSON")
    args = p.parse_args(argv)
    args.clock = args.clock or default_clock(args.device, args.threads)
    if args.quick:
        args.layers, args.heads, args.d_model, args.block, args.batch = 2, 2, 32, 32, 4
        args.rounds, args.steps, args.warmup = 3, 3, 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    stem = "trainer_quick" if args.quick else "trainer"
    if args.render:  # rebuild the markdown and plot from the JSON of an earlier run
        res = json.loads((args.out / f"{stem}.json").read_text())
        res["notes"] = verdicts(res) + [n for n in res["notes"] if n.startswith("- Not run")]
    else:
        res = run(args, argv)
    write_results(args.out, stem, res, markdown(res))
    ratios = {n: r["ratio_per_round"] for n, r in res["variants"].items() if "ratio" in r}
    if ratios:
        box_plot(
            args.out / f"{stem}.png",
            ratios,
            title=f"tokens/s relative to the plain loop, per round\n{res['shape']}",
            ylabel="throughput ratio to plain",
        )


if __name__ == "__main__":
    main()
