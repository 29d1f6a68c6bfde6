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
from isotrain._torch_private import compile_metrics, compiled_call
from isotrain.compile import compile_available, track_compiles
from isotrain.doctor.ground.context import CannotRun, Context, inner
from isotrain.doctor.ground.finding import Finding, Severity
from isotrain.doctor.ground.kinds import Check, Kind

__all__ = ["GRAPH_BREAK", "RECOMPILE", "check_graph_breaks", "check_recompiles", "user_compiles"]

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
    ctx.forward_once(model, handles)
    return [(n, b, seen[n]) for n, b in first.values() if n in seen]


# reason dynamo gives (its first words) -> (by design: info, the fix for that cause)
_REASONS: list[tuple[str, bool, str]] = [
    ("RNN, GRU, or LSTM", True,
     "dynamo runs RNN/GRU/LSTM eagerly by design (their fused kernels gain nothing); to trace "
     "them anyway: `with torch._dynamo.config.patch(allow_rnn=True):` around the compile"),
    ("torch.compiler.disable", True, "the function is excluded from compile on purpose"),
    ("Data-dependent branching", False,
     "replace the Python `if` on a tensor with torch.where (both sides computed) or torch.cond"),
    ("item()", False,
     "keep the value a tensor inside the block (or torch._dynamo.config.capture_scalar_outputs"
     " = True to trace .item())"),
    ("print", False, "log outside the compiled block (or at log steps only)"),
]  # fmt: skip
_GENERIC_FIX = (
    "the reason names the construct dynamo cannot trace: move it out of the block or replace "
    "it, then compile per block with isotrain.compile.compile_model(model, fullgraph=True)"
)


def _diagnose(reasons: list[str]) -> tuple[bool, str]:
    """(every reason by design, the fix for the first reason isotrain knows)."""
    known = [next((r for r in _REASONS if r[0] in text), None) for text in reasons]
    fix = next((r[2] for r in known if r is not None), _GENERIC_FIX)
    return all(r is not None and r[1] for r in known), fix


def user_compiles(ctx: Context) -> bool:
    """Whether the user's setup compiles: a compiled model or submodule, or a compiled step."""
    if ctx.asked & {"graph_break", "recompile"}:
        return True  # named in checks=[...]: judged as if compiled
    if getattr(ctx.step, "_torchdynamo_orig_callable", None) is not None:
        return True
    root = ctx.model
    return inner(root) is not root or any(compiled_call(m) is not None for m in root.modules())


def check_graph_breaks(ctx: Context) -> list[Finding]:
    """graph_break: per block class, the breaks dynamo makes tracing it, with the reasons: a
    warning where the user compiles, info where a break is by design or nothing compiles."""
    model = inner(ctx.fresh()[0])  # DDP's forward is skipped by dynamo by design
    _need_compile(model)
    compiles, out = user_compiles(ctx), []
    for name, block, (args, kwargs) in _block_inputs(ctx, model):
        before = _break_reasons()
        with track_compiles() as stats, torch.no_grad():
            _fresh_compiled()(block, args, kwargs)
        if stats.graph_breaks:
            after = _break_reasons()
            reasons = [r.splitlines()[0] for r, n in after.items() if n > before.get(r, 0)]
            by_design, fix = _diagnose(reasons)
            evidence = f"{stats.graph_breaks} graph break(s) tracing one call: "
            evidence += "; ".join(reasons[:3])
            if not compiles:
                evidence += " (your setup does not compile: this matters once it does)"
            sev: Severity = "warning" if compiles and not by_design else "info"
            out.append(Finding("graph_break", sev, f"{name} ({type(block).__name__})",
                               evidence, fix))  # fmt: skip
    return out


def check_recompiles(ctx: Context) -> list[Finding]:
    """recompile: compile the forward once, feed every batch; count what compiles again."""
    model = inner(ctx.fresh()[0])
    _need_compile(model)
    compiled = _fresh_compiled()
    with track_compiles() as stats, torch.no_grad():
        for call in [ctx.call(b) for b in ctx.batches]:
            if call.forward is not None:
                compiled(call.forward, (model, *call.args), {})
            else:
                compiled(model, call.args, call.kwargs)
    if not stats.recompiles:
        return []
    reasons = sorted({" ".join(r.split()) for r in stats.recompile_reasons})
    compiles = user_compiles(ctx)
    note = "" if compiles else " (your setup does not compile: this matters once it does)"
    return [Finding(
        "recompile", "warning" if compiles else "info", "model forward",
        f"{len(ctx.batches)} batches made torch.compile compile {stats.recompiles} more "
        f"time(s): {'; '.join(reasons[:2])}{note}",
        "give batches a few fixed shapes: isotrain.compile.pad_to_bucket(ids, buckets) with "
        "BucketBatchSampler, then isotrain.compile.warmup(model, ...) one graph per bucket and "
        "isotrain.compile.no_recompiles() to keep it so; pass changing ints as tensors",
    )]  # fmt: skip


GRAPH_BREAK = Check(
    "graph_break",
    (Kind("graph_break", "torch.compile splits a block's graph, with the reasons"),),
    check_graph_breaks,
    fast=False,
    traces=True,
)


RECOMPILE = Check(
    "recompile",
    (Kind("recompile", "your batches make torch.compile compile again (varying shapes)"),),
    check_recompiles,
    fast=False,
    traces=True,
)
