"""graph_break and recompile: what torch.compile would do with this model and these batches.

Compiles with backend="eager" (tracing only: cheap, no code generated) through a function
with its own code object per call, so dynamo's cache entries land on the doctor's code and
not on the user's (NOTE [fresh code]); `isotrain.compile.track_compiles` counts.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from isotrain._shared import find_blocks
from isotrain._torch_private import compile_metrics
from isotrain.compile import compile_available, track_compiles
from isotrain.doctor._context import CannotRun, Context
from isotrain.doctor._finding import Finding

__all__ = ["check_graph_breaks", "check_recompiles"]

# NOTE [fresh code]
# Dynamo keeps compiled graphs on the code object of the frame it traced. Tracing a fresh
# copy of `_call` (code.replace() makes a new code object) keeps every graph on a code object
# that dies with the check, so the user's own later torch.compile starts from an empty cache
# and its recompile limit is untouched. Only a graph break inside the model makes dynamo
# compile the user's frame after the break on its own; such entries carry the "eager" backend,
# which the user's compile never matches.


def _call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return fn(*args, **kwargs)


def _fresh_compiled() -> Callable[..., Any]:
    """torch.compile of a new copy of `_call`, static shapes (each new shape: a new graph, as
    with compile_model(dynamic=False) and length buckets)."""
    code = _call.__code__.replace()
    fn = types.FunctionType(code, _call.__globals__, "_doctor_trace")
    return torch.compile(fn, backend="eager", dynamic=False)


def _traced(model: nn.Module) -> nn.Module:
    """What torch.compile would trace: a DDP wrapper's module (dynamo skips DDP's own forward
    by design and splits the graph at its buckets)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _need_compile(model: nn.Module) -> None:
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    ok = compile_available("eager", device=device)
    if not ok:
        raise CannotRun(f"torch.compile cannot run here: {ok.reason}")


def _break_reasons() -> dict[str, int]:
    return dict(compile_metrics()[0].get("graph_break", {}))


def _block_inputs(ctx: Context, model: nn.Module) -> list[tuple[str, nn.Module, Any]]:
    """(name, block, (args, kwargs)) of the first block of each class, from one forward."""
    try:
        blocks = find_blocks(model)
    except ValueError:
        blocks = [("<model>", model)]
    first: dict[type, tuple[str, nn.Module]] = {}
    for name, b in blocks:
        first.setdefault(type(b), (name, b))
    seen: dict[str, Any] = {}
    handles = [
        b.register_forward_pre_hook(
            lambda m, a, k, n=name: seen.setdefault(n, (a, k)), with_kwargs=True
        )
        for name, b in first.values()
    ]
    args, kwargs = ctx.split(ctx.batches[0])
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return [(n, b, seen[n]) for n, b in first.values() if n in seen]


def check_graph_breaks(ctx: Context) -> list[Finding]:
    """graph_break: per block class, the breaks dynamo makes tracing it, with the reasons."""
    model = _traced(ctx.copies()[0])
    _need_compile(model)
    out = []
    for name, block, (args, kwargs) in _block_inputs(ctx, model):
        before = _break_reasons()
        with track_compiles() as stats, torch.no_grad():
            _fresh_compiled()(block, args, kwargs)
        if stats.graph_breaks:
            after = _break_reasons()
            reasons = [r.splitlines()[0] for r, n in after.items() if n > before.get(r, 0)]
            out.append(Finding(
                "graph_break", "warning", f"{name} ({type(block).__name__})",
                f"{stats.graph_breaks} graph break(s) tracing one call: {'; '.join(reasons[:3])}",
                "make the block traceable: no .item()/print/data-dependent Python `if` on "
                "tensors inside it (torch.where, torch.cond), then compile it per block with "
                "isotrain.compile.compile_model(model, fullgraph=True) to keep it so",
            ))  # fmt: skip
    return out


def check_recompiles(ctx: Context) -> list[Finding]:
    """recompile: compile the forward once, feed every batch; count what compiles again."""
    model = _traced(ctx.copies()[0])
    _need_compile(model)
    compiled = _fresh_compiled()
    with track_compiles() as stats, torch.no_grad():
        for batch in ctx.batches:
            args, kwargs = ctx.split(batch)
            compiled(model, args, kwargs)
    if not stats.recompiles:
        return []
    reasons = sorted({" ".join(r.split()) for r in stats.recompile_reasons})
    return [Finding(
        "recompile", "warning", "model forward",
        f"{len(ctx.batches)} batches made torch.compile compile {stats.recompiles} more "
        f"time(s): {'; '.join(reasons[:2])}",
        "give batches a few fixed shapes: isotrain.compile.pad_to_bucket(ids, buckets) with "
        "BucketBatchSampler, then isotrain.compile.warmup(model, ...) one graph per bucket and "
        "isotrain.compile.no_recompiles() to keep it so; pass changing ints as tensors",
    )]  # fmt: skip
