"""Buffer protection is the default wherever a forward writes floating-point buffers, and
costs nothing where none is written."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from isotrain.guard import StepGuard
from isotrain.testing import forbid_host_sync


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, 2))


class Scaled(nn.Module):
    """A persistent float buffer no forward writes (a frozen normalisation table)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.register_buffer("scale", torch.full((4,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x * self.scale)


def _step(model: nn.Module, guard: StepGuard, x: torch.Tensor, loss: float) -> bool:
    model(x).square().mean().backward()
    return bool(guard.step(torch.tensor(loss)).applied)


@pytest.mark.parametrize("mode", ["host", "select"])
def test_by_default_a_skipped_step_leaves_batchnorm_statistics_alone(mode: str) -> None:
    model = _bn_net()
    x = torch.randn(4, 3, 6, 6)
    guard = StepGuard(torch.optim.SGD(model.parameters(), lr=0.1), model, skip_mode=mode)
    if mode != "host":
        guard.sync_check = forbid_host_sync
    assert _step(model, guard, x, 1.0)
    before = [b.clone() for b in model.buffers()]
    poisoned = x.clone()
    poisoned[1, 0, 2, 2] = float("nan")
    assert not _step(model, guard, poisoned, float("nan"))
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), before, strict=True))
    assert guard.buffers is not None and not guard.buffers.off  # still protecting


def test_by_default_buffers_no_forward_writes_cost_nothing_after_the_first_step() -> None:
    model = Scaled()
    guard = StepGuard(torch.optim.SGD(model.parameters(), lr=0.1), model)
    assert guard.buffers is not None and model._forward_pre_hooks  # a float buffer: maybe
    assert _step(model, guard, torch.randn(3, 4), 1.0)
    assert guard.buffers.off and not model._forward_pre_hooks  # written by none: hook gone
    assert _step(model, guard, torch.randn(3, 4), 1.0)  # and no warning about missing forwards
    plain = nn.Linear(4, 2)
    assert StepGuard(torch.optim.SGD(plain.parameters(), lr=0.1), plain).buffers is None
    params = list(plain.parameters())  # parameters only: nothing to find, nothing said
    assert StepGuard(torch.optim.SGD(params, lr=0.1), params).buffers is None
