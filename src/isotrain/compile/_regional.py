"""torch.compile without recompile storms: in-place per-block compile with an eager fallback,
recompile accounting, one warm-up compile per length bucket, then no recompiles allowed.

Example::

    model = compile_model(model, dynamic=False)       # compiles each block of model.blocks
    shapes = [torch.zeros(8, L, dtype=torch.long) for L in default_buckets(256)]
    stats = warmup(model, shapes)                      # one compile per bucket, timed apart
    with no_recompiles():                              # any new graph now raises
        train(model)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import sysconfig
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from isotrain._shared import (
    BlockSpec,
    cuda_devices,
    find_blocks,
    restore_training_flags,
    training_flags,
)
from isotrain._torch_private import (
    compile_metrics,
    compiled_call,
    dynamo_backends,
    dynamo_supported,
    eager_call,
    has_triton,
    is_dynamo_error,
    is_recompile_error,
    recompile_limit_at_least,
    set_compiled_call,
    tree_leaves,
)

__all__ = [
    "CompileAvailability",
    "CompileStats",
    "compile_available",
    "compile_counters",
    "compile_model",
    "no_recompiles",
    "track_compiles",
    "warmup",
]


@dataclass(frozen=True)
class CompileAvailability:
    """Whether a backend can compile here (truthy when it can) and why.

    Example: ``if not (avail := compile_available("inductor")): print(avail.reason)``
    """

    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok

    def __iter__(self) -> Iterator[Any]:  # ok, reason = compile_available(...)
        return iter((self.ok, self.reason))


def _find_cxx() -> str | None:
    names = [os.environ.get("CXX"), "clang++" if sys.platform == "darwin" else "g++", "c++"]
    if sys.platform == "win32":
        names = [os.environ.get("CXX"), "cl"]
    return next((p for n in names if n and (p := shutil.which(n))), None)


def compile_available(
    backend: str | Callable[..., Any] = "inductor", *, device: str | torch.device = "cpu"
) -> CompileAvailability:
    """Check, without compiling anything, whether ``backend`` can run on ``device`` here.

    Example: ``ok, reason = compile_available("inductor", device="cpu")``.
    """
    if not dynamo_supported():
        return CompileAvailability(False, f"torch.compile is not supported on Python {sys.version}")
    if callable(backend):
        return CompileAvailability(True, f"custom backend {getattr(backend, '__name__', backend)}")
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a name or a callable, got {type(backend).__name__}")
    known = dynamo_backends()
    if backend not in known:
        return CompileAvailability(False, f"unknown backend {backend!r}; known: {known}")
    dev = torch.device(device).type
    if backend != "inductor":
        return CompileAvailability(True, f"backend {backend!r} needs no toolchain")
    if dev == "cpu":
        cxx = _find_cxx()
        if cxx is None:
            return CompileAvailability(False, "inductor on CPU needs a C++ compiler (set CXX)")
        header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
        if not os.path.exists(header):
            return CompileAvailability(False, f"inductor on CPU needs Python headers ({header})")
        return CompileAvailability(True, f"inductor on CPU with {cxx}")
    if dev == "cuda":
        if not torch.cuda.is_available():
            return CompileAvailability(False, "device is cuda but torch.cuda is not available")
        if not has_triton():
            return CompileAvailability(False, "inductor on CUDA needs triton (pip install triton)")
        return CompileAvailability(True, "inductor on CUDA with triton")
    return CompileAvailability(True, f"inductor on {dev}: toolchain not checked")


# NOTE [eager fallback]
# block.compile() stores torch.compile(block._call_impl) in block._compiled_call_impl, which
# nn.Module.__call__ prefers; the parameters and state-dict keys stay where they were. We wrap
# that callable: when dynamo or the backend fails, we rerun the call eagerly. If the eager call
# fails too, the error is the user's (e.g. a shape bug): raise the eager error and keep the
# compiled path. If it succeeds, compiling is what broke: warn once and switch every module of
# the same compile_model call back to eager for good. Recompile errors of no_recompiles() are
# not compile failures and always propagate.
class _FallbackGroup:
    """The modules of one compile_model call: they fall back to eager together."""

    def __init__(self, backend: object) -> None:
        self.backend, self.failed = backend, False
        self.modules: list[nn.Module] = []

    def disable(self, err: BaseException) -> None:
        for m in self.modules:
            set_compiled_call(m, None)
        if not self.failed:
            self.failed = True
            first = (str(err).strip().splitlines() or [""])[0][:300]
            warnings.warn(
                f"torch.compile failed with backend {self.backend!r} ({type(err).__name__}: "
                f"{first}); running {len(self.modules)} module(s) eagerly from now on. "
                "Fix the toolchain or pass fallback=False to compile_model to see the error.",
                RuntimeWarning,
                stacklevel=3,
            )


class _GuardedCall:
    __slots__ = ("compiled", "group", "module")

    def __init__(
        self, module: nn.Module, compiled: Callable[..., Any], group: _FallbackGroup
    ) -> None:
        self.module, self.compiled, self.group = module, compiled, group

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.compiled(*args, **kwargs)
        except Exception as err:
            if not is_dynamo_error(err) or is_recompile_error(err):
                raise
            try:
                out = eager_call(self.module, *args, **kwargs)
            except Exception as eager_err:
                raise eager_err from err  # the user's error: keep the compiled path
            self.group.disable(err)
            return out


def _model_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


# NOTE [buckets and dynamic]
# With dynamic=None torch compiles the first shape static, then on the second distinct length
# marks that dim dynamic and compiles one symbolic graph (automatic_dynamic_shapes). With a few
# length buckets we prefer dynamic=False: one static graph per bucket (best kernels, CUDA graphs
# possible), all compiled by warmup() up front; blocks share the graphs (same code, same
# shapes). Keep the batch size fixed (drop_last) or each short batch is one more shape, and
# eval under no_grad is one more graph per bucket (warmup(..., also_eval=True)).
def compile_model(
    model: nn.Module,
    *,
    mode: str | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    regional: bool = True,
    backend: str | Callable[..., Any] = "inductor",
    modules: BlockSpec = None,
    fallback: bool = True,
) -> nn.Module:
    """Compile ``model`` in place, block by block (``regional=True``) or whole; returns it.

    Blocks are the children of every outermost ``nn.ModuleList`` (e.g. ``model.blocks``)
    unless ``modules`` gives block types or a ``(name, module)`` predicate. In place means
    state-dict keys do not change. With ``fallback=True`` a backend that cannot run here, or a
    compile that fails at a call, gives one ``RuntimeWarning`` and eager execution instead of a
    crash. With length buckets pass ``dynamic=False``: each bucket gets its own static graph.

    Example: ``compile_model(model, dynamic=False, backend="inductor")``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not regional and modules is not None:
        raise ValueError("modules= selects blocks for regional=True; drop it or set regional=True")
    targets = (
        [m for _, m in find_blocks(model, modules, purpose="blocks to compile")]
        if regional
        else [model]
    )
    available = compile_available(backend, device=_model_device(model))
    if not available:
        if not fallback:
            raise RuntimeError(f"cannot compile with backend {backend!r}: {available.reason}")
        warnings.warn(
            f"not compiling: {available.reason}; the model runs eagerly",
            RuntimeWarning,
            stacklevel=2,
        )
        return model
    group = _FallbackGroup(backend)
    kwargs: dict[str, Any] = {"backend": backend, "fullgraph": fullgraph, "dynamic": dynamic}
    if mode is not None:
        kwargs["mode"] = mode
    for m in targets:
        m.compile(**kwargs)
        if fallback:
            compiled = compiled_call(m)
            assert compiled is not None  # m.compile() just installed it
            set_compiled_call(m, _GuardedCall(m, compiled, group))
            group.modules.append(m)
    return model


