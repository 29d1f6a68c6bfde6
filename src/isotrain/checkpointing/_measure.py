"""Activation-memory and recompute accounting for activation checkpointing, on any device.

Counts the bytes autograd keeps for backward (unique storages, parameters excluded), per
block, plus the outputs a selective-checkpoint cache holds; and the FLOPs recomputation adds.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from isotrain._shared import BlockSpec, buffers_restored, cuda_devices, find_blocks
from isotrain._torch_private import tree_leaves
from isotrain.checkpointing._state import _Recorder, _State
from isotrain.checkpointing._wrap import is_checkpointed

__all__ = ["BlockStats", "MemoryReport", "measure_activation_memory"]


@dataclasses.dataclass(frozen=True)
class BlockStats:
    """One block's saved-activation bytes and forward FLOPs, as measured.

    Example: ``[b.saved_bytes for b in measure_activation_memory(model, x).blocks]``
    """

    name: str
    saved_bytes: int
    forward_flops: int
    checkpointed: bool


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Saved-for-backward bytes per block and in total, FLOPs, and the CUDA peak when on CUDA.

    `other_bytes` is what code outside the blocks saves (embedding, head, loss).
    `recompute_flops` = FLOPs of forward+backward with checkpointing minus without (None when
    not measured).
    `peak_bytes` is CUDA max_memory_allocated during forward+backward above the level before it
    (None off CUDA).

    Example: ``print(measure_activation_memory(model, x).table())``
    """

    blocks: tuple[BlockStats, ...]
    other_bytes: int
    forward_flops: int
    backward_flops: int
    recompute_flops: int | None
    peak_bytes: int | None = None

    @property
    def total_bytes(self) -> int:
        return self.other_bytes + sum(b.saved_bytes for b in self.blocks)

    def table(self) -> str:
        """A markdown table: one row per block, then the totals."""
        rows = ["| block | checkpointed | saved MB | fwd GFLOP |", "|---|---|---:|---:|"]
        for b in self.blocks:
            rows.append(
                f"| {b.name} | {'yes' if b.checkpointed else 'no'} | "
                f"{b.saved_bytes / 1e6:.3f} | {b.forward_flops / 1e9:.4f} |"
            )
        rows.append(f"| (outside blocks) | | {self.other_bytes / 1e6:.3f} | |")
        rows.append(f"| **total** | | **{self.total_bytes / 1e6:.3f}** | |")
        return "\n".join(rows)

    def __str__(self) -> str:
        peak = "n/a (not CUDA)" if self.peak_bytes is None else f"{self.peak_bytes / 1e6:.1f} MB"
        rec = "n/a" if self.recompute_flops is None else f"{self.recompute_flops / 1e9:.4f}"
        return (
            f"{self.table()}\n"
            f"forward {self.forward_flops / 1e9:.4f} GFLOP, backward "
            f"{self.backward_flops / 1e9:.4f} GFLOP (recompute {rec} GFLOP), CUDA peak {peak}"
        )


