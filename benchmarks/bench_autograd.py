"""Cost of a straight-through fake-quantize: custom Function vs detach idiom vs custom op.

Times forward + backward (``torch.autograd.grad`` with a fixed upstream gradient) of an 8-bit
fake-quantize of a large tensor, three ways, each with the identity STE (the idiom
``x + (q - x).detach()``) and the clipped STE (idiom ``xc + (q - xc).detach()``,
``xc = x.clamp(lo, hi)``):

* ``detach_idiom``  plain PyTorch, the baseline of every ratio
* ``function``      ``isotrain.autograd.fake_quantize`` (a setup_context autograd.Function)
* ``custom_op``     ``isotrain.autograd.fused_fake_quantize`` (``isotrain::fake_quant``)

each eager and under ``torch.compile`` (inductor; falls back to aot_eager if inductor cannot
compile here, and says so). Variants are interleaved round by round, order rotating; the
table reports the median over rounds of the mean time per iteration, the per-round paired
time ratio to the idiom with its 95% interval (rounds continue until every interval is within
+-2%, stats.Stopper), and the bytes each variant saves for backward. Check: every variant's
output and gradient equal the idiom's.

    python benchmarks/bench_autograd.py           # ~2-4 minutes on 2 cores
    python benchmarks/bench_autograd.py --quick   # seconds, smoke run (aot_eager), temp dir

Writes autograd.{md,json} into benchmarks/results/<cpu-kind>/.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

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
from isotrain.autograd import fake_quantize, fused_fake_quantize
from stats import Stopper, fmt_ci, half_width, paired_ratios, summarize

COLUMNS = [
    "STE",
    "variant",
    "mode",
    "median ms",
    "time vs idiom [95% CI]",
    "CI half-width",
    "saved (eager)",
]
BITS, LO, HI = 8, -3.0, 3.0
STEP = (HI - LO) / (2**BITS - 1)


def _q(x: Tensor) -> Tensor:
    return torch.round((x.clamp(LO, HI) - LO) / STEP) * STEP + LO


def _idiom(gradient: str) -> Callable[[Tensor], Tensor]:
    if gradient == "identity":
        return lambda x: x + (_q(x) - x).detach()

    def clipped(x: Tensor) -> Tensor:
        xc = x.clamp(LO, HI)  # clamp's backward supplies the in-range mask
        return xc + (_q(x) - xc).detach()

    return clipped


def variants(gradient: str) -> dict[str, Callable[[Tensor], Tensor]]:
    kw = {"bits": BITS, "lo": LO, "hi": HI, "gradient": gradient}
    return {
        "detach_idiom": _idiom(gradient),
        "function": lambda x: fake_quantize(x, **kw),
        "custom_op": lambda x: fused_fake_quantize(x, **kw),
    }


class _Held:
    """What autograd keeps for one saved tensor; weakly referenced to see if it stays alive."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


def saved_bytes(fn: Callable[[Tensor], Tensor], x: Tensor) -> int:
    """Bytes of unique storages the output's graph still holds for backward, input included.

    Tensors saved by a branch that is detached (the idiom's ``q``) are freed with that branch
    and not counted.
    """
    held: list[weakref.ref] = []

    def pack(t: Tensor) -> _Held:
        h = _Held(t)
        held.append(weakref.ref(h))
        return h

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.tensor):
        y = fn(x)
    storages = {}
    for ref in held:
        if (h := ref()) is not None:
            storages[h.tensor.untyped_storage().data_ptr()] = h.tensor.untyped_storage().nbytes()
    del y
    return sum(storages.values())


def pick_backend(requested: str, x: Tensor) -> tuple[str, str]:
    """Return (backend, note); try inductor on a tiny graph and fall back to aot_eager."""
    if requested != "inductor":
        return requested, ""
    try:
        torch._dynamo.reset()
        torch.compile(lambda t: t.sin() + 1, backend="inductor", fullgraph=True)(x[:8])
        return "inductor", ""
    except Exception as exc:  # no C++ compiler, no Triton, ...
        return "aot_eager", f"inductor unavailable ({type(exc).__name__}); used aot_eager"


def agreement(fns: dict[str, Callable], x: Tensor, up: Tensor) -> list[str]:
    """Names of the variants whose output or gradient differs from the detach idiom's."""
    ref_y, ref_g, bad = None, None, []
    for name, fn in fns.items():
        xr = x.detach().requires_grad_()
        y = fn(xr)
        (g,) = torch.autograd.grad(y, xr, up)
        if ref_y is None:
            ref_y, ref_g = y.detach(), g
        elif not (torch.allclose(y, ref_y, atol=1e-6) and torch.equal(g, ref_g)):
            bad.append(name)
    return bad


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_once(fn: Callable, x: Tensor, up: Tensor, iters: int, device: torch.device) -> float:
    sync(device)
    now = time.process_time if device.type == "cpu" else time.perf_counter
    t0 = now()
    for _ in range(iters):
        torch.autograd.grad(fn(x), x, up)
    sync(device)
    return (now() - t0) / iters