# ---------------------------------------------------------------- recompile accounting


@dataclass
class CompileStats:
    """What torch.compile did: frames compiled, recompiles, graph breaks, failures, time.

    ``compile_seconds`` is dynamo + backend time (forward and lazily compiled backward);
    exclude steps with ``compiled`` true from tokens/s and report this time on its own.

    Example: ``with track_compiles() as stats: step(); print(stats.recompiles)``
    """

    compilations: int = 0  # frames dynamo compiled (one per new graph)
    recompiles: int = 0  # compilations of a frame that already held a graph
    graph_breaks: int = 0
    failures: int = 0  # frames dynamo gave up on (run eagerly), recompile-limit hits included
    recompile_limit_hits: int = 0
    compile_seconds: float = 0.0
    wall_seconds: float = 0.0
    recompile_reasons: list[str] = field(default_factory=list)

    @property
    def compiled(self) -> bool:
        """True when anything was compiled: the timed work was warm-up, not a steady step."""
        return self.compilations > 0 or self.compile_seconds > 0.0


# Timed sections dynamo records for a frame compile and for a lazily compiled backward.
_TIME_KEYS = ("_compile.compile_inner", "backward._backward_impl")


def _snapshot() -> dict[str, Any]:
    c, times, metrics = compile_metrics()
    unimplemented = c.get("unimplemented", {})
    return {  # "metrics" also keeps its entries alive, so their ids stay unique
        "ok": c["frames"]["ok"],
        "failed": c["frames"]["total"] - c["frames"]["ok"],
        "breaks": sum(c["graph_break"].values()),
        "limit": sum(n for k, n in unimplemented.items() if "recompile limit" in k.lower()),
        "times": [len(times.get(k, ())) for k in _TIME_KEYS],
        "metrics": metrics,
        "wall": time.perf_counter(),
    }


