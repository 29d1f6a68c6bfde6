"""StepGuard: skips leave params and optimizer state bit-identical, applied steps equal a plain
clip + step reference, counters, spikes, state round trip, and no host sync."""

from __future__ import annotations

import copy
import io
import logging
import math
import statistics

import pytest
import torch
from torch import nn

from isotrain.guard import (
    FaultInjector,
    HostSpikeDetector,
    SkipReason,
    SpikeDetector,
    StepGuard,
    safe_backward,
)
from isotrain.testing import forbid_host_sync

OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
    "sgd_foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "adam_forloop": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=False),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
}


def make_model(seed: int = 0) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def loss_of(model: nn.Module, i: int) -> torch.Tensor:
    x, y = batch(i)
    return nn.functional.mse_loss(model(x), y)


def backward(loss: torch.Tensor, scaler: torch.amp.GradScaler | None) -> None:
    (scaler.scale(loss) if scaler is not None else loss).backward()


def state_copy(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def assert_same(a: object, b: object) -> None:
    """Bitwise equality of nested dicts/lists of tensors and plain values."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), (a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def scaler_or_none(use: bool) -> torch.amp.GradScaler | None:
    # The CPU GradScaler on an fp32 loss: the protocol (scale, unscale, found_inf, update)
    # is what matters, and power-of-two scales keep the unscaled grads exact.
    return torch.amp.GradScaler("cpu", init_scale=2.0**10) if use else None


MODES = [
    (name, mode)
    for name in OPTIMIZERS
    for mode in ("select", "host", "found_inf")
    if "fused" in name or mode != "found_inf"
]


@pytest.mark.parametrize("use_scaler", [False, True], ids=["fp32", "scaler"])
@pytest.mark.parametrize(("name", "mode"), MODES)
def test_guarded_run_matches_reference_and_skips_leave_state_identical(name, mode, use_scaler):
    model, ref = make_model(), make_model()
    opt, ref_opt = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](ref.parameters())
    scaler, ref_scaler = scaler_or_none(use_scaler), scaler_or_none(use_scaler)
    guard = StepGuard(opt, model, max_norm=0.5, scaler=scaler, spike_k=None, skip_mode=mode)
    faults = {1: ("loss", "nan"), 3: ("grad", "inf"), 4: ("loss", "inf")}
    ref_i = 0
    for step in range(6):
        before = state_copy(model, opt)
        loss = loss_of(model, step)
        target, kind = faults.get(step, ("loss", "nan"))
        inject = FaultInjector(at_steps=(step,) if step in faults else (), kind=kind, target=target)
        loss = inject.corrupt_loss(loss, step)
        backward(loss, scaler)
        inject.corrupt_grads(model, step)
        outcome = guard.step(loss.detach())
        if step in faults:
            expect = SkipReason.NONFINITE_LOSS if target == "loss" else SkipReason.NONFINITE_GRAD
            if target == "grad" and use_scaler:
                expect = SkipReason.SCALER_OVERFLOW
            assert not outcome.applied and outcome.reason.item() == expect
            assert_same(state_copy(model, opt), before)  # params, moments, step: bit-identical
            continue
        assert outcome.applied and outcome.reason.item() == SkipReason.OK
        ref_loss = loss_of(ref, step)  # the reference sees only the good batches
        backward(ref_loss, ref_scaler)
        if ref_scaler is not None:
            ref_scaler.unscale_(ref_opt)
        ref_norm = nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        if ref_scaler is not None:
            ref_scaler.step(ref_opt)
            ref_scaler.update()
        else:
            ref_opt.step()
        ref_opt.zero_grad()
        ref_i += 1
        assert torch.equal(outcome.grad_norm, ref_norm)
        assert_same(state_copy(model, opt), state_copy(ref, ref_opt))
        assert all(p.grad is None for p in model.parameters())  # zeroed, set_to_none
    assert ref_i == 3
    if use_scaler:  # three overflow/non-finite skips halved the scale three times
        assert guard.summary()["loss_scale"] == 2.0**10 * 0.5**3


@pytest.mark.parametrize(
    ("name", "mode"),
    [("sgd_fused", "found_inf"), ("adam_forloop", "select"), ("adamw_fused", "found_inf")],
)
def test_skip_at_the_first_step_leaves_no_state(name, mode):
    # torch.optim creates state lazily; fused SGD would even keep an uninitialised momentum buffer.
    model, ref = make_model(), make_model()
    opt, ref_opt = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](ref.parameters())
    guard = StepGuard(opt, model, spike_k=None, skip_mode=mode)
    (loss_of(model, 0) * float("nan")).backward()
    assert guard.step(torch.tensor(float("nan"))).reason.item() == SkipReason.NONFINITE_LOSS
    assert len(opt.state) == 0
    for step in (1, 2):
        loss_of(model, step).backward()
        guard.step(loss_of(model, step).detach())
        loss_of(ref, step).backward()
        nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
    assert_same(state_copy(model, opt), state_copy(ref, ref_opt))


def test_fused_adamw_honours_found_inf_on_cpu():
    # Pins the fact the fused path relies on: found_inf=1 leaves params, moments, step untouched.
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for found in (0.0, 1.0):
        loss_of(model, 0).backward()
        before = state_copy(model, opt)
        opt.grad_scale, opt.found_inf = None, torch.tensor(found)
        opt.step()
        del opt.grad_scale, opt.found_inf
        opt.zero_grad()
        same = True
        try:
            assert_same(state_copy(model, opt), before)
        except AssertionError:
            same = False
        assert same == (found == 1.0)


def test_counters_reasons_and_nonfinite_grad_names():
    model = make_model()
    guard = StepGuard(torch.optim.SGD(model.parameters(), lr=0.1), model, spike_k=None)
    for step, fault in enumerate([None, "loss", "grad", "grad", None]):
        loss = loss_of(model, step)
        if fault == "loss":
            loss = loss * float("nan")
        loss.backward()
        if fault == "grad":
            model[2].weight.grad[0, 0] = float("inf")
        guard.step(loss.detach())
        last_loss = loss.item()
        if step == 2:
            assert guard.nonfinite_grad_names() == ["2.weight"]
    s = guard.summary()
    assert s["steps"] == 5 and s["applied"] == 2 and s["skipped"] == 3
    assert s["skipped_by_reason"] == {
        "NONFINITE_LOSS": 1, "NONFINITE_GRAD": 2, "LOSS_SPIKE": 0, "GRAD_SPIKE": 0,
        "SCALER_OVERFLOW": 0,
    }  # fmt: skip
    assert s["consecutive_skips"] == 0 and s["last_reason"] == "OK"
    assert s["last_loss"] == last_loss


def test_nonfinite_grad_names_skip_params_without_a_gradient():
    model = make_model()
    model[0].weight.requires_grad_(False)  # frozen: no .grad, so norms index past it
    guard = StepGuard(torch.optim.SGD(model.parameters(), lr=0.1), model, spike_k=None)
    loss_of(model, 0).backward()
    model[2].bias.grad[1] = float("nan")
    model[0].bias.grad = None  # trainable but unused this step
    guard.step(torch.tensor(1.0))
    assert guard.nonfinite_grad_names() == ["2.bias"]


def test_host_push_equals_update_for_float32_values():
    pushed, updated = (HostSpikeDetector(n_series=2, k=3.0, window=4, min_samples=2) for _ in "ab")
    for v in torch.tensor([[1.0, 0.3], [1.5, 0.2], [0.7, 0.9], [1.1, 0.1], [2.0, 0.5]]).tolist():
        pushed.push(v)
        updated.update(v, accept=True)
        assert pushed._limits == updated._limits
        assert pushed.is_spike([3.5, 0.6]) == updated.is_spike([3.5, 0.6])
    assert pushed.is_spike([3.5, 0.6]) == [True, False]  # limits 2.99 and 1.50 (window of 4)
    assert_same(pushed.state_dict(), updated.state_dict())


def test_observe_is_is_spike_then_push_bit_for_bit():
    # The guard's one-call host decision against the general path, over a stream that wraps the
    # window, repeats a value (the std floor), spikes in each series and spans float32's range.
    kw = {"k": 3.0, "window": 8, "min_samples": 3}
    fast, ref = HostSpikeDetector(**kw), HostSpikeDetector(**kw)
    stream = [[2.0, 1.0]] * 5 + [[2.0, 9.0], [40.0, 1.0]]
    stream += [[1.5 + 0.1 * (i % 7), 0.5 + 0.03 * i] for i in range(20)]
    stream += [[1e-40, 3e38], [1e-44, 1e-45], [3e38, 1e-40], [0.0, 0.0]]  # subnormal to huge
    codes = []
    for v in torch.tensor(stream).tolist():  # float32 values, as the guard feeds them
        loss_spike, grad_spike = ref.is_spike(v)
        expect = 1 if loss_spike else 2 if grad_spike else 0
        if not expect:
            ref.push(v)
        codes.append(fast.observe(*v))
        assert codes[-1] == expect, (v, codes)
        assert fast._limits == ref._limits and fast.count == ref.count
    assert 1 in codes and 2 in codes and codes[:5] == [0] * 5  # both spike kinds were seen
    assert fast._sum == ref._sum and fast._sumsq == ref._sumsq
    assert_same(fast.state_dict(), ref.state_dict())
    edge = HostSpikeDetector(k=3.0, window=4, min_samples=4)
    assert [edge.observe(1.0, g) for g in (0.0, 0.0, 0.0, 4.0)] == [0] * 4  # norms: mean 1, std 2
    assert edge._limits[1] == 7.0 and edge.observe(1.0, 7.000001) == 2  # the window unchanged
    assert edge.observe(1.0, 7.0) == 0  # at the limit is not above it
    with pytest.raises(
        ValueError, match=r"observe\(\) needs a detector of 2 series, this one has 1"
    ):
        HostSpikeDetector(n_series=1).observe(1.0, 1.0)


def test_spike_detector_matches_mean_plus_k_std_over_the_last_window():
    det = SpikeDetector(n_series=1, k=3.0, window=8, min_samples=4)
    accepted: list[float] = []
    values = [1.0, 1.2, 0.9, 1.1, 1.05, 0.95, 9.0, 1.0, 1.3, 0.8, 1.1, 1.2, 1.0, 0.7, 3.0, 1.0]
    for v in values:
        spike = det.is_spike(torch.tensor([v]))[0].item()
        last = accepted[-8:]
        expect = len(accepted) >= 4 and v > statistics.mean(last) + 3.0 * statistics.stdev(last)
        assert spike == expect, (v, last)
        det.update(torch.tensor([v]), torch.tensor(not spike))
        if not spike:
            accepted.append(v)
    assert int(det.count) == len(accepted) == len(values) - 2  # 9.0 and 3.0 were spikes


def test_guard_skips_loss_and_grad_spikes_without_polluting_the_window():
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = StepGuard(opt, model, spike_k=6.0, spike_window=16, spike_min_samples=8)
    for step in range(10):
        loss_of(model, step).backward()
        assert guard.step(torch.tensor(1.0 + 0.01 * (step % 3))).applied.item()
    count = int(guard.spikes.count)
    before = state_copy(model, opt)
    loss_of(model, 10).backward()
    assert guard.step(torch.tensor(50.0)).reason.item() == SkipReason.LOSS_SPIKE
    (loss_of(model, 10) * 1e6).backward()  # a gradient-norm spike with an ordinary loss
    assert guard.step(torch.tensor(1.0)).reason.item() == SkipReason.GRAD_SPIKE
    assert_same(state_copy(model, opt), before)
    assert int(guard.spikes.count) == count


def test_state_dict_round_trip_continues_the_same_window(tmp_path):
    def run(guard, model, steps):
        out = []
        for step in steps:
            loss_of(model, step).backward()
            o = guard.step(torch.tensor(1.0 + 0.02 * (step % 5) + (30.0 if step == 14 else 0)))
            out.append(o.to_dict())
        return out

    model = make_model()
    guard = StepGuard(torch.optim.SGD(model.parameters(), lr=0.01), model, spike_min_samples=4)
    run(guard, model, range(10))
    torch.save(guard.state_dict(), tmp_path / "g.pt")
    resumed_model = copy.deepcopy(model)
    resumed_opt = torch.optim.SGD(resumed_model.parameters(), lr=0.01)
    resumed = StepGuard(resumed_opt, resumed_model, spike_min_samples=4)
    resumed.load_state_dict(torch.load(tmp_path / "g.pt", weights_only=True))
    assert_same(resumed.state_dict(), guard.state_dict())
    a, b = run(guard, model, range(10, 16)), run(resumed, resumed_model, range(10, 16))
    assert a == b and a[4]["reason"] == "LOSS_SPIKE"
    assert_same(resumed.state_dict(), guard.state_dict())
    with pytest.raises(ValueError, match="spike window shape"):
        StepGuard(
            torch.optim.SGD(model.parameters(), lr=0.1), spike_window=8, spike_min_samples=4
        ).load_state_dict(guard.state_dict())


@pytest.mark.parametrize("use_scaler", [False, True], ids=["fp32", "scaler"])
@pytest.mark.parametrize(
    ("name", "mode"),
    [("adam_forloop", "select"), ("sgd_foreach", "select"), ("adamw_fused", "found_inf")],
)
def test_guard_makes_no_host_sync(name, mode, use_scaler):
    # The "select" and "found_inf" modes are the accelerator paths ("auto" picks "host" on CPU).
    # On CPU every tensor is a "device" tensor, so the test patches the host reads
    # (item/bool/float/int/tolist/...) to raise inside the guard's own phases: decision, clip,
    # snapshot, selection, scaler update, counters. For fused optimizers the optimizer step is
    # inside the checked region too; torch's non-fused optimizers read their CPU `step` on the
    # host by design (not a device sync), so their `optimizer.step()` call is left outside.
    model = make_model()
    opt = OPTIMIZERS[name](model.parameters())
    scaler = scaler_or_none(use_scaler)
    guard = StepGuard(opt, model, scaler=scaler, spike_min_samples=2, skip_mode=mode)
    for step in range(3):  # warm up: optimizer state exists, spike window active
        backward(loss_of(model, step), scaler)
        guard.step(loss_of(model, step).detach())
    guard.sync_check = forbid_host_sync
    for step, kind in enumerate(["ok", "nan", "ok"], start=3):
        loss = loss_of(model, step) * (float("nan") if kind == "nan" else 1.0)
        backward(loss, scaler)
        guard.step(loss.detach())
    s = guard.summary()
    assert s["applied"] == 5 and s["skipped_by_reason"]["NONFINITE_LOSS"] == 1
    with forbid_host_sync(), pytest.raises(RuntimeError, match=r"host sync: Tensor.__bool__"):
        safe_backward(loss_of(model, 0), opt)  # the patch does catch a syncing guard


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("use_scaler", [False, True])
def test_guard_makes_no_cuda_sync(use_scaler):
    model = make_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cuda") if use_scaler else None
    guard = StepGuard(opt, model, scaler=scaler, spike_min_samples=2)
    x, y = (t.cuda() for t in batch(0))
    for step in range(6):
        loss = nn.functional.mse_loss(model(x), y) * (float("nan") if step == 4 else 1.0)
        backward(loss, scaler)
        if step >= 3:
            torch.cuda.set_sync_debug_mode("error")
        try:
            guard.step(loss.detach())
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert guard.summary()["skipped"] == 1


def test_safe_backward_applies_skips_and_logs(caplog):
    model, ref = make_model(), make_model()
    opt, ref_opt = torch.optim.Adam(model.parameters()), torch.optim.Adam(ref.parameters())
    assert safe_backward(loss_of(model, 0), opt, max_norm=0.5) is True
    loss_of(ref, 0).backward()
    nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    ref_opt.step()
    assert_same(state_copy(model, opt), state_copy(ref, ref_opt))
    before = state_copy(model, opt)
    with caplog.at_level(logging.WARNING, logger="isotrain.guard"):
        assert safe_backward(loss_of(model, 1) * float("nan"), opt) is False
    assert "non-finite loss" in caplog.text
    scaler = scaler_or_none(True)
    loss = loss_of(model, 2)
    model[0].weight.register_hook(lambda g: g * float("inf"))
    assert safe_backward(loss, opt, scaler) is False
    assert_same(state_copy(model, opt), before)
    assert scaler.get_scale() == 2.0**9  # the overflow lowered the scale


def test_step_rejects_bad_input():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        StepGuard(opt, model, max_norm=0.0)
    with pytest.raises(TypeError, match=r"needs a torch.optim.Optimizer"):
        StepGuard(model, model)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"min_samples <= window .* window=4, min_samples=16"):
        StepGuard(opt, model, spike_window=4)
    guard = StepGuard(opt, model)
    loss_of(model, 0).backward()
    with pytest.raises(ValueError, match="needs the scalar"):
        guard.step(torch.ones(3))
    assert guard.skip_mode == "host"  # auto on CPU
    with pytest.raises(ValueError, match=r"skip_mode='found_inf' is not available for SGD"):
        StepGuard(opt, model, skip_mode="found_inf")
    buf = io.BytesIO()
    torch.save({**guard.state_dict(), "version": 99}, buf)
    buf.seek(0)
    with pytest.raises(ValueError, match="unknown StepGuard state version 99"):
        guard.load_state_dict(torch.load(buf, weights_only=True))


def _two_rank_worker(rank: int, init_file: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model = make_model()
        start = copy.deepcopy(model.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        guard = StepGuard(opt, model, spike_k=None, skip_mode="select")
        for step in range(3):
            loss = loss_of(model, 10 * rank + step)  # different data per rank, no DDP
            if step == 0 and rank == 1:
                loss = loss * float("nan")  # only rank 1 sees a NaN loss
            loss.backward()
            if step == 1 and rank == 0:
                model[0].bias.grad[0] = float("inf")  # only rank 0 sees an Inf grad
            local = loss.detach().clone()
            outcome = guard.step(loss.detach())
            if step < 2:  # both ranks skip, each with the agreed reason
                expect = [SkipReason.NONFINITE_LOSS, SkipReason.NONFINITE_GRAD][step]
                assert not outcome.applied and outcome.reason.item() == expect
                assert_same(model.state_dict(), start)
            else:
                assert outcome.applied
                dist.all_reduce(local)
                assert torch.allclose(outcome.loss, local / 2)  # the rank-averaged loss
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_rank_world_agrees_on_every_skip(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_two_rank_worker, args=(str(tmp_path / "init"),), nprocs=2, join=True)


def test_host_spike_detector_matches_the_reference_and_crosses_state_with_the_device_one():
    host = HostSpikeDetector(n_series=1, k=3.0, window=8, min_samples=4)
    dev = SpikeDetector(n_series=1, k=3.0, window=8, min_samples=4)
    accepted: list[float] = []
    values = [1.0, 1.2, 0.9, 1.1, 1.05, 0.95, 9.0, 1.0, 1.3, 0.8, 1.1, 1.2, 1.0, 0.7, 3.0, 1.0]
    for v in torch.tensor(values).tolist():  # float32 values, as the guard feeds them
        (spike,) = host.is_spike([v])
        last = accepted[-8:]
        expect = len(accepted) >= 4 and v > statistics.mean(last) + 3.0 * statistics.stdev(last)
        assert spike == expect == dev.is_spike(torch.tensor([v]))[0].item(), (v, last)
        host.update([v], accept=not spike)
        dev.update(torch.tensor([v]), torch.tensor(not spike))
        accepted += [] if spike else [v]
    assert_same(host.state_dict(), dev.state_dict())  # one format: snapshots cross
    again = HostSpikeDetector(n_series=1, k=3.0, window=8, min_samples=4)
    again.load_state_dict(dev.state_dict())
    assert again._sum == host._sum and again._sumsq == host._sumsq  # exact sums: exact resume
    with pytest.raises(ValueError, match="accepted values must be finite"):
        host.update([float("nan")], accept=True)


@pytest.mark.parametrize(("src", "dst"), [("host", "select"), ("select", "host")])
def test_state_dict_crosses_skip_modes(src, dst):
    def run(guard, model, steps):
        out = []
        for step in steps:
            loss_of(model, step).backward()
            value = 1.0 + 0.02 * (step % 5) + (30.0 if step == 12 else 0)
            out.append(guard.step(torch.tensor(float("nan") if step == 3 else value)).to_dict())
        return out

    def make(mode, model):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        return StepGuard(opt, model, spike_min_samples=4, skip_mode=mode)

    model = make_model()
    guard = make(src, model)
    run(guard, model, range(8))
    resumed_model = copy.deepcopy(model)
    resumed = make(dst, resumed_model)
    buf = io.BytesIO()
    torch.save(guard.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    resumed.load_state_dict(state)
    assert_same(resumed.state_dict(), guard.state_dict())
    assert resumed.summary() == guard.summary()
    a, b = run(guard, model, range(8, 14)), run(resumed, resumed_model, range(8, 14))
    assert a == b and a[4]["reason"] == "LOSS_SPIKE"
    assert_same(resumed.state_dict(), guard.state_dict())
    s = guard.summary()
    assert s == resumed.summary() and s["skipped_by_reason"]["NONFINITE_LOSS"] == 1
    assert int(resumed.consecutive_skips) == int(guard.consecutive_skips) == 0


@pytest.mark.parametrize(
    ("loss", "dtype"),
    [(2.5, torch.float32), (1 / 3, torch.float64), (1 / 3, torch.bfloat16), (1e39, torch.float64),
     (-1e39, torch.float64), (float("nan"), torch.float32), (-0.0, torch.float32)],
)  # fmt: skip
def test_the_host_outcome_loss_is_the_device_modes_float32_value(loss, dtype):
    import dataclasses

    model = make_model()
    guard = StepGuard(torch.optim.SGD(model.parameters(), lr=0.1), model, spike_k=None)
    assert guard.skip_mode == "host"
    loss_of(model, 0).backward()
    given = torch.tensor([loss], dtype=dtype)  # a (1,) loss reads as the scalar, as before
    outcome = guard.step(given)
    want = given.to(torch.float32).reshape(())  # what the device modes hold
    assert outcome.loss.dtype == torch.float32 and outcome.loss.shape == ()
    assert torch.equal(outcome.loss.view(torch.int32), want.view(torch.int32)) or (
        want.isnan() and outcome.loss.isnan()
    )
    assert outcome.loss is outcome.loss  # made once
    assert [f.name for f in dataclasses.fields(outcome)] == [
        "applied", "reason", "grad_norm", "loss", "loss_scale"
    ]  # fmt: skip
    assert bool(outcome.applied) == (abs(loss) < 1e38)  # beyond float32: inf, skipped
    for other in (copy.deepcopy(outcome), dataclasses.replace(outcome, reason=outcome.reason)):
        assert torch.equal(other.reason, outcome.reason) and other.loss.dtype == torch.float32
        assert torch.equal(other.loss.view(torch.int32), outcome.loss.view(torch.int32))
    for read in (outcome.to_dict()["loss"], guard.summary()["last_loss"]):
        assert read == float(want) or math.isnan(float(want))  # the float32 value, 1e39: inf
