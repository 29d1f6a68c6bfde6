"""The guard inside loops it did not write: the loop's zero_grad choice."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from isotrain.guard import GuardedOptimizer, StepGuard


class Branchy(nn.Module):
    """A branch that gets no gradient in most steps (an unused expert, a skipped head)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.branch = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        y = self.trunk(x)
        return y + self.branch(x) if use_branch else y


def _batch(i: int) -> torch.Tensor:
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(i))


def _sgd(model: nn.Module, fused: bool = False) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1, fused=fused)


def _train(model: Branchy, step: Any, zero: Any, steps: int = 6) -> list[torch.Tensor]:
    for i in range(steps):
        zero()
        loss = model(_batch(i), use_branch=i % 3 == 0).square().mean()
        loss.backward()
        step(loss.detach())
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["host", "select", "found_inf"])
@pytest.mark.parametrize("set_to_none", [False, True, None])
def test_guard_zeroes_as_the_loop_does(set_to_none: bool | None, mode: str) -> None:
    torch.manual_seed(0)
    plain, model = Branchy(), Branchy()
    model.load_state_dict(plain.state_dict())
    fused = mode == "found_inf"  # the fused kernel, plain and guarded
    ref_opt, opt = _sgd(plain, fused), _sgd(model, fused)
    kwargs = {} if set_to_none is None else {"set_to_none": set_to_none}
    want = _train(plain, lambda _: ref_opt.step(), lambda: ref_opt.zero_grad(**kwargs))
    guard = StepGuard(
        opt, model, max_norm=None, spike_k=None, skip_mode=mode, set_to_none=set_to_none
    )
    got = _train(model, guard.step, lambda: opt.zero_grad(**kwargs))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert guard.summary()["applied"] == 6


def test_guarded_optimizer_follows_the_loops_zero_grad() -> None:
    torch.manual_seed(0)
    plain, model = Branchy(), Branchy()
    model.load_state_dict(plain.state_dict())
    ref_opt = _sgd(plain)
    opt = GuardedOptimizer(_sgd(model), model, max_norm=None, spike_k=None)
    want = _train(plain, lambda _: ref_opt.step(), lambda: ref_opt.zero_grad(set_to_none=False))
    got = _train(model, lambda _: opt.step(), lambda: opt.zero_grad(set_to_none=False))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # The branch still moves on its zero gradient (momentum, decay): it did not stand still.
    assert not torch.equal(got[2], Branchy().branch.weight)