def _cpu_flash_fwd(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_flash_bwd(
    grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any
) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


def _flop_counter() -> FlopCounterMode:
    # NOTE [cpu sdpa flops]: torch's registry omits the CPU flash kernels; count them the same way.
    aten = torch.ops.aten
    mapping: dict[Any, Callable[..., int]] = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        mapping[aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_flash_fwd
        mapping[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _cpu_flash_bwd
    return FlopCounterMode(display=False, custom_mapping=mapping)


@contextlib.contextmanager
def _bypass_checkpointing() -> Iterator[None]:
    prev, _State.bypass = _State.bypass, True
    try:
        yield
    finally:
        _State.bypass = prev


@contextlib.contextmanager
def _scoped_grads(model: nn.Module) -> Iterator[None]:
    """Run a backward without leaving gradients behind: restore each parameter's .grad."""
    saved = [(p, p.grad) for p in model.parameters()]
    for p, _ in saved:
        p.grad = None  # backward accumulates in place: keep it off the caller's tensors
    try:
        yield
    finally:
        for p, g in saved:
            p.grad = g


def _default_loss(out: Any) -> torch.Tensor:
    """Sum of every output tensor with a gradient (tuples, dicts, HF ModelOutput alike)."""
    floats = [
        t.float().sum()
        for t in tree_leaves(out)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
    ]
    if not floats:
        raise ValueError(
            "measure_activation_memory needs a floating-point output with a gradient to "
            "backpropagate from; pass loss_fn=lambda out: ... returning a scalar tensor."
        )
    return torch.stack(floats).sum()


def profile_forward(
    model: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    inputs: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
) -> tuple[Any, dict[str, int], dict[str, int], FlopCounterMode]:
    """One forward under the byte recorder and a FLOP counter; per-block bytes and FLOPs."""
    params = [*model.parameters(), *model.buffers()]
    rec = _Recorder({p.untyped_storage().data_ptr() for p in params})
    counter = _flop_counter()
    flops: dict[str, int] = {}
    start: dict[str, int] = {}

    def pre(name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any) -> None:
            rec.stack.append(name)
            start[name] = counter.get_total_flops()

        return hook

    def post(name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            rec.stack.pop()
            flops[name] = flops.get(name, 0) + counter.get_total_flops() - start[name]

        return hook

    handles = []
    for name, mod in blocks:
        handles.append(mod.register_forward_pre_hook(pre(name)))
        handles.append(mod.register_forward_hook(post(name)))
    prev, _State.recorder = _State.recorder, rec
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack(rec), lambda t: t), counter:
            out = model(*inputs, **(kwargs or {}))
    finally:
        _State.recorder = prev
        for h in handles:
            h.remove()
    return out, rec.bytes, flops, counter


def _pack(rec: _Recorder) -> Callable[[torch.Tensor], torch.Tensor]:
    def pack(t: torch.Tensor) -> torch.Tensor:
        rec.add(t)
        return t

    return pack


def measure_activation_memory(
    model: nn.Module,
    *example_inputs: Any,
    example_kwargs: dict[str, Any] | None = None,
    modules: BlockSpec = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    recompute: bool = True,
) -> MemoryReport:
    """Measure saved-activation bytes per block and the recompute FLOPs of the current wrapping.

    Runs `model(*example_inputs, **example_kwargs)` forward and backward under a forked RNG,
    restoring parameter gradients and every buffer (BatchNorm statistics), so training state is
    untouched; `recompute=True` adds an unwrapped pass for `recompute_flops` (skip it when the
    unwrapped model would not fit).

    Example:
        >>> report = measure_activation_memory(model, x, modules=(Block,))
        >>> hf = measure_activation_memory(gpt2, example_kwargs={"input_ids": x, "labels": x})
        >>> print(report)             # per-block table, totals, FLOPs
    """
    blocks = find_blocks(model, modules, purpose="blocks to measure")
    loss_fn = loss_fn or _default_loss
    kwargs = dict(example_kwargs or {})
    devices = [torch.device("cuda", i) for i in cuda_devices((example_inputs, kwargs))]
    with (
        torch.random.fork_rng(devices=devices),
        _scoped_grads(model),
        buffers_restored([model]),
        torch.enable_grad(),
    ):
        base_alloc = _cuda_reset(devices)
        out, saved, fwd_flops, counter = profile_forward(model, blocks, example_inputs, kwargs)
        forward = counter.get_total_flops()
        with _flop_counter() as bwd_counter:
            loss_fn(out).backward()
        peak = _cuda_peak(devices, base_alloc)
        del out
        plain = None
        if recompute:
            with _bypass_checkpointing(), _flop_counter() as plain:
                loss_fn(model(*example_inputs, **kwargs)).backward()
    backward = bwd_counter.get_total_flops()
    stats = tuple(
        BlockStats(n, saved.get(n, 0), fwd_flops.get(n, 0), is_checkpointed(m)) for n, m in blocks
    )
    return MemoryReport(
        blocks=stats,
        other_bytes=saved.get("", 0),
        forward_flops=forward,
        backward_flops=backward,
        recompute_flops=None if plain is None else forward + backward - plain.get_total_flops(),
        peak_bytes=peak,
    )


def _cuda_reset(devices: list[torch.device]) -> dict[torch.device, int]:
    base = {}
    for d in devices:
        torch.cuda.synchronize(d)
        torch.cuda.reset_peak_memory_stats(d)
        base[d] = torch.cuda.memory_allocated(d)
    return base


def _cuda_peak(devices: list[torch.device], base: dict[torch.device, int]) -> int | None:
    if not devices:
        return None
    peak = 0
    for d in devices:
        torch.cuda.synchronize(d)  # sync: measurement only, never in the training step
        peak += torch.cuda.max_memory_allocated(d) - base[d]
    return peak