def _fill(stats: CompileStats, a: dict[str, Any] | None, b: dict[str, Any]) -> CompileStats:
    times = compile_metrics()[1]
    a = a or {k: 0 for k in ("ok", "failed", "breaks", "limit", "wall")} | {"times": [0, 0]}
    seen = {id(m) for m in a.get("metrics", ())}
    stats.recompile_reasons = [
        m.recompile_reason
        for m in b["metrics"]
        if id(m) not in seen and m.recompile_reason and m.fail_type is None
    ]
    stats.recompiles = len(stats.recompile_reasons)
    stats.compilations = b["ok"] - a["ok"]
    stats.failures = b["failed"] - a["failed"]
    stats.graph_breaks = b["breaks"] - a["breaks"]
    stats.recompile_limit_hits = b["limit"] - a["limit"]
    stats.compile_seconds = float(
        sum(sum(times.get(k, ())[n:]) for k, n in zip(_TIME_KEYS, a["times"], strict=True))
    )
    stats.wall_seconds = b["wall"] - a["wall"] if a["wall"] else 0.0
    return stats


def compile_counters() -> CompileStats:
    """Totals since the process started (recompiles: among the last 64 compilations).

    Example: ``print(compile_counters().recompiles)``.
    """
    return _fill(CompileStats(), None, _snapshot())


@contextlib.contextmanager
def track_compiles() -> Iterator[CompileStats]:
    """Count what torch.compile does inside the block; the stats fill in when it exits.

    Example::

        with track_compiles() as stats:
            loss = model(x).sum()
        if stats.compiled: ...   # a warm-up step: keep it out of tokens/s
    """
    stats = CompileStats()
    before = _snapshot()
    try:
        yield stats
    finally:
        _fill(stats, before, _snapshot())


@contextlib.contextmanager
def no_recompiles() -> Iterator[None]:
    """Raise on any compile inside the block, recompile or first compile of a new frame
    alike (so warm up every shape and mode first); the previous stance returns on exit.

    Example: ``with no_recompiles(): train_steps(model)`` after ``warmup(...)``.
    """
    with torch.compiler.set_stance("fail_on_recompile"):
        yield


# ---------------------------------------------------------------- warm-up


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
    Call it under the same autocast as training: dynamo guards on it.

    Example: ``stats = warmup(model, [torch.zeros(8, L, dtype=torch.long) for L in buckets])``.
    """
    batches = list(example_batches)
    module = model_or_fn if isinstance(model_or_fn, nn.Module) else None
    if params is None and module is not None:
        params = module.parameters()
    elif params is None and backward:
        raise ValueError("warmup(fn, ...) with backward=True needs params=; or backward=False")
    wrt = [p for p in (params or ()) if p.requires_grad]
    own_buffers = list(module.buffers()) if module is not None else []
    buffers = [b.detach().clone() for b in own_buffers]
    n_shapes = len(batches) * (2 if also_eval else 1)
    with (
        track_compiles() as stats,
        torch.random.fork_rng(devices=cuda_devices(wrt)),
        recompile_limit_at_least(n_shapes + 1),
    ):
        for batch in batches:
            args, kwargs = _as_call(batch)
            loss = _scalar(model_or_fn(*args, **kwargs))
            if backward and loss is not None and wrt:
                torch.autograd.grad(loss, wrt, allow_unused=True)
            if also_eval:
                with _eval_no_grad(model_or_fn):
                    model_or_fn(*args, **kwargs)
        with torch.no_grad():
            for b, saved in zip(own_buffers, buffers, strict=True):
                b.copy_(saved)
    return stats
