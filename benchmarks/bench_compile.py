"""torch.compile on a small GPT: eager vs compiled (per block and whole) step time and compile
time, and recompiles over a variable-length run with and without length buckets.

Part 1 (step time): two model sizes, full train steps (forward + backward + AdamW). Each
compiled variant's first step is timed apart as warm-up (CompileStats.compile_seconds is the
dynamo + backend part of it). Rounds interleave the variants (order rotating); we report the
median step time and the median of per-round eager/compiled ratios. Inductor kernels are
cached in one TORCHINDUCTOR_CACHE_DIR: the first run of the script pays cold compiles, reruns
read the cache (the table says which).
Part 2 (recompiles): documents of random length (4..block tokens), batches of 8, three
policies: pad to the batch's longest with dynamic=False, the same with dynamic=None (dynamo
marks the length dynamic after the second shape), and pad_to_bucket + dynamic=False + warmup.

Step-time rounds continue until every speedup's 95% interval is within +-2% (stats.Stopper).
Checks: every compiled copy ends with the eager copy's loss (same steps on the same batch), and
the bucketed run compiles nothing after its warm-up.

    python benchmarks/bench_compile.py                 # ~5-8 minutes on 2 cores
    python benchmarks/bench_compile.py --quick         # seconds ("eager" backend), temp dir
    python benchmarks/bench_compile.py --device cuda --sizes 768x12 --seq 1024 --dtype bf16  # GPU

Writes compile.{md,json} into benchmarks/results/<cpu-kind>/.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import tempfile
import time
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
from isotrain.compile import (
    compile_available,
    compile_model,
    default_buckets,
    no_recompiles,
    pad_to_bucket,
    track_compiles,
    warmup,
)
from stats import Stopper, fmt_ci, paired_ratios, summarize

VOCAB = 256  # byte tokens
CUDA_CMD = (
    "python benchmarks/bench_compile.py --device cuda --sizes 768x12 --seq 1024 --batch 8 "
    "--dtype bf16 --skip-recompiles"
)


class Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, C/H)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, d: int, layers: int, block: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, max(1, d // 64)) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, VOCAB)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()  # sync: timing boundary


class Runner:
    """One model + AdamW; ``step`` is a full train step under the chosen autocast."""

    def __init__(self, model: nn.Module, args: argparse.Namespace) -> None:
        self.model, self.device = model, torch.device(args.device)
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.dtype = torch.bfloat16 if args.dtype == "bf16" else None

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            logits = self.model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def timed(self, x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
        """Seconds per step: process CPU time on the CPU, wall time after a sync on CUDA."""
        now = time.perf_counter if self.device.type == "cuda" else time.process_time
        sync(self.device)
        t0 = now()
        for _ in range(steps):
            self.last_loss = self.step(x, y)
        sync(self.device)
        return (now() - t0) / steps


def cache_hits() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return c["fxgraph_cache_hit"], c["fxgraph_cache_miss"]


def cache_state(warm: dict | None, backend: str) -> str:
    if warm is None or backend != "inductor":
        return "n/a"
    return "warm" if warm["cache_misses"] == 0 else f"cold ({warm['cache_misses']} misses)"


def bench_size(d: int, layers: int, args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    torch.manual_seed(0)
    base = GPT(d, layers, args.seq).to(device)
    x = torch.randint(0, VOCAB, (args.batch, args.seq), device=device)
    y = torch.randint(0, VOCAB, (args.batch, args.seq), device=device)
    variants = {"eager": Runner(copy.deepcopy(base), args)}
    warm = {}
    for name, regional in (("per-block", True), ("whole", False)):
        runner = Runner(copy.deepcopy(base), args)
        compile_model(runner.model, backend=args.backend, regional=regional, dynamic=False)
        hits0 = cache_hits()
        with track_compiles() as stats:
            runner.timed(x, y, 1)  # warm-up: compiles forward and backward
        hits = [a - b for a, b in zip(cache_hits(), hits0, strict=True)]
        warm[name] = dict(stats=stats, cache_hits=hits[0], cache_misses=hits[1])
        variants[name] = runner
    variants["eager"].timed(x, y, 1)
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    stopper = Stopper(
        lambda: paired_ratios(times, "eager"),
        min_rounds=min(args.min_rounds, args.rounds),
        max_rounds=args.rounds,
    )
    r = 0
    while not stopper(r):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(variants[name].timed(x, y, args.steps))
        r += 1
    ratios = paired_ratios(times, "eager")
    losses = {n: float(v.last_loss) for n, v in variants.items()}  # sync: after the timing
    rows = []
    params = sum(p.numel() for p in base.parameters())
    for name in names:
        w = warm.get(name)
        rows.append(
            dict(
                d_model=d, layers=layers, params=params, variant=name,
                step_ms=1e3 * statistics.median(times[name]),
                speedup=summarize(ratios[name]) if name in ratios else None,
                compile_s=w["stats"].compile_seconds if w else 0.0,
                first_step_s=w["stats"].wall_seconds if w else 0.0,
                graphs=w["stats"].compilations if w else 0,
                cache=cache_state(w, args.backend), final_loss=losses[name],
                stopping=stopper.record(r),
            )
        )  # fmt: skip
        print({k: v for k, v in rows[-1].items() if k not in ("speedup", "stopping")})
    return rows


def doc_batches(args: argparse.Namespace, n: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(4, args.seq + 2, (n, args.batch), generator=gen).tolist()
    return [[torch.randint(0, VOCAB, (k,), generator=gen) for k in row] for row in lengths]


def run_policy(policy: str, batches, args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    torch._dynamo.reset()
    torch.manual_seed(0)
    d, layers = args.recompile_size
    runner = Runner(GPT(d, layers, args.seq).to(device), args)
    dynamic = None if policy == "longest, dynamic=None" else False
    compile_model(runner.model, backend=args.recompile_backend, dynamic=dynamic)
    buckets = default_buckets(args.seq) if policy.startswith("buckets") else None
    warm_s, warm_graphs, real, padded = 0.0, 0, 0, 0
    if buckets is not None:
        shapes = [torch.zeros(args.batch, L, dtype=torch.long, device=device) for L in buckets]
        with runner.autocast():
            warm = warmup(runner.model, shapes)
        warm_s, warm_graphs = warm.compile_seconds, warm.compilations
    guard = no_recompiles() if buckets is not None else contextlib.nullcontext()
    with guard, track_compiles() as stats:
        for docs in batches:
            width = (max(len(t) for t in docs) - 1,)
            x, y, lengths = pad_to_bucket(docs, buckets=buckets or width)
            real, padded = real + int(lengths.sum()), padded + x.numel()
            runner.step(x.to(device), y.to(device))
        sync(device)
    row = dict(
        policy=policy, batches=len(batches),
        distinct_lengths=len({max(map(len, b)) for b in batches}),
        graphs=stats.compilations, recompiles=stats.recompiles,
        limit_hits=stats.recompile_limit_hits, warmup_compile_s=warm_s, warmup_graphs=warm_graphs,
        run_compile_s=stats.compile_seconds, run_s=stats.wall_seconds,
        real_tok_per_s=real / stats.wall_seconds, pad_fraction=1 - real / padded,
        buckets=list(buckets or ()),
    )  # fmt: skip
    print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
    return row


def markdown(rows: list[dict], recompiles: list[dict], meta: dict[str, Any]) -> str:
    a = meta["args"]
    lines = [
        "# torch.compile: step time, compile time, recompiles",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {machine_line(meta)}  ",
        f"Device {a['device']}, backend {a['backend']}, T={a['seq']}, B={a['batch']}, "
        f"{a['dtype']}. Step = forward + backward + AdamW. Speedup: per-round paired ratio of "
        "eager to compiled step time, median [95% CI]. Compile s: dynamo + backend time of the "
        "warm-up step (forward and backward); first step s: its wall time. Cache: inductor "
        "FX-graph cache state at the warm-up (cold = compiled from scratch).",
        "",
        "| d_model x layers | params | variant | step ms | speedup [95% CI] | compile s "
        "| first step s | graphs | cache |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sp = fmt_ci(r["speedup"], 2) if r["speedup"] else "1 (reference)"
        lines.append(
            f"| {r['d_model']}x{r['layers']} | {r['params'] / 1e6:.2f}M | {r['variant']} "
            f"| {r['step_ms']:.1f} | {sp} | {r['compile_s']:.1f} | {r['first_step_s']:.1f} "
            f"| {r['graphs']} | {r['cache']} |"
        )
    if rows:
        lines += ["", f"Rounds: {rows[-1]['stopping']['reason']}."]
    if recompiles:
        d, layers = a["recompile_size"]
        lines += [
            "",
            f"Variable-length run ({d}x{layers}, backend {a['recompile_backend']}, "
            f"{recompiles[0]['batches']} batches of {a['batch']} documents, 4..{a['seq'] + 1} "
            "tokens): graphs compiled during the run (warm-up apart), recompiles, recompile-limit "
            "hits (dynamo then runs the frame eagerly), and padding overhead.",
            "",
            "| policy | warm-up graphs | warm-up compile s | graphs in run | recompiles "
            "| limit hits | run compile s | real tok/s | pad fraction |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in recompiles:
            lines.append(
                f"| {r['policy']} | {r['warmup_graphs']} | {r['warmup_compile_s']:.1f} "
                f"| {r['graphs']} | {r['recompiles']} | {r['limit_hits']} "
                f"| {r['run_compile_s']:.1f} | {r['real_tok_per_s']:.0f} "
                f"| {r['pad_fraction']:.2f} |"
            )
    lines += ["", f"To check the 20-40% GPU claim on a CUDA machine: `{CUDA_CMD}`", ""]
    return "\n".join(lines)


def checks(rows: list[dict], recompiles: list[dict]) -> dict[str, Any]:
    worst = 0.0
    for size in {(r["d_model"], r["layers"]) for r in rows}:
        same = [r["final_loss"] for r in rows if (r["d_model"], r["layers"]) == size]
        worst = max(worst, (max(same) - min(same)) / abs(min(same)))
    buckets = [r for r in recompiles if r["policy"].startswith("buckets")]
    return {
        "equal losses": check(
            worst <= 1e-3,
            f"largest relative spread eager vs compiled: {worst:.1e} (tolerance 1e-3)",
        ),
        "no compile after the bucket warm-up": check(
            all(r["graphs"] == 0 for r in buckets),
            f"graphs compiled in the bucketed run: {[r['graphs'] for r in buckets]}",
        ),
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--sizes", default="128x4,384x6", help="d_model x layers, comma-separated")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="autocast dtype")
    p.add_argument("--rounds", type=int, default=100, help="the most rounds per size")
    p.add_argument("--min-rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=1, help="timed steps per variant per round")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--recompile-backend", default="aot_eager", help="backend of part 2")
    p.add_argument("--recompile-batches", type=int, default=24)
    p.add_argument("--skip-recompiles", action="store_true")
    p.add_argument("--cold", action="store_true", help="use a fresh inductor cache dir")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.seq, args.batch, args.rounds, args.min_rounds = "64x2", 64, 4, 2, 2
        args.backend = args.recompile_backend = "eager"
        args.recompile_batches = 8
    args.recompile_size = (128, 2) if not args.quick else (64, 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = out_dir(args)
    shared = os.path.join(tempfile.gettempdir(), "isotrain-inductor-cache")
    cache = tempfile.mkdtemp(prefix="inductor-") if args.cold else shared
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache)
    ok, reason = compile_available(args.backend, device=args.device)
    if not ok:
        raise SystemExit(f"backend {args.backend!r} cannot run here: {reason}")
    load_before = os.getloadavg()[0]
    rows, recompiles = [], []
    with torch_threads(args.threads):
        for size in args.sizes.split(","):
            d, layers = (int(v) for v in size.lower().split("x"))
            torch._dynamo.reset()
            rows += bench_size(d, layers, args)
        if not args.skip_recompiles:
            batches = doc_batches(args, args.recompile_batches)
            for policy in ("longest, dynamic=False", "longest, dynamic=None",
                           "buckets, dynamic=False"):  # fmt: skip
                recompiles.append(run_policy(policy, batches, args))
        meta = run_meta("bench_compile.py", argv, load_before, args.device)
    meta["args"] = {k: v for k, v in vars(args).items() if k != "out"}
    res = {"meta": meta, "step_time": rows, "recompiles": recompiles,
           "checks": checks(rows, recompiles), "cuda_command": CUDA_CMD}  # fmt: skip
    md = markdown(rows, recompiles, meta) + "\n".join(checks_md(res["checks"]))
    return write_results(out, "compile", res, md)


if __name__ == "__main__":
    steady_malloc()
    raise SystemExit(main())
