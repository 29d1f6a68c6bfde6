"""What torch.compile did, counted: graphs, recompiles, failures, and block calls run eagerly.

Dynamo falls back to eager in silence when a frame hits its recompile limit: later calls that
miss every cached graph just run the Python code. Compiled blocks therefore count their calls
(`note_call`), their eager runs (`note_eager`, called only from Python that compiled code
never executes) and the compiled graphs that ran (`note_graph`, NOTE [graphs that ran] in
`_coverage`), so `CompileStats` can say how many block calls really ran compiled and
`no_recompiles()` can refuse an eager one: NOTE [eager block calls] in `_regional`.
"""

from __future__ import annotations

import contextlib
import re
import time
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from isotrain._shared import outside_stacklevel
from isotrain._torch_private import compile_metrics, recompile_limit

__all__ = [
    "CompileStats",
    "call_counts",
    "compile_counters",
    "eager_counts",
    "eager_reason",
    "last_reason",
    "no_recompiles",
    "note_call",
    "note_eager",
    "note_graph",
    "track_compiles",
]


@dataclass
class CompileStats:
    """What torch.compile did: frames compiled, recompiles, graph breaks, failures, time, and
    how many calls of compiled blocks ran compiled or eagerly.

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
    block_calls: int = 0  # calls of blocks compiled by compile_model ...
    eager_block_calls: int = 0  # ... of which ran eagerly, or partly (no graph, a nested frame)
    eager_blocks: list[str] = field(default_factory=list)  # "Type xN" for those that did
    graph_calls: int = 0  # compiled forward graphs that ran (a block may run several)

    @property
    def compiled(self) -> bool:
        """True when anything was compiled: the timed work was warm-up, not a steady step."""
        return self.compilations > 0 or self.compile_seconds > 0.0

    @property
    def compiled_block_calls(self) -> int:
        """Calls of compiled blocks that ran a compiled graph."""
        return self.block_calls - self.eager_block_calls


# Process-wide tallies of compiled-block calls (plain ints and a weak per-module count).
_CALLS = {"calls": 0, "eager": 0, "graphs": 0}
_EAGER: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
_WHY: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()  # last reason
_STRICT = [0]  # > 0 inside no_recompiles(): an eager block call raises


def note_call() -> None:
    """A compiled block was called (counted outside the compiled code)."""
    _CALLS["calls"] += 1


def note_graph() -> None:
    """A graph compile_model's backend compiled ran (counted by the graph's own wrapper)."""
    _CALLS["graphs"] += 1


def call_counts() -> tuple[int, int]:
    """(compiled graphs run, eager block calls) so far: a block call compares them around it."""
    return _CALLS["graphs"], _CALLS["eager"]


def note_eager(module: nn.Module, why: str | None, *, warn: bool = True) -> None:
    """A compiled block's forward ran as Python: raise inside no_recompiles(), else warn if `warn`.

    `why` is None when the user already heard (a compile failure's warning, a forced stance).
    """
    _CALLS["eager"] += 1
    _EAGER[module] = _EAGER.get(module, 0) + 1
    if why is None:
        return
    _WHY[module] = why
    if _STRICT[0]:
        raise RuntimeError(f"no_recompiles(): {why}")
    if warn:
        warnings.warn(why, RuntimeWarning, stacklevel=outside_stacklevel())


def eager_reason(module: nn.Module) -> str:
    """Why a compiled block ran eagerly, with the guard that failed last and how to fix it."""
    name = type(module).__name__
    limit_hits = [m for m in compile_metrics()[2] if "recompile limit" in (m.fail_reason or "")]
    if limit_hits:
        guard = [" ".join(s.split()) for s in (limit_hits[-1].recompile_reason or "").splitlines()]
        return (
            f"a compiled {name} block ran eagerly: dynamo hit its recompile limit "
            f"({recompile_limit()} graphs per block class) and now runs calls "
            f"that match no cached graph as plain Python. The guard that failed last: "
            f"{guard[0] if guard else '(unknown)'}. Fix: warm up every shape and mode the run "
            "uses with isotrain.compile.warmup (it raises the limit to cover them), make the "
            "value a guard specialises on a tensor or dynamic, or raise "
            "torch._dynamo.config.recompile_limit"
        )
    return (
        f"a compiled {name} block ran eagerly (dynamo did not run a graph for it; see "
        "TORCH_LOGS=recompiles,graph_breaks for why). Fix: warm up every shape and mode with "
        "isotrain.compile.warmup"
    )


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
        "calls": dict(_CALLS),
        "eager": {id(m): (type(m).__name__, n) for m, n in _EAGER.items()},
    }


# Timed sections dynamo records for a frame compile and for a lazily compiled backward.
_TIME_KEYS = ("_compile.compile_inner", "backward._backward_impl")


def _fill(stats: CompileStats, a: dict[str, Any] | None, b: dict[str, Any]) -> CompileStats:
    times = compile_metrics()[1]
    a = a or {k: 0 for k in ("ok", "failed", "breaks", "limit", "wall")} | {
        "times": [0, 0],
        "calls": {"calls": 0, "eager": 0, "graphs": 0},
        "eager": {},
    }
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
    stats.block_calls = b["calls"]["calls"] - a["calls"]["calls"]
    stats.eager_block_calls = b["calls"]["eager"] - a["calls"]["eager"]
    stats.graph_calls = b["calls"]["graphs"] - a["calls"]["graphs"]
    per_type: dict[str, int] = {}
    for key, (name, n) in b["eager"].items():
        per_type[name] = per_type.get(name, 0) + n - a["eager"].get(key, (name, 0))[1]
    stats.eager_blocks = [f"{name} x{n}" for name, n in per_type.items() if n > 0]
    return stats


def last_reason(module: nn.Module) -> str | None:
    """The last reason given for an eager call of `module`, if one was."""
    return _WHY.get(module)


def eager_counts() -> dict[int, int]:
    """id(module) -> eager calls so far, for warmup's per-block report."""
    return {id(m): n for m, n in _EAGER.items()}


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
    alike (so warm up every shape and mode first), and on any call of a compiled block that
    runs eagerly (dynamo's silent fallback); the previous stance returns on exit.

    Example: ``with no_recompiles(): train_steps(model)`` after ``warmup(...)``.
    """
    _STRICT[0] += 1
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            yield
    except RuntimeError as e:
        cause = _recompile_cause(str(e))
        if cause is None:
            raise
        raise RuntimeError(f"{cause}\n{e}") from e
    finally:
        _STRICT[0] -= 1


def _recompile_cause(message: str) -> str | None:
    """The first line a user needs from torch's fail_on_recompile error, whose cause sits in a
    list of guard failures: which dimension changed, and the fix."""
    if "fail_on_recompile" not in message:
        return None
    size = re.search(r"size mismatch at index (\d+)\. expected (\d+), actual (\d+)", message)
    if size is None:
        return "no_recompiles: this call needs a new graph (torch's guard failures below)"
    dim, warm, now = size.groups()
    return (
        f"no_recompiles: an input's dimension {dim} is {now}, but warm-up compiled {warm} "
        f"(a batch of another size?); warm up this shape too, or pad every batch to {warm}"
    )
