"""GuardedOptimizer: StepGuard's decision behind the torch.optim.Optimizer interface."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from isotrain.guard import GuardedOptimizer, SkipReason


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _loss(model: nn.Module, i: int, *, nan: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
    loss = (model(x) - y).square().mean()
    return loss * float("nan") if nan else loss


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()] + [
        v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)
    ]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_nan_step_leaves_params_moments_step_and_lr_bitwise_unchanged() -> None:
    model = _model()
    opt = GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model, max_norm=1.0)
    sched = opt.skip_aware(torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    for i in range(3):
        _loss(model, i).backward()
        opt.step()
        sched.step()
    before, lr = _snapshot(model, opt), opt.param_groups[0]["lr"]
    loss = _loss(model, 3, nan=True)
    loss.backward()
    opt.observe_loss(loss)
    opt.step()
    sched.step()
    assert _same(before, _snapshot(model, opt))
    assert opt.param_groups[0]["lr"] == lr and not opt.applied
    assert opt.guard.summary()["skipped_by_reason"]["NONFINITE_LOSS"] == 1
    assert int(opt.last_outcome.reason) == SkipReason.NONFINITE_LOSS  # type: ignore[union-attr]
    _loss(model, 4).backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == lr / 2 and opt.applied
    assert all(s["step"] == 4 for s in opt.state.values())


def test_the_same_run_as_the_plain_optimizer_without_a_fault() -> None:
    runs = []
    for guarded in (False, True):
        model = _model()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        opt = GuardedOptimizer(inner, model, max_norm=None, spike_k=None) if guarded else inner
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        for i in range(4):
            opt.zero_grad()
            _loss(model, i).backward()
            opt.step()
            sched.step()
        runs.append(_snapshot(model, inner))
    assert _same(*runs)


def test_is_an_optimizer_for_schedulers_including_transformers_get_scheduler() -> None:
    transformers = pytest.importorskip("transformers")
    model = _model()
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9), model)
    assert isinstance(opt, torch.optim.Optimizer)
    sched = transformers.get_scheduler(
        "linear", optimizer=opt, num_warmup_steps=2, num_training_steps=10
    )
    other = GuardedOptimizer(torch.optim.SGD(_model().parameters(), lr=1.0, momentum=0.9))
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(other, max_lr=1.0, total_steps=10)
    assert one_cycle.optimizer is other and other.param_groups[0]["momentum"] == 0.95
    lrs = []
    for i in range(3):
        _loss(model, i).backward()
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    assert lrs == pytest.approx([0.5, 1.0, 7 / 8])  # warm-up 2, then linear to 10


def test_step_with_a_closure_checks_its_loss_and_returns_it() -> None:
    model = _model()
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    before = _snapshot(model, opt)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = _loss(model, 0)
        loss.backward()
        return loss + float("inf")  # finite grads, infinite loss: the guard must see the loss

    assert torch.isinf(opt.step(closure))
    assert _same(before, _snapshot(model, opt))
    assert opt.guard.summary()["skipped_by_reason"]["NONFINITE_LOSS"] == 1


def test_step_hooks_run_on_every_call_and_the_inner_optimizers_only_when_applied() -> None:
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = GuardedOptimizer(inner, model)
    calls: list[str] = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    inner.register_step_post_hook(lambda o, a, k: calls.append("inner"))
    _loss(model, 0).backward()
    opt.step()
    _loss(model, 1, nan=True).backward()
    opt.step()
    assert calls == ["pre", "inner", "post", "pre", "post"]


def test_state_dict_round_trip_and_plain_state_dicts_load_both_ways() -> None:
    model = _model()
    opt = GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model)
    _loss(model, 0).backward()
    opt.step()
    _loss(model, 1, nan=True).backward()
    opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert saved["isotrain_guard"]["steps"] == 2

    other = _model()
    again = GuardedOptimizer(torch.optim.AdamW(other.parameters(), lr=1e-2), other)
    again.load_state_dict(copy.deepcopy(saved))
    assert str(again.guard.summary()) == str(opt.guard.summary())  # nan != nan
    first, mine = next(iter(other.parameters())), next(iter(model.parameters()))
    assert torch.equal(again.state[first]["exp_avg"], opt.state[mine]["exp_avg"])

    plain = torch.optim.AdamW(_model().parameters(), lr=1e-2)
    plain.load_state_dict(copy.deepcopy(saved))  # torch ignores the guard's key
    fresh = GuardedOptimizer(torch.optim.AdamW(_model().parameters(), lr=1e-2), _model())
    fresh.load_state_dict(plain.state_dict())  # a plain one loads: the guard keeps its state
    assert fresh.guard.steps == 0 and len(fresh.state) == 4


def test_add_param_group_is_guarded_and_clipped_too() -> None:
    model, extra = _model(), nn.Parameter(torch.ones(3))
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), max_norm=1.0)
    opt.add_param_group({"params": [extra], "lr": 0.5})
    assert opt.param_groups[1]["lr"] == 0.5 and len(opt.optimizer.param_groups) == 2
    before = _snapshot(model, opt)
    _loss(model, 0).backward()
    extra.grad = torch.tensor([1.0, float("nan"), 1.0])
    opt.step()
    assert _same(before, _snapshot(model, opt)) and torch.equal(extra, torch.ones(3))
    extra.grad = torch.full((3,), 100.0)
    opt.step()  # clipped to norm 1: each of the 3 entries moves by 0.5 / sqrt(3)
    assert torch.allclose(extra.detach(), torch.full((3,), 1 - 0.5 / 3**0.5), atol=1e-5)
