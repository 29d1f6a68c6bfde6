"""Budget planning on models that build a KV cache or call blocks out of registration order,
and asking which blocks were wrapped."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from isotrain import checkpointed_blocks
from isotrain.checkpointing import apply_activation_checkpointing, measure_activation_memory

T, D = 6, 8


class _Cache:
    """A KV cache as HF decoders pass one: each layer appends its keys and reads them all."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}

    def update(self, i: int, k: torch.Tensor) -> torch.Tensor:
        self.keys[i] = torch.cat([self.keys[i], k], 1) if i in self.keys else k
        return self.keys[i]


class CachedLayer(nn.Module):
    def __init__(self, i: int) -> None:
        super().__init__()
        self.i, self.q, self.k = i, nn.Linear(D, D), nn.Linear(D, D)
        self.seen: list[int] = []  # key lengths this layer attended over

    def forward(
        self, x: torch.Tensor, past: _Cache | None = None, use_cache: bool = False
    ) -> torch.Tensor:
        k = self.k(x)
        if past is not None:
            k = past.update(self.i, k)
        self.seen.append(k.shape[1])
        mask = torch.ones(x.shape[1], x.shape[1]).tril().bool()  # causal, no cache offset
        att = (self.q(x) @ k.transpose(1, 2)).masked_fill(~mask, -1e9).softmax(-1)
        return x + att @ k


class CachedDecoder(nn.Module):
    """Builds a cache whenever use_cache is on (its default), like an HF decoder's config."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CachedLayer(i) for i in range(4))

    def forward(self, x: torch.Tensor, use_cache: bool = True) -> torch.Tensor:
        past = _Cache() if use_cache else None
        for layer in self.layers:
            x = layer(x, past=past, use_cache=use_cache)
        return x


def _grads(model: nn.Module, x: torch.Tensor, **kwargs: bool) -> list[torch.Tensor]:
    model.zero_grad()
    model(x, **kwargs).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_budget_plans_with_the_cache_off_as_training_runs() -> None:
    torch.manual_seed(0)
    model, x = CachedDecoder(), torch.randn(2, T, D)
    want = _grads(model, x, use_cache=False)
    said = "run with use_cache=False .* compare against the unwrapped model called with use_cache"
    with pytest.warns(UserWarning, match=said):
        apply_activation_checkpointing(model, policy="budget:60%", example_inputs=(x,))
    assert all(seen == [T] * len(seen) for seen in (layer.seen for layer in model.layers))
    assert 0 < len(checkpointed_blocks(model)) < 4
    got = _grads(model, x)  # use_cache=True by default: the wrapping turns it off
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


class Down(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Mid(nn.Module):
    """Saves many activations for few FLOPs: the cheapest block to recompute per byte."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        for _ in range(6):
            h = torch.tanh(h) * h
        return h


class Up(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(torch.cat([x, skip], -1)))


class TinyUNet(nn.Module):
    """Registers down, up, mid (as diffusers' UNet2DModel does) but calls down, mid, up."""

    def __init__(self) -> None:
        super().__init__()
        self.down, self.up, self.mid = Down(), Up(), Mid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(x)
        return self.up(self.mid(h), h)


def test_budget_pairs_each_block_with_its_own_inputs() -> None:
    torch.manual_seed(0)
    model, x = TinyUNet(), torch.randn(4, 8)
    blocks = (Down, Mid, Up)
    plain = measure_activation_memory(model, x, modules=blocks)
    budget = plain.total_bytes - plain.blocks[2].saved_bytes // 2  # names: down, up, mid
    apply_activation_checkpointing(
        model, policy=f"budget:{budget}", modules=blocks, example_inputs=x
    )
    report = measure_activation_memory(model, x, modules=blocks)
    assert report.total_bytes <= budget
    # The middle block frees the most bytes per recomputed FLOP, and alone is enough.
    assert checkpointed_blocks(model) == ["mid"]


def test_checkpointed_blocks_names_what_each_policy_wrapped() -> None:
    model = CachedDecoder()
    assert checkpointed_blocks(model) == []
    apply_activation_checkpointing(model, policy="every:2")
    assert checkpointed_blocks(model) == ["layers.0", "layers.2"]
    apply_activation_checkpointing(model, policy="none")
    assert checkpointed_blocks(model) == []
