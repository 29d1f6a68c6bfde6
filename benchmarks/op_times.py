"""A GPT step's big ops one by one, fp32 against bf16: which gain from bf16 on this core.

Each op runs on tensors of the dtype itself (no autocast casts), forward alone and forward
plus backward, fp32 and bf16 interleaved (order alternating), one call per round after a
warm-up; the table gives the median per-round time ratio bf16 / fp32 with its 95% interval
(below 1: bf16 is faster). Shapes: the `small` preset's (d 384, 6 heads, T 256) at batch 16,
vocabulary 256, so a row reads as that model's op. `bench_profile.py` writes the table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from common import clock
from stats import paired_ratios, summarize

__all__ = ["OP_SHAPE", "op_rows", "op_table"]

OP_SHAPE = {"batch": 16, "block": 256, "d_model": 384, "heads": 6, "vocab": 256}
QUICK_SHAPE = {"batch": 2, "block": 32, "d_model": 32, "heads": 2, "vocab": 64}


def _linear(m: int, k: int, n: int) -> Callable[[torch.dtype, torch.Generator], tuple[Any, ...]]:
    def make(dtype: torch.dtype, gen: torch.Generator) -> tuple[Any, ...]:
        x = torch.randn(m, k, generator=gen).to(dtype).requires_grad_()
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).requires_grad_()
        return F.linear, (x, w), {}

    return make


def _sdpa(
    b: int, h: int, t: int, d: int
) -> Callable[[torch.dtype, torch.Generator], tuple[Any, ...]]:
    def make(dtype: torch.dtype, gen: torch.Generator) -> tuple[Any, ...]:
        q, k, v = (torch.randn(b, h, t, d, generator=gen).to(dtype).requires_grad_() for _ in "qkv")
        return F.scaled_dot_product_attention, (q, k, v), {"is_causal": True}

    return make


def ops(
    shape: dict[str, int],
) -> dict[str, Callable[[torch.dtype, torch.Generator], tuple[Any, ...]]]:
    """The ops of one block (and the LM head), named with their shapes."""
    m, d, v = shape["batch"] * shape["block"], shape["d_model"], shape["vocab"]
    b, h, t = shape["batch"], shape["heads"], shape["block"]
    return {
        f"qkv projection ({m}x{d} @ {d}x{3 * d})": _linear(m, d, 3 * d),
        f"attention out projection ({m}x{d} @ {d}x{d})": _linear(m, d, d),
        f"MLP fc1 ({m}x{d} @ {d}x{4 * d})": _linear(m, d, 4 * d),
        f"MLP fc2 ({m}x{4 * d} @ {4 * d}x{d})": _linear(m, 4 * d, d),
        f"LM head ({m}x{d} @ {d}x{v})": _linear(m, d, v),
        f"SDPA causal ({b}x{h}x{t}x{d // h})": _sdpa(b, h, t, d // h),
    }


def _timed(
    fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], backward: bool, tick: Any
) -> float:
    for a in args:
        a.grad = None
    t0 = tick()
    out = fn(*args, **kwargs)
    if backward:
        out.backward(torch.ones_like(out))
    return float(tick() - t0)


def op_rows(shape: dict[str, int], *, rounds: int, clock_name: str) -> list[dict[str, Any]]:
    """Per op: bf16 / fp32 time ratio (median [95% CI]) forward, and forward + backward."""
    tick, rows = clock(clock_name), []
    for name, make in ops(shape).items():
        gen = torch.Generator().manual_seed(0)
        inputs = {dt: make(dt, gen) for dt in (torch.float32, torch.bfloat16)}
        row: dict[str, Any] = {"op": name}
        for backward in (False, True):
            times: dict[str, list[float]] = {"fp32": [], "bf16": []}
            for r in range(rounds + 1):  # round 0 warms up (kernel choice, packing)
                order = (torch.float32, torch.bfloat16)[:: 1 if r % 2 else -1]
                for dt in order:
                    t = _timed(*inputs[dt], backward, tick)
                    if r:
                        times["fp32" if dt == torch.float32 else "bf16"].append(t)
            ratios = paired_ratios(times, "fp32", speed=False)["bf16"]
            row["forward + backward" if backward else "forward"] = summarize(ratios)
            row[f"fp32 ms ({'fwd+bwd' if backward else 'fwd'})"] = 1e3 * min(times["fp32"])
        rows.append(row)
    return rows


def op_table(rows: list[dict[str, Any]], fmt: Callable[[dict[str, float]], str]) -> list[str]:
    """The markdown table of `op_rows`."""
    lines = [
        "| op | bf16 / fp32 time, forward [95% CI] | bf16 / fp32 time, forward + backward [95% CI] "
        "| fp32 ms (fwd / fwd+bwd, best) |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['op']} | {fmt(r['forward'])} | {fmt(r['forward + backward'])} "
            f"| {r['fp32 ms (fwd)']:.2f} / {r['fp32 ms (fwd+bwd)']:.2f} |"
        )
    return lines
