"""memory (info): saved activation bytes per block, and the checkpointing policy that halves
them, measured with `isotrain.checkpointing.measure_activation_memory` on copies."""

from __future__ import annotations

import copy
import warnings
from typing import Any

from torch import nn

from isotrain._shared import find_blocks
from isotrain.checkpointing import (
    MemoryReport,
    apply_activation_checkpointing,
    measure_activation_memory,
)
from isotrain.doctor.ground.context import CannotRun, Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind

__all__ = ["MEMORY", "check_memory"]


def _block_spec(model: nn.Module) -> Any:
    """None (the children of a ModuleList) when that finds blocks, else the composite class
    that repeats most among container children (a ResNet's BasicBlock, never a bare Linear)."""
    try:
        find_blocks(model)
        return None
    except ValueError:
        pass
    counts: dict[type[nn.Module], int] = {}
    for mod in model.modules():
        if isinstance(mod, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            for child in mod.children():
                composite = next(child.children(), None) is not None  # a block, not a layer
                if composite and not isinstance(
                    child, (nn.Sequential, nn.ModuleList, nn.ModuleDict)
                ):
                    counts[type(child)] = counts.get(type(child), 0) + 1
    best = max(counts.items(), key=lambda kv: kv[1], default=(None, 0))
    if best[0] is None or best[1] < 2:
        raise CannotRun("found no repeated blocks to measure (no nn.ModuleList of blocks)")
    return (best[0],)


def _wrapped(model: nn.Module, policy: str, spec: Any) -> nn.Module:
    trial = copy.deepcopy(model)
    apply_activation_checkpointing(trial, policy=policy, modules=spec)
    return trial


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def check_memory(ctx: Context) -> list[Finding]:
    """Saved bytes per block, and the first policy that halves the total."""
    call = ctx.call(ctx.batches[0])
    if call.forward is not None:
        raise CannotRun("it measures the model's own call, and forward= replaces that call")
    model = ctx.copies()
    spec = _block_spec(model)
    args, kwargs = call.args, call.kwargs

    def measure(m: nn.Module) -> MemoryReport:
        with warnings.catch_warnings():  # e.g. HF's use_cache note: about a trial, not the user
            warnings.simplefilter("ignore", UserWarning)
            return measure_activation_memory(
                m, *args, example_kwargs=kwargs, modules=spec, recompute=False
            )

    try:
        base = measure(model)
    except Exception as e:  # the copy's forward, not the doctor's: a setup a copy breaks
        first = (str(e).splitlines() or [""])[0][:120]
        raise CannotRun(
            f"a deep copy of the model does not run as the model does ({type(e).__name__}: "
            f"{first}), and this check measures a copy"
        ) from e
    if base.total_bytes == 0:
        raise CannotRun("the forward saved no activations for backward")
    per_block = ", ".join(f"{b.name} {_mb(b.saved_bytes)}" for b in base.blocks[:4])
    more = f" (+{len(base.blocks) - 4} blocks)" if len(base.blocks) > 4 else ""
    evidence = (
        f"saved for backward: {_mb(base.total_bytes)} per micro-batch; {per_block}{more}; "
        f"outside blocks {_mb(base.other_bytes)}"
    )
    half = base.total_bytes / 2
    full = measure(_wrapped(model, "full", spec))
    choice = ("full", full) if full.total_bytes <= half else None
    if base.total_bytes - (base.total_bytes - full.total_bytes) / 2 <= half:
        every = measure(_wrapped(model, "every:2", spec))  # half the blocks may do: measure
        if every.total_bytes <= half:
            choice = ("every:2", every)
    fix = "no policy halves it: most saved bytes are outside the blocks"
    if choice is not None:
        policy, report = choice
        fix = (
            f"apply_activation_checkpointing(model, policy={policy!r}) brings it to "
            f"{_mb(report.total_bytes)} ({report.total_bytes / base.total_bytes:.0%}), "
            "recomputing the checkpointed blocks' forward in backward"
        )
    where = f"{len(base.blocks)} blocks: {base.blocks[0].name} .. {base.blocks[-1].name}"
    return [Finding("memory", "info", where, evidence, fix)]


MEMORY = Check(
    "memory",
    (
        Kind(
            "memory",
            "saved activation bytes per block and the checkpointing policy that halves them",
        ),
    ),
    check_memory,
)
