"""Checkpointed forwards that write buffers: the recompute starts where the forward started.

spectral_norm's power iteration advances `weight_u`/`weight_v` on every training forward and
builds the weight from them; a recompute from the advanced buffers builds another weight and
gives other gradients. Every policy must give the unwrapped model's numbers bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, spectral_norm

from isotrain.checkpointing import apply_activation_checkpointing

D = 8


class CountingLinear(nn.Linear):
    """A forward that counts its calls in a buffer and reads the count."""

    def __init__(self) -> None:
        super().__init__(D, D)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x) * (1 + 0.1 * self.calls.float())


def _layer(kind: str) -> nn.Module:
    if kind == "spectral_norm":
        return spectral_norm(nn.Linear(D, D))
    if kind == "weight_norm":
        return parametrizations.weight_norm(nn.Linear(D, D))
    if kind == "orthogonal":
        return parametrizations.orthogonal(nn.Linear(D, D))
    return CountingLinear()


class Block(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fc, self.out = _layer(kind), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.tanh(self.fc(x)))


def _model(kind: str) -> tuple[nn.Module, torch.Tensor]:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(*(Block(kind) for _ in range(4))), torch.randn(4, D)


def _train(model: nn.Module, x: torch.Tensor, steps: int = 3) -> list[torch.Tensor]:
    """Outputs and gradients of `steps` forward + backward passes, then every buffer."""
    seen: list[torch.Tensor] = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        y = model(x)
        y.square().sum().backward()
        seen += [y.detach(), *(p.grad.clone() for p in model.parameters())]
    return seen + [b.clone() for b in model.buffers()]


@pytest.mark.parametrize("policy", ["full", "every:2", "selective", "budget:50%"])
@pytest.mark.parametrize("kind", ["spectral_norm", "weight_norm", "orthogonal", "counter"])
def test_forward_written_buffers_recompute_bitwise(kind: str, policy: str) -> None:
    model, x = _model(kind)
    ref = _train(copy.deepcopy(model), x)
    apply_activation_checkpointing(model, policy=policy, modules=(Block,), example_inputs=(x,))
    got = _train(model, x)
    assert len(got) == len(ref)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_backward_twice_recomputes_from_the_same_buffers() -> None:
    model, x = _model("spectral_norm")
    twin = copy.deepcopy(model)
    apply_activation_checkpointing(model, policy="full", modules=(Block,))
    for m in (model, twin):
        loss = m(x).square().sum()
        loss.backward(retain_graph=True)
        loss.backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), twin.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), twin.buffers()))


@pytest.mark.parametrize("kind", ["spectral_norm", "counter"])
def test_forward_written_buffers_under_compile(kind: str) -> None:
    """Dynamo cannot trace a checkpointed region that writes buffers in Python; the eager
    checkpoint it falls back to must still start the recompute from the forward's buffers."""
    model, x = _model(kind)
    ref = _train(copy.deepcopy(model), x, steps=2)
    apply_activation_checkpointing(model, policy="full", modules=(Block,))
    torch._dynamo.reset()
    try:
        for block in model:
            block.compile(backend="eager")
        got = _train(model, x, steps=2)
    finally:
        torch._dynamo.reset()
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