def build(backend: str, x: Tensor, up: Tensor) -> tuple[dict, dict, list[str]]:
    """The variants (eager and compiled), their saved bytes, and any that disagree."""
    torch._dynamo.reset()
    fns: dict[tuple[str, str, str], Callable] = {}
    saved: dict[tuple[str, str], int] = {}
    bad: list[str] = []
    for gradient in ("identity", "clipped"):
        eager = variants(gradient)
        bad += [f"{gradient} {n} eager" for n in agreement(eager, x, up)]
        for name, fn in eager.items():
            saved[(gradient, name)] = saved_bytes(fn, x)
            fns[(gradient, name, "eager")] = fn
            fns[(gradient, name, "compiled")] = torch.compile(fn, backend=backend, fullgraph=True)
        compiled = {n: fns[(gradient, n, "compiled")] for n in eager}
        bad += [f"{gradient} {n} compiled" for n in agreement(compiled, x, up)]
    return fns, saved, bad


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(args.numel, device=device, generator=gen) * 1.5).requires_grad_()
    up = torch.randn(args.numel, device=device, generator=gen)
    backend, note = pick_backend(args.backend, x)
    fns, saved, bad = build(backend, x, up)
    t_compile = time.perf_counter()
    for fn in fns.values():  # warm-up: compiles every compiled variant once
        time_once(fn, x, up, 1, device)
    t_compile = time.perf_counter() - t_compile
    keys = list(fns)
    times: dict[tuple, list[float]] = {k: [] for k in keys}
    stopper = Stopper(lambda: ratios(times), min_rounds=min(args.min_rounds, args.rounds),
                      max_rounds=args.rounds)  # fmt: skip
    r = 0
    while not stopper(r):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:  # rotate the order
            times[key].append(time_once(fns[key], x, up, args.iters, device))
        r += 1
    rat = ratios(times)
    rows = []
    for gradient, name, mode in keys:
        key = f"{gradient} {name} {mode}"
        rows.append({
            "gradient": gradient, "variant": name, "mode": mode,
            "median_ms": 1e3 * statistics.median(times[(gradient, name, mode)]),
            "ratio_to_detach_idiom": summarize(rat[key]) if key in rat else None,
            "saved_bytes_eager": saved[(gradient, name)],
        })  # fmt: skip
    return {
        "config": {
            "numel": args.numel, "dtype": "float32", "bits": BITS, "range": [LO, HI],
            "iters_per_round": args.iters, "device": str(device),
            "compile_backend": backend, "note": note,
            "warmup_and_compile_s": round(t_compile, 1),
        },
        "stopping": stopper.record(r),
        "rows": rows,
        "checks": {"outputs and gradients equal the idiom's": check(
            not bad, f"variants that differ: {bad or 'none'}")},
    }  # fmt: skip


def ratios(times: dict[tuple, list[float]]) -> dict[str, list[float]]:
    """Per round, each variant's time over the idiom's in the same STE and mode."""
    out = {}
    for gradient, name, mode in times:
        if name != "detach_idiom" and times[(gradient, name, mode)]:
            pair = {
                "b": times[(gradient, "detach_idiom", mode)],
                "v": times[(gradient, name, mode)],
            }
            out[f"{gradient} {name} {mode}"] = paired_ratios(pair, "b", speed=False)["v"]
    return out


def markdown(result: dict[str, Any]) -> str:
    cfg, m = result["config"], result["meta"]
    lines = [
        "# Straight-through fake-quantize: forward + backward cost",
        "",
        f"Command: `{m['command']}`  ",
        f"Machine: {machine_line(m)}  ",
        f"{cfg['numel']:,} float32 elements on {cfg['device']}, {cfg['bits']}-bit, range "
        f"{cfg['range']}; compiled = `torch.compile(backend={cfg['compile_backend']!r}, "
        f"fullgraph=True)`. {result['stopping']['rounds']} interleaved rounds x "
        f"{cfg['iters_per_round']} iterations ({result['stopping']['reason']}); time vs idiom = "
        "per-round paired ratio to the detach idiom in the same mode (below 1: faster); saved = "
        "bytes kept for backward, input included. Clock: process CPU time on the CPU.",
        "",
    ]
    if cfg["note"]:
        lines += [f"**Note:** {cfg['note']}.", ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|---|---|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        s = r["ratio_to_detach_idiom"]
        lines.append(
            f"| {r['gradient']} | {r['variant']} | {r['mode']} | {r['median_ms']:.2f} | "
            f"{fmt_ci(s, 2) if s else '1 (reference)'} | "
            f"{f'+-{100 * half_width(s):.1f}%' if s else ''} | "
            f"{r['saved_bytes_eager'] / 2**20:.1f} MiB |"
        )
    return "\n".join([*lines, "", *checks_md(result["checks"])])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--numel", type=int, default=4 * 2**20, help="elements in the tensor")
    parser.add_argument("--rounds", type=int, default=200, help="the most interleaved rounds")
    parser.add_argument("--min-rounds", type=int, default=20)
    parser.add_argument("--iters", type=int, default=2, help="iterations per variant per round")
    parser.add_argument("--backend", default="inductor", help="compile backend")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.quick:
        args.numel, args.rounds, args.min_rounds, args.iters = 2**14, 3, 3, 1
        args.backend = "aot_eager" if args.backend == "inductor" else args.backend
    out = out_dir(args)
    load_before = os.getloadavg()[0]
    with torch_threads(args.threads):
        result = run(args)
        result["meta"] = run_meta("bench_autograd.py", argv, load_before, args.device)
    return write_results(out, "autograd", result, markdown(result))


if __name__ == "__main__":
    steady_malloc()
    raise SystemExit(main())
