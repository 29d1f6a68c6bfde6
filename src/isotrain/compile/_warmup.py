"""Warm-up: compile every shape (and mode) a run will see now, timed apart, with full coverage.

``warmup`` runs one forward (+ backward) per example batch with dynamo's recompile limit raised
to what the model's compiled blocks need, then reports any block call that still ran eagerly.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from isotrain._shared import (
    buffers_restored,
    cuda_devices,
    outside_stacklevel,
    restore_training_flags,
    training_flags,
)
from isotrain._torch_private import recompile_limit_at_least, tree_leaves
from isotrain.compile._regional import compiled_modules
from isotrain.compile._stats import (
    CompileStats,
    eager_counts,
    eager_reason,
    last_reason,
    track_compiles,
)

__all__ = ["warmup"]


def _as_call(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(batch, dict):
        return (), batch
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def _scalar(out: Any) -> torch.Tensor | None:
    """Sum of every floating tensor in ``out`` that needs a gradient, or None."""
    leaves = tree_leaves(out)
    parts = [t.float().sum() for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    return torch.stack(parts).sum() if parts else None


@contextlib.contextmanager
def _eval_no_grad(model: Any) -> Iterator[None]:
    flags = training_flags([model] if isinstance(model, nn.Module) else [])
    try:
        if isinstance(model, nn.Module):
            model.eval()
        with torch.no_grad():
            yield
    finally:
        restore_training_flags(flags)


def _limit_needed(module: nn.Module | None, n_shapes: int) -> int:
    """Graphs the warm-up may need per code object: compiled blocks x shapes x modes.

    Each block may need a graph of its own (an int attribute or a cache's structure is
    specialised per layer, a ResNet stage changes channels). Dynamo keeps one recompile limit
    per code object: one per block class for the block's own frame (NOTE [eager block calls]),
    but a frame nested in the blocks (a library's shared helper, a hook that graph-breaks) is
    one code object for every block of every class, so the limit covers all of them."""
    blocks = len(compiled_modules(module)) if module is not None else 0
    return max(blocks, 1) * n_shapes + 1


def _report(module: nn.Module | None, before: dict[int, int], stats: CompileStats) -> None:
    """Warn, naming the blocks, the failing guard and the fix, if a block call ran eagerly;
    and whenever dynamo gave up on a frame or hit its recompile limit during the warm-up."""
    if stats.failures or stats.recompile_limit_hits:
        _warn_failures(stats)
    if not stats.eager_block_calls:
        return
    after = eager_counts()
    named = [] if module is None else compiled_modules(module)
    eager = [(n, m) for n, m in named if after.get(id(m), 0) > before.get(id(m), 0)]
    names = ", ".join(n or "<root>" for n, _ in eager[:8]) + (" ..." if len(eager) > 8 else "")
    first = eager[0][1] if eager else None
    why = ", ".join(stats.eager_blocks)
    if first is not None:
        why = last_reason(first) or eager_reason(first)
    warnings.warn(
        f"warmup: {stats.eager_block_calls} of {stats.block_calls} compiled block calls ran "
        f"eagerly ({names or ', '.join(stats.eager_blocks)}); {why}",
        RuntimeWarning,
        stacklevel=outside_stacklevel(),
    )


def _warn_failures(stats: CompileStats) -> None:
    warnings.warn(
        f"warmup: dynamo gave up on {stats.failures} frame(s) and hit its recompile limit "
        f"{stats.recompile_limit_hits} time(s) while warming up (the limit was raised to cover "
        "every compiled block and shape); those frames run as plain Python from now on. A "
        "frame that needs more graphs than blocks x shapes specialises on a value that "
        "changes per call: make it a tensor or dynamic, or remove the graph break "
        "(TORCH_LOGS=recompiles,graph_breaks says which)",
        RuntimeWarning,
        stacklevel=outside_stacklevel(),
    )


def warmup(
    model_or_fn: nn.Module | Callable[..., Any],
    example_batches: Iterable[Any],
    *,
    backward: bool = True,
    params: Iterable[torch.Tensor] | None = None,
    also_eval: bool = False,
) -> CompileStats:
    """Run one forward (+ backward) per example batch so each shape compiles now, not mid-run.

    A batch is a tensor, a tuple of positional args or a dict of kwargs. Gradients go through
    ``torch.autograd.grad``, so ``.grad``, the RNG and (for a module) buffers are left as they
    were. ``also_eval`` adds one ``eval()`` + ``no_grad`` pass per batch (its own graphs).
    Dynamo's recompile limit is raised meanwhile so every block of a module can get its graphs;
    any block call that still ran eagerly is reported in one RuntimeWarning (and counted in
    ``eager_block_calls``). Call it under the same autocast as training: dynamo guards on it.

    Example: ``stats = warmup(model, [torch.zeros(8, L, dtype=torch.long) for L in buckets])``.
    """
    batches = list(example_batches)
    module = model_or_fn if isinstance(model_or_fn, nn.Module) else None
    if params is None and module is not None:
        params = module.parameters()
    elif params is None and backward:
        raise ValueError("warmup(fn, ...) with backward=True needs params=; or backward=False")
    wrt = [p for p in (params or ()) if p.requires_grad]
    n_shapes = len(batches) * (2 if also_eval else 1)
    before = eager_counts()
    with (
        track_compiles() as stats,
        torch.random.fork_rng(devices=cuda_devices(wrt)),
        recompile_limit_at_least(_limit_needed(module, n_shapes)),
        buffers_restored([module] if module is not None else []),
    ):
        for batch in batches:
            args, kwargs = _as_call(batch)
            loss = _scalar(model_or_fn(*args, **kwargs))
            if backward and loss is not None and wrt:
                torch.autograd.grad(loss, wrt, allow_unused=True)
            if also_eval:
                with _eval_no_grad(model_or_fn):
                    model_or_fn(*args, **kwargs)
    _report(module, before, stats)
    return stats
