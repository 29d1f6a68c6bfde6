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
table reports the median over rounds of the mean time per iteration, the median of the
per-round ratios to the idiom, and the bytes each variant saves for backward.

    .venv/bin/python benchmarks/bench_autograd.py           # ~2 minutes on 2 shared cores
    .venv/bin/python benchmarks/bench_autograd.py --quick   # seconds, smoke run (aot_eager)

Writes benchmarks/results/autograd.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from isotrain.autograd import fake_quantize, fused_fake_quantize

RESULTS = Path(__file__).parent / "results"
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


def check_agreement(fns: dict[str, Callable], x: Tensor, up: Tensor) -> None:
    ref_y, ref_g = None, None
    for name, fn in fns.items():
        xr = x.detach().requires_grad_()
        y = fn(xr)
        (g,) = torch.autograd.grad(y, xr, up)
        if ref_y is None:
            ref_y, ref_g = y.detach(), g
        elif not (torch.allclose(y, ref_y, atol=1e-6) and torch.equal(g, ref_g)):
            raise RuntimeError(f"{name} disagrees with the detach idiom")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_once(fn: Callable, x: Tensor, up: Tensor, iters: int, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        torch.autograd.grad(fn(x), x, up)
    sync(device)
    return (time.perf_counter() - t0) / iters


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(args.numel, device=device, generator=gen) * 1.5).requires_grad_()
    up = torch.randn(args.numel, device=device, generator=gen)
    backend, note = pick_backend(args.backend, x)
    torch._dynamo.reset()
    fns: dict[tuple[str, str, str], Callable] = {}
    saved: dict[tuple[str, str], int] = {}
    for gradient in ("identity", "clipped"):
        eager = variants(gradient)
        check_agreement(eager, x, up)
        for name, fn in eager.items():
            saved[(gradient, name)] = saved_bytes(fn, x)
            fns[(gradient, name, "eager")] = fn
            fns[(gradient, name, "compiled")] = torch.compile(fn, backend=backend, fullgraph=True)
    t_compile = time.perf_counter()
    for fn in fns.values():  # warm-up: compiles every compiled variant once
        time_once(fn, x, up, 1, device)
    t_compile = time.perf_counter() - t_compile
    times: dict[tuple, list[float]] = {k: [] for k in fns}
    keys = list(fns)
    for r in range(args.rounds):
        order = keys[r % len(keys) :] + keys[: r % len(keys)]  # rotate the order each round
        for key in order:
            times[key].append(time_once(fns[key], x, up, args.iters, device))
    rows = []
    for gradient, name, mode in keys:
        base = times[(gradient, "detach_idiom", mode)]
        ratios = [t / b for t, b in zip(times[(gradient, name, mode)], base, strict=True)]
        rows.append({
            "gradient": gradient, "variant": name, "mode": mode,
            "median_ms": 1e3 * statistics.median(times[(gradient, name, mode)]),
            "ratio_to_detach_idiom": statistics.median(ratios),
            "saved_bytes_eager": saved[(gradient, name)],
        })  # fmt: skip
    return {
        "config": {
            "numel": args.numel, "dtype": "float32", "bits": BITS, "range": [LO, HI],
            "rounds": args.rounds, "iters_per_round": args.iters, "device": str(device),
            "compile_backend": backend, "note": note,
            "warmup_and_compile_s": round(t_compile, 1),
        },
        "env": {
            "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "loadavg_1m_at_end": round(os.getloadavg()[0], 1),
        },
        "rows": rows,
    }  # fmt: skip


def write(result: dict, stem: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    cfg = result["config"]
    lines = [
        "# Straight-through fake-quantize: forward + backward cost",
        "",
        f"{cfg['numel']:,} float32 elements on {cfg['device']}, {cfg['bits']}-bit, range "
        f"{cfg['range']}; compiled = `torch.compile(backend={cfg['compile_backend']!r}, "
        f"fullgraph=True)`. Median of {cfg['rounds']} interleaved rounds x "
        f"{cfg['iters_per_round']} iterations; ratio = median per-round ratio to the detach "
        f"idiom in the same mode; saved = bytes kept for backward, input included. "
        f"torch {result['env']['torch']}, {result['env']['threads']} threads, "
        f"{result['env']['cpu_count']} CPUs, load average "
        f"{result['env']['loadavg_1m_at_end']} at the end (a shared machine: trust ratios).",
        "",
    ]
    if cfg["note"]:
        lines += [f"**Note:** {cfg['note']}.", ""]
    lines += [
        "| STE | variant | mode | median ms | ratio vs idiom | saved (eager) |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['gradient']} | {r['variant']} | {r['mode']} | {r['median_ms']:.2f} | "
            f"{r['ratio_to_detach_idiom']:.2f}x | {r['saved_bytes_eager'] / 2**20:.1f} MiB |"
        )
    lines += ["", "Command: `.venv/bin/python benchmarks/bench_autograd.py`", ""]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="seconds-long smoke run")
    parser.add_argument("--numel", type=int, default=4 * 2**20, help="elements in the tensor")
    parser.add_argument("--rounds", type=int, default=11, help="interleaved rounds")
    parser.add_argument("--iters", type=int, default=2, help="iterations per variant per round")
    parser.add_argument("--backend", default="inductor", help="compile backend")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="autograd", help="results file stem")
    args = parser.parse_args()
    if args.quick:
        args.numel, args.rounds, args.iters = 2**16, 3, 2
        args.backend = "aot_eager" if args.backend == "inductor" else args.backend
        args.out = "autograd_quick" if args.out == "autograd" else args.out
    result = run(args)
    write(result, args.out)
    for r in result["rows"]:
        print(
            f"{r['gradient']:>8} {r['variant']:>12} {r['mode']:>8} {r['median_ms']:8.2f} ms "
            f"{r['ratio_to_detach_idiom']:5.2f}x  saved {r['saved_bytes_eager'] / 2**20:.1f} MiB"
        )
    print(f"wrote {RESULTS / args.out}.{{md,json}}")


if __name__ == "__main__":
    main()
