"""The guard inside loops it did not write: the loop's zero_grad choice, closure optimizers."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import nn

from isotrain.guard import GuardedOptimizer, SkipReason, StepGuard


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


# ------------------------------------------------------------------ closure optimizers
def _regression() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.randn(32, 3), torch.randn(32, 1)


def _closure(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor, **kw: Any) -> Any:
    calls = [0]

    def closure() -> torch.Tensor:
        calls[0] += 1
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        if calls[0] == kw.get("nan_at"):
            loss = loss * math.nan
        if calls[0] == kw.get("raise_at"):
            raise RuntimeError("data loader failed")
        loss.backward()
        if kw.get("clip"):
            nn.utils.clip_grad_norm_(model.parameters(), kw["clip"])
        return loss

    return closure


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[Any]:
    """Params, buffers, then every value of the optimizer state (tensors, lists, numbers)."""
    out: list[Any] = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    for s in opt.state.values():
        for key in sorted(s):
            v = s[key]
            out.append((key, copy.deepcopy(v)))
    return out


def _equal(a: list[Any], b: list[Any]) -> bool:
    def same(u: Any, v: Any) -> bool:
        if isinstance(u, torch.Tensor) or isinstance(v, torch.Tensor):
            return isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor) and torch.equal(u, v)
        if isinstance(u, (list, tuple)):
            return len(u) == len(v) and all(same(p, q) for p, q in zip(u, v))
        return bool(u == v)

    return len(a) == len(b) and all(same(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("clip", [None, 0.5])
def test_lbfgs_guarded_equals_plain_lbfgs(clip: float | None) -> None:
    plain, x, y = _regression()
    model = copy.deepcopy(plain)
    ref = torch.optim.LBFGS(plain.parameters(), max_iter=4, line_search_fn="strong_wolfe")
    opt = GuardedOptimizer(
        torch.optim.LBFGS(model.parameters(), max_iter=4, line_search_fn="strong_wolfe"),
        model,
        max_norm=clip,
    )
    for _ in range(3):
        want = ref.step(_closure(plain, ref, x, y, clip=clip))
        got = opt.step(_closure(model, opt, x, y))
        assert torch.equal(got, want) and opt.applied
    assert _equal(_state(model, opt), _state(plain, ref))
    assert opt.guard.summary()["applied"] == 3


def test_lbfgs_a_nan_in_any_evaluation_skips_the_whole_step() -> None:
    model, x, y = _regression()
    opt = GuardedOptimizer(torch.optim.LBFGS(model.parameters(), max_iter=4), model)
    opt.step(_closure(model, opt, x, y))
    before = _state(model, opt)
    opt.step(_closure(model, opt, x, y, nan_at=3))  # the third evaluation of this step
    assert not opt.applied and _equal(_state(model, opt), before)
    assert int(opt.last_outcome.reason) == SkipReason.NONFINITE_LOSS  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="data loader failed"):
        opt.step(_closure(model, opt, x, y, raise_at=2))
    assert _equal(_state(model, opt), before)
    opt.step(_closure(model, opt, x, y))
    assert opt.applied and opt.guard.summary()["skipped"] == 1


def test_closure_optimizers_say_how_to_step() -> None:
    model = _regression()[0]
    lbfgs = torch.optim.LBFGS(model.parameters())
    with pytest.raises(
        TypeError, match=r"LBFGS.step\(\) evaluates a closure .*guard.step_with_closure"
    ):
        StepGuard(lbfgs, model).step(1.0)
    with pytest.raises(TypeError, match=r"LBFGS.step\(\) needs a closure that zeroes the grads"):
        GuardedOptimizer(lbfgs, model).step()
    with pytest.raises(ValueError, match=r"use skip_mode='auto' or 'host' and no GradScaler"):
        StepGuard(lbfgs, model, skip_mode="select")
