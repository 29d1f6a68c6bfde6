"""What ran inside a compiled block: the compiled graphs each call executed, counted.

NOTE [graphs that ran]
A block's own frame can be compiled while nothing in it runs compiled: dynamo refuses to trace
a layer (nn.LSTM while `torch._dynamo.config.allow_rnn` is off) and leaves an empty frame, or
a frame nested in the block (a library's shared helper, a hook that graph-breaks) hits the
recompile limit and from then on runs as Python, silently. So compile_model hands dynamo its
backend wrapped in `CountingBackend`: every graph it compiles counts its runs (`note_graph`),
and each block call compares the count around itself (`note_coverage`). A call that ran no
graph, or fewer than calls of the same block class (of one compile_model call) ran before in
the same grad mode (train and no_grad eval may differ), is an
eager call: counted in `CompileStats.eager_block_calls`, warned once per compile_model call,
refused inside `no_recompiles()`, with the reason and the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from isotrain._torch_private import backend_compiler, compile_metrics, dynamo_allows_rnn
from isotrain.compile._stats import call_counts, note_eager, note_graph

__all__ = ["CountingBackend", "note_coverage", "rnn_layers"]


class CountingBackend:
    """The user's backend (and mode); every graph it compiles counts its runs."""

    def __init__(self, backend: str | Callable[..., Any], mode: str | None, dynamic: Any) -> None:
        self.inner = backend_compiler(backend, mode, dynamic)
        self.__name__ = f"isotrain_counting_{getattr(self.inner, 'compiler_name', 'backend')}"

    def __call__(self, gm: Any, example_inputs: Any, **kwargs: Any) -> Callable[..., Any]:
        compiled = self.inner(gm, example_inputs, **kwargs)

        def counted(*args: Any) -> Any:
            note_graph()
            return compiled(*args)

        return counted

    def __eq__(self, other: object) -> bool:
        # Equal backends (same compiler and mode) share graphs across compile_model calls, as
        # torch.compile's own wrappers do: dynamo reuses a cached graph when backends compare equal.
        return isinstance(other, CountingBackend) and self.inner == other.inner

    def __hash__(self) -> int:
        return hash(type(self.inner))

    def reset(self) -> None:
        reset = getattr(self.inner, "reset", None)
        if reset is not None:
            reset()


def rnn_layers(module: nn.Module) -> list[str]:
    """Names of the nn.RNN/GRU/LSTM layers in `module` ("" for the module itself)."""
    return [n for n, m in module.named_modules() if isinstance(m, nn.RNNBase)]


def note_coverage(module: nn.Module, before: tuple[int, int], group: Any) -> None:
    """After a compiled call of `module`: count it as eager if it ran no graph, or fewer
    graphs than its class did before in its group (NOTE [graphs that ran]); warn once."""
    graphs, eager = call_counts()
    if eager != before[1]:
        return  # the block's probe counted this call and said why
    ran, key = graphs - before[0], (type(module), torch.is_grad_enabled())
    most = group.most.get(key, 0)
    group.most[key] = max(most, ran)
    if ran > 0 and ran >= most:
        return
    why = _graphless(module) if ran == 0 else _partial(module, ran, most)
    first = not group.warned_eager
    note_eager(module, why, warn=first)
    if first:
        group.warned_eager = True


def _graphless(module: nn.Module) -> str:
    name, rnn = type(module).__name__, rnn_layers(module)
    if rnn and not dynamo_allows_rnn():
        layer = type(module.get_submodule(rnn[0])).__name__
        return (
            f"a compiled {name} block ran no compiled graph: it calls {layer} "
            f"({rnn[0] or 'the block itself'}), which dynamo does not trace while "
            "torch._dynamo.config.allow_rnn is off, so the whole block runs eagerly. Fix: "
            "compile and warm up inside torch._dynamo.config.patch(allow_rnn=True), or leave "
            "the block out of compile_model's modules="
        )
    breaks = list(compile_metrics()[0].get("graph_break", {}))[-2:]
    return (
        f"a compiled {name} block ran no compiled graph: dynamo traced none of its forward "
        f"(recent graph breaks: {'; '.join(breaks) or 'none recorded'}). Fix: remove the "
        "graph break (TORCH_LOGS=graph_breaks says where) or leave the block out of "
        "compile_model's modules="
    )


def _partial(module: nn.Module, ran: int, most: int) -> str:
    return (
        f"a compiled {type(module).__name__} block ran {ran} compiled graph(s) where calls of "
        f"its class ran {most}: a frame inside it (a helper function or a hook that "
        "graph-breaks) hit dynamo's recompile limit or failed, and runs as plain Python. Fix: "
        "warm up every shape and mode with isotrain.compile.warmup (it sizes the limit for "
        "nested frames) or remove the graph break (TORCH_LOGS=graph_breaks,recompiles)"
    )
