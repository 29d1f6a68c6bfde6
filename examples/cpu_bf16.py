"""bf16 training on a CPU without native bf16: stock nn.Linear against Bf16Linear.

Two copies of one MLP, same initial weights and batches, trained under CPU bf16 autocast: one
with stock ``nn.Linear`` layers, one converted with ``bf16_linear_layers``. On x86 CPUs with
AVX2 but no AVX-512 the converted copy runs several times faster (its matmuls take the fast
operand layouts); the losses agree to bf16 rounding. Elsewhere the conversion is normally a
no-op; this example forces it so the comparison runs on any CPU.

    python examples/cpu_bf16.py            # about 25 s of CPU time
    python examples/cpu_bf16.py --smoke

Measured once on 2 CPU cores shared with other jobs, on an Intel Xeon *with* native bf16
(AVX512-BF16): 25 s of CPU time, 68 s wall; both copies 2.3041 -> 0.0005, stock 1033 ms/step,
Bf16Linear 1190 ms/step (0.87x). So on such a CPU the conversion buys nothing, as said above;
the speed-up shows on AVX2-only CPUs (README: 10.30 s -> 2.61 s per step on an AMD EPYC).

Patterns: ``bf16_linear_layers`` (in place, same parameters and keys), ``autocast_if_available``
(CPU bf16 autocast that undoes itself), ``StepGuard`` (clipped, guarded optimizer steps).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F
from torch import nn

from isotrain.autograd import bf16_linear_layers, native_bf16_matmul
from isotrain.contexts import autocast_if_available
from isotrain.guard import StepGuard


def make_model(width: int, classes: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.GELU(),
        nn.Linear(width, classes),
    )  # fmt: skip


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> tuple[float, ...]:
    """First loss, last loss, and milliseconds per step (after one warm-up step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = StepGuard(opt, model, max_norm=1.0, spike_k=None)
    losses, start = [], 0.0
    for step in range(steps + 1):
        if step == 1:
            start = time.perf_counter()
        with autocast_if_available(torch.bfloat16, device="cpu"):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        guard.step(loss.detach())
        losses.append(loss.item())
    return losses[0], losses[-1], 1e3 * (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="small and quick, for the test suite")
    args = p.parse_args(argv)
    width, batch, steps = (64, 128, 8) if args.smoke else (384, 1024, 20)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, width, generator=g)
    y = (x @ torch.randn(width, 10, generator=g)).argmax(-1)  # a random linear teacher
    print(f"native bf16 matmul on this CPU: {native_bf16_matmul()}")
    stock = make_model(width, 10, seed=1)
    fast = bf16_linear_layers(copy.deepcopy(stock), force=True)
    assert list(fast.state_dict()) == list(stock.state_dict())  # same keys, same weights
    a0, a1, a_ms = train(stock, x, y, steps)
    b0, b1, b_ms = train(fast, x, y, steps)
    print(f"nn.Linear:  loss {a0:.4f} -> {a1:.4f}, {a_ms:.1f} ms/step")
    print(f"Bf16Linear: loss {b0:.4f} -> {b1:.4f}, {b_ms:.1f} ms/step ({a_ms / b_ms:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
