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

    .venv/bin/python benchmarks/bench_compile.py                 # ~5 minutes on 2 shared cores
    .venv/bin/python benchmarks/bench_compile.py --quick         # seconds (aot_eager backend)
    python benchmarks/bench_compile.py --device cuda --sizes 768x12 --seq 1024 --dtype bf16  # GPU
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from isotrain.compile import (
    compile_available,
    compile_model,
    default_buckets,
    no_recompiles,
    pad_to_bucket,
    track_compiles,
    warmup,
)

RESULTS = Path(__file__).parent / "results"
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

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with self.autocast():
            logits = self.model(x)
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def timed(self, x: torch.Tensor, y: torch.Tensor, steps: int) -> float:
        sync(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step(x, y)
        sync(self.device)
        return (time.perf_counter() - t0) / steps


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
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(variants[name].timed(x, y, args.steps))
    rows = []
    params = sum(p.numel() for p in base.parameters())
    for name in names:
        ratios = [e / c for e, c in zip(times["eager"], times[name], strict=True)]
        w = warm.get(name)
        rows.append(
            dict(
                d_model=d, layers=layers, params=params, variant=name,
                step_ms=1e3 * statistics.median(times[name]),
                speedup=statistics.median(ratios),
                speedup_min=min(ratios), speedup_max=max(ratios),
                compile_s=w["stats"].compile_seconds if w else 0.0,
                first_step_s=w["stats"].wall_seconds if w else 0.0,
                graphs=w["stats"].compilations if w else 0,
                cache=cache_state(w, args.backend),
            )
        )  # fmt: skip
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()})
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


def write(rows: list[dict], recompiles: list[dict], args: argparse.Namespace, cmd: str) -> None:
    meta = dict(
        command=cmd, torch=torch.__version__, device=args.device, threads=torch.get_num_threads(),
        python=platform.python_version(), machine=platform.machine(), backend=args.backend,
        seq=args.seq, batch=args.batch, dtype=args.dtype, rounds=args.rounds, steps=args.steps,
        recompile_backend=args.recompile_backend, cuda_command=CUDA_CMD,
    )  # fmt: skip
    name = "compile_quick" if args.quick else "compile"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(
        json.dumps(dict(meta=meta, step_time=rows, recompiles=recompiles), indent=2)
    )
    lines = [
        "# torch.compile: step time, compile time, recompiles",
        "",
        f"`{cmd}` (torch {torch.__version__}, {args.device}, {meta['threads']} threads, "
        f"backend {args.backend}, T={args.seq}, B={args.batch}, {args.dtype}; shared machine). "
        "Step = forward + backward + AdamW. Speedup: median over interleaved rounds of "
        "eager/compiled step time [min, max]. Compile s: dynamo + backend time of the warm-up "
        "step (forward and backward); first step s: its wall time. Cache: inductor FX-graph "
        "cache state at the warm-up (cold = compiled from scratch).",
        "",
        "| d_model x layers | params | variant | step ms | speedup [min, max] | compile s "
        "| first step s | graphs | cache |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['d_model']}x{r['layers']} | {r['params'] / 1e6:.2f}M | {r['variant']} "
            f"| {r['step_ms']:.1f} | {r['speedup']:.2f} [{r['speedup_min']:.2f}, "
            f"{r['speedup_max']:.2f}] | {r['compile_s']:.1f} | {r['first_step_s']:.1f} "
            f"| {r['graphs']} | {r['cache']} |"
        )
    if recompiles:
        d, layers = args.recompile_size
        lines += [
            "",
            f"Variable-length run ({d}x{layers}, backend {args.recompile_backend}, "
            f"{recompiles[0]['batches']} batches of {args.batch} documents, 4..{args.seq + 1} "
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
    (RESULTS / f"{name}.md").write_text("\n".join(lines))
    print("\n".join(lines))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--sizes", default="128x4,384x6", help="d_model x layers, comma-separated")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="autocast dtype")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--recompile-backend", default="aot_eager", help="backend of part 2")
    p.add_argument("--recompile-batches", type=int, default=24)
    p.add_argument("--skip-recompiles", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--cold", action="store_true", help="use a fresh inductor cache dir")
    p.add_argument("--quick", action="store_true", help="seconds-long smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.seq, args.batch, args.rounds, args.steps = "64x2", 64, 4, 2, 1
        args.backend, args.recompile_batches = "aot_eager", 12
    args.recompile_size = (128, 2) if not args.quick else (64, 2)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    flags = sys.argv[1:] if argv is None else argv
    cmd = " ".join(["python benchmarks/bench_compile.py", *flags])
    if args.threads:
        torch.set_num_threads(args.threads)
    shared = os.path.join(tempfile.gettempdir(), "isotrain-inductor-cache")
    cache = tempfile.mkdtemp(prefix="inductor-") if args.cold else shared
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache)
    ok, reason = compile_available(args.backend, device=args.device)
    if not ok:
        raise SystemExit(f"backend {args.backend!r} cannot run here: {reason}")
    rows = []
    for size in args.sizes.split(","):
        d, layers = (int(v) for v in size.lower().split("x"))
        torch._dynamo.reset()
        rows += bench_size(d, layers, args)
    recompiles = []
    if not args.skip_recompiles:
        batches = doc_batches(args, args.recompile_batches)
        for policy in ("longest, dynamic=False", "longest, dynamic=None", "buckets, dynamic=False"):
            recompiles.append(run_policy(policy, batches, args))
    write(rows, recompiles, args, cmd)


if __name__ == "__main__":
    main()
