"""Compile coverage inside blocks: what ran compiled is counted (graphs against block calls),
blocks dynamo cannot trace are named, nested frames get a limit that fits, and warmup warns
whenever dynamo gave up on a frame. Backend "eager" throughout."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from isotrain import compiled_blocks
from isotrain.compile import compile_model, no_recompiles, track_compiles, warmup


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Compiled graphs live on code objects: drop them around each test."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class RNNBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 8, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_recurrent_blocks_are_named_and_counted_as_eager() -> None:
    torch.manual_seed(0)
    model, x = Stack([RNNBlock() for _ in range(3)]), torch.randn(2, 5, 8)
    want = model(x)
    with pytest.warns(RuntimeWarning, match=r"allow_rnn is off") as caught:
        compile_model(model, backend="eager")
    assert "recurrent layer(s) (LSTM in a RNNBlock block" in str(caught[0].message)
    assert compiled_blocks(model) == ["blocks.0", "blocks.1", "blocks.2"]
    said = r"ran no compiled graph: it calls LSTM \(lstm\)"
    with pytest.warns(RuntimeWarning, match=said), track_compiles() as stats:
        got = model(x)
    assert torch.equal(got, want)
    assert (stats.block_calls, stats.graph_calls, stats.eager_block_calls) == (3, 0, 3)
    assert stats.compiled_block_calls == 0
    with no_recompiles(), pytest.raises(RuntimeError, match="allow_rnn"):
        model(x)


def _shared_helper(x: torch.Tensor, tag: str) -> torch.Tensor:
    """A library's helper that every block calls: its own frame (a graph break inside), with a
    graph per tag (dynamo guards on a string's value)."""
    x = x * len(tag)
    torch._dynamo.graph_break()
    return x + len(tag)


class A(nn.Module):
    def __init__(self, scale: int, calls: int = 1) -> None:
        super().__init__()
        self.fc, self.tags = nn.Linear(8, 8), tuple(f"{scale}/{i}" for i in range(calls))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _shared_helper(self.fc(x), self.tags[0])
        if len(self.tags) > 1:  # unrolled: dynamo skips a frame with a graph break in a loop
            x = _shared_helper(_shared_helper(x, self.tags[1]), self.tags[2])
        return x


class B(A):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # its own code object: a second class
        x = _shared_helper(self.fc(x), self.tags[0])
        if len(self.tags) > 1:
            x = _shared_helper(_shared_helper(x, self.tags[1]), self.tags[2])
        return x


def _two_classes(calls: int) -> Stack:
    """Two blocks of each class: the helper's frames need a graph per block (x calls)."""
    return Stack([A(1, calls), A(2, calls), B(3, calls), B(4, calls)])


# A small default recompile limit (warmup raises it) keeps the number of compiles small.
SMALL_LIMIT = {"recompile_limit": 2, "accumulated_recompile_limit": 2}


def test_warmup_sizes_the_limit_for_frames_nested_in_blocks() -> None:
    torch.manual_seed(0)
    model, x = _two_classes(calls=1), torch.randn(2, 8)
    want = model(x)
    compile_model(model, backend="eager")
    with warnings.catch_warnings(record=True) as caught, torch._dynamo.config.patch(SMALL_LIMIT):
        warnings.simplefilter("always")
        stats = warmup(model, [x])  # 4 helper graphs: over 2 blocks of a class x 1 shape
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert (stats.recompile_limit_hits, stats.failures, stats.eager_block_calls) == (0, 0, 0)
    with no_recompiles(), track_compiles() as steady:
        got = model(x)
    assert torch.equal(got, want)
    assert steady.graph_calls == stats.graph_calls > 0  # as many graphs as warm-up compiled


def test_warmup_warns_when_a_nested_frame_hits_the_limit() -> None:
    torch.manual_seed(0)
    model, x = _two_classes(calls=3), torch.randn(2, 8)  # 12 helper graphs: over 4 x 1 shape
    compile_model(model, backend="eager")
    with pytest.warns(RuntimeWarning) as caught, torch._dynamo.config.patch(SMALL_LIMIT):
        stats = warmup(model, [x])
    text = "\n".join(str(w.message) for w in caught)
    assert stats.recompile_limit_hits > 0
    assert "warmup: dynamo gave up on" in text and "hit its recompile limit" in text
    assert "compiled graph(s) where calls of its class ran" in text
    assert stats.eager_block_calls > 0
    with no_recompiles(), pytest.raises(RuntimeError, match="a frame inside it"):
        model(x)


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


def test_models_compiled_apart_share_their_graphs_and_count_them() -> None:
    first, second, x = Stack([Small(), Small()]), Stack([Small(), Small()]), torch.randn(2, 8)
    compile_model(first, backend="eager")
    compile_model(second, backend="eager")
    with track_compiles() as one:
        first(x)
    with track_compiles() as two:
        second(x)  # the same block class, backend and shapes: the cached graph serves
    assert one.compilations > 0 and two.compilations == 0
    assert (one.graph_calls, two.graph_calls, two.eager_block_calls) == (2, 2, 0)
