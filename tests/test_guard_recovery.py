"""Provenance, failure cases, rollback, fault injection and buffer protection around StepGuard."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from tests.test_guard import assert_same, loss_of, make_model
from torch import nn

from isotrain.contexts import eval_mode
from isotrain.guard import (
    FaultInjector,
    Rollback,
    StepGuard,
    find_nonfinite_source,
    load_failure_case,
    nonfinite_grads,
    save_failure_case,
)
from isotrain.testing import forbid_host_sync


class LogOfInput(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # NaN for negative inputs


def nan_model() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(4, 8),
            nn.Dropout(0.5),
            nn.Sequential(nn.Tanh(), LogOfInput()),
            nn.Linear(8, 1),
        )


def test_find_nonfinite_source_names_the_first_module_and_preserves_rng():
    model = nan_model()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    before = torch.get_rng_state()
    prov = find_nonfinite_source(model, x)
    assert torch.equal(torch.get_rng_state(), before)  # replay did not consume the RNG
    assert prov.module == "2.1" and prov.module_type == "LogOfInput"
    assert prov.nonfinite_modules == ["2.1", "2", "3", ""]  # completion order, root last
    assert not prov.inputs_nonfinite
    assert all(not m._forward_hooks for m in model.modules())  # hooks removed
    x_bad = x.clone()
    x_bad[0, 0] = float("nan")
    assert find_nonfinite_source(nn.Linear(4, 2), (x_bad,)).inputs_nonfinite
    finite = find_nonfinite_source(nn.Linear(4, 2), lambda m: m(x))
    assert finite.module is None and finite.nonfinite_modules == []


def test_find_nonfinite_source_removes_hooks_when_forward_raises():
    model = nn.Linear(4, 2)
    with pytest.raises(RuntimeError):
        find_nonfinite_source(model, torch.ones(3, 5))  # wrong width
    assert not model._forward_hooks


def test_nonfinite_grads_and_failure_case_round_trip(tmp_path):
    model = nan_model()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    rng_before = {"torch": torch.get_rng_state(), "python": random.getstate()}
    with torch.random.fork_rng():
        model(x).sum().backward()
        expected_out = model(x)  # the dropout mask depends on the RNG state captured above
    assert nonfinite_grads(model) == ["0.weight", "0.bias", "3.weight"]  # NaN flows back
    prov = find_nonfinite_source(model, x, rng_state=rng_before)
    path = save_failure_case(tmp_path, x, step=7, rng_state=rng_before, provenance=prov)
    case = load_failure_case(path)  # weights_only=True
    assert path.name == "failure_step7.pt" and case["step"] == 7
    assert torch.equal(case["inputs"], x) and case["provenance"]["module"] == "2.1"
    with torch.random.fork_rng():
        torch.set_rng_state(case["rng"]["torch"])
        model(case["inputs"])  # consume exactly what the failing step consumed
        replay = model(case["inputs"])
    assert torch.equal(replay.isnan(), expected_out.isnan())


def run_with_rollback(rollback_kwargs, nan_steps, total):
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    guard = StepGuard(opt, model, spike_k=None)
    rb = Rollback(model, opt, **rollback_kwargs)
    inject = FaultInjector(at_steps=nan_steps)
    snaps, actions = {}, []
    for step in range(total):
        loss = inject.corrupt_loss(loss_of(model, step), step)
        loss.backward()
        guard.step(loss.detach())
        action = rb.check(step, guard)
        snaps[step] = copy.deepcopy((model.state_dict(), opt.state_dict()))
        if action is not None:
            actions.append((action, snaps))
    return model, opt, guard, rb, actions


def test_rollback_restores_the_last_good_copy_bit_for_bit():
    kwargs = dict(every=3, patience=4, max_rollbacks=2, cooldown_factor=0.25, cooldown_steps=8)
    _, _, guard, rb, actions = run_with_rollback(kwargs, range(7, 11), 12)
    assert len(actions) == 1
    action, snaps = actions[0]
    # Applied steps 0..6; copies at steps 2 and 5 (every 3 applied); NaN at 7, 8, 9, 10.
    assert (action.step, action.restored_step, action.rollbacks) == (10, 5, 1)
    assert_same(snaps[10], snaps[5])  # model and optimizer: the copy taken at step 5
    assert guard.summary()["consecutive_skips"] == 0
    assert not torch.equal(snaps[6][0]["0.weight"], snaps[5][0]["0.weight"])  # 6 was undone
    assert [rb.lr_factor(s) for s in (9, 10, 14, 18)] == [1.0, 0.25, 0.25 + 0.75 * 4 / 8, 1.0]


def test_rollback_gives_up_with_a_clear_error():
    with pytest.raises(
        RuntimeError, match=r"after 1 rollbacks \(max_rollbacks=1\).*not recovering"
    ):
        run_with_rollback(dict(every=2, patience=2, max_rollbacks=1), range(3, 20), 20)


def test_rollback_state_dict_and_validation():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rb = Rollback(model, opt, device=None)
    rb.load_state_dict({"rollbacks": 2, "last_rollback_step": 40})
    assert rb.state_dict() == {"rollbacks": 2, "last_rollback_step": 40}
    assert rb.lr_factor(40) == 0.1 and rb.lr_factor(140) == 1.0
    with pytest.raises(ValueError, match="cooldown_factor must be in"):
        Rollback(model, opt, cooldown_factor=0.0)


def test_fault_injector_is_deterministic_and_leaves_global_rng_alone():
    before = (torch.get_rng_state(), random.getstate())
    a = FaultInjector(probability=0.3, seed=5)
    fired = [s for s in range(200) if a.fires(s)]
    assert fired == [s for s in range(200) if FaultInjector(probability=0.3, seed=5).fires(s)]
    assert fired != [s for s in range(200) if FaultInjector(probability=0.3, seed=6).fires(s)]
    assert 40 < len(fired) < 80  # about 30%
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    inject = FaultInjector(at_steps=(3,), kind="inf", target="grad")
    model = make_model()
    loss_of(model, 0).backward()
    assert inject.corrupt_grads(model, 2) is None and inject.corrupt_loss(torch.ones(()), 3) == 1
    name = inject.corrupt_grads(model, 3)
    assert nonfinite_grads(model) == [name]
    assert dict(model.named_parameters())[name].grad.isinf().sum() == 1
    nan = FaultInjector(at_steps=(0,)).corrupt_loss(torch.ones((), requires_grad=True), 0)
    assert nan.isnan()
    with pytest.raises(ValueError, match='kind "nan" or "inf"'):
        FaultInjector(kind="zero")


# -- protect_buffers: a skipped step leaves BatchNorm statistics as they were --------------------
def bn_net() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
            nn.Flatten(), nn.Linear(4 * 6 * 6, 3),
        )  # fmt: skip


def images(i: int, *, poisoned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(4, 3, 6, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
    if poisoned:
        x[1, 0, 2, 2] = float("nan")  # one pixel of one image
    return x, y


def buffers(model: nn.Module) -> list[torch.Tensor]:
    return [b.clone() for b in model.buffers()]


@pytest.mark.parametrize("mode", ["host", "select", "found_inf"])
def test_protect_buffers_undoes_a_skipped_steps_statistics(mode) -> None:
    model, ref = bn_net(), bn_net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=mode == "found_inf")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=mode == "found_inf")
    guard = StepGuard(opt, model, spike_k=None, skip_mode=mode, protect_buffers=True)
    if mode != "host":
        guard.sync_check = forbid_host_sync
    for step in range(4):
        poisoned = step == 2
        before = buffers(model)
        for half in (0, 1):  # two micro-batches: the copy is taken at the first forward
            x, y = images(10 * step + half, poisoned=poisoned)
            F.cross_entropy(model(x), y).backward()
        outcome = guard.step(torch.tensor(float("nan") if poisoned else 1.0))
        if poisoned:
            assert not outcome.applied
            assert all(torch.equal(a, b) for a, b in zip(buffers(model), before))
            continue
        for half in (0, 1):  # the reference sees the good steps only, without the guard
            x, y = images(10 * step + half)
            F.cross_entropy(ref(x), y).backward()
        nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(buffers(model), buffers(ref)))
    with eval_mode(model):
        assert model(images(99)[0]).isfinite().all()


def test_without_protect_buffers_a_nan_image_poisons_the_statistics() -> None:
    model = bn_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = StepGuard(opt, model, spike_k=None, protect_buffers=False)
    x, y = images(0, poisoned=True)
    F.cross_entropy(model(x), y).backward()
    assert not guard.step(torch.tensor(float("nan"))).applied
    assert model[1].running_mean.isnan().all()  # what protect_buffers prevents


def test_protect_buffers_warns_without_a_forward_and_survives_copies(tmp_path) -> None:
    model = bn_net()
    x, y = images(0)
    F.cross_entropy(model(x), y).backward()  # before the guard exists: nothing captured
    guard = StepGuard(torch.optim.SGD(model.parameters(), lr=0.1), model, protect_buffers=True)
    with pytest.warns(UserWarning, match="protect_buffers: no forward of the model ran"):
        guard.step(torch.tensor(1.0))
    torch.save(model, tmp_path / "m.pt")  # the hook holds the guard weakly and pickles inert
    for twin in (torch.load(tmp_path / "m.pt", weights_only=False), copy.deepcopy(model)):
        assert torch.equal(twin(x), model(x))
    with pytest.raises(ValueError, match="protect_buffers=True needs the model"):
        StepGuard(torch.optim.SGD(model.parameters(), lr=0.1), protect_buffers=True)
    guard.close()
    assert not model._forward_pre_hooks
