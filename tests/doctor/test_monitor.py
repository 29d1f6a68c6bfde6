"""Monitor in one process: the learning-rate schedule, NaN/Inf, stalled parameters, its cost.

Across ranks (replica checksums, lost updates) it is tested in tests/doctor/test_ranks.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests.doctor import zoo

from isotrain.doctor import Finding, Monitor
from isotrain.doctor.monitor import invariants as monitor_mod
from isotrain.guard import GuardedOptimizer, StepGuard

LR = 0.1


def _run(
    steps: int, body: Callable[[torch.nn.Module, torch.optim.Optimizer, Any, int], None], **kw: Any
) -> tuple[Monitor, list[Finding]]:
    """A plain loop of `steps` optimizer steps on the zoo's MLP, `after_step()` after each."""
    model = zoo.seeded(zoo.MLP)
    opt = kw.pop("optimizer", None) or torch.optim.AdamW(model.parameters(), lr=LR)
    opt = opt(model) if callable(opt) else opt
    seen: list[Finding] = []
    monitor = Monitor(model, opt, on_finding=seen.append, **kw)
    batches = zoo.features(4)
    with monitor:
        for step in range(steps):
            body(model, opt, batches[step % 4], step)
            monitor.after_step()
    return monitor, seen


def _plain(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Any, step: int) -> None:
    opt.zero_grad(set_to_none=True)
    zoo.ce(model, batch).backward()
    opt.step()


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
def test_a_scheduler_stepped_per_micro_batch_leaves_its_schedule() -> None:
    def loop(per_micro: bool) -> list[Finding]:
        made: dict[str, Any] = {}

        def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            made["sched"] = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
            return opt

        def body(model: Any, opt: Any, batch: Any, step: int) -> None:
            opt.zero_grad()
            for i in range(2):  # two micro-batches per optimizer step
                x, y = batch[0][4 * i : 4 * i + 4], batch[1][4 * i : 4 * i + 4]
                (F.cross_entropy(model(x), y) / 2).backward()
                if per_micro:
                    made["sched"].step()  # BUG: per micro-batch, not per optimizer step
            opt.step()
            if not per_micro:
                made["sched"].step()

        return _run(20, body, optimizer=optimizer, schedule=lambda s: LR * 0.9**s)[1]

    (f,) = loop(per_micro=True)
    assert (f.kind, f.severity, f.where) == ("lr_off_schedule", "warning", "param group 0")
    assert f.evidence == (
        f"optimizer step 9 used lr {LR * 0.9**20:.6g}; the schedule gives {LR * 0.9**9:.6g} for it"
    )
    assert loop(per_micro=False) == []


def test_nan_in_the_weights_is_an_error_and_a_skipped_nan_step_information() -> None:
    def nan_at(when: int, guard: bool) -> Callable[..., None]:
        guards: dict[int, StepGuard] = {}

        def body(model: Any, opt: Any, batch: Any, step: int) -> None:
            opt.zero_grad(set_to_none=True)
            loss = zoo.ce(model, batch) * (math.nan if step == when else 1.0)
            loss.backward()
            if guard:
                g = guards.setdefault(0, StepGuard(opt, model, max_norm=None, spike_k=None,
                                                   skip_mode="select"))  # fmt: skip
                g.step(loss.detach())
            else:
                opt.step()

        return body

    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=LR)  # noqa: E731
    _, found = _run(20, nan_at(4, guard=False), optimizer=sgd)
    assert [(f.kind, f.severity) for f in found] == [("nonfinite_grad", "error")]
    assert found[0].evidence.startswith("at step 10, 4 parameter(s) hold NaN/Inf")
    _, found = _run(20, nan_at(9, guard=True), optimizer=sgd)  # the check step's own update
    assert [(f.kind, f.severity, f.where) for f in found] == [
        ("nonfinite_grad", "info", "fc1.weight, fc1.bias, fc2.weight (+1 more)")
    ]
    assert _run(20, _plain)[1] == []


def test_gradients_zeroed_before_the_step_stall_every_parameter() -> None:
    def late_zero(model: Any, opt: Any, batch: Any, step: int) -> None:
        zoo.ce(model, batch).backward()
        opt.zero_grad(set_to_none=False)  # BUG: between backward and step
        opt.step()

    adam = lambda m: torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.0)  # noqa: E731
    _, found = _run(30, late_zero, optimizer=adam)
    (f,) = found
    assert (f.kind, f.severity) == ("params_unchanged", "error")
    assert f.evidence.startswith("at step 30, 4 of 4 trainable parameter(s) the optimizer holds")
    frozen = lambda m: torch.optim.AdamW(  # noqa: E731
        [{"params": m.fc1.parameters(), "lr": 0.0}, {"params": m.fc2.parameters()}]
    )  # a group at lr 0 is frozen on purpose: not reported
    assert _run(30, _plain, optimizer=frozen)[1] == []
    assert _run(30, _plain, optimizer=adam)[1] == []


def test_steps_between_checks_take_no_checksum(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = monitor_mod.checksum
    monkeypatch.setattr(monitor_mod, "checksum", lambda t: calls.append(1) or real(t))
    monitor, found = _run(9, _plain, every=10)
    assert calls == [] and found == [] and monitor.step == 9 and monitor.ranks is None
    monitor, found = _run(10, _plain, every=10)
    assert len(calls) == 8  # at step 10: 4 gradients at optimizer.step, 4 parameters after it


@pytest.mark.parametrize("every", [0, -1, 2.5, True])
def test_the_period_must_be_a_positive_number_of_steps(every: Any) -> None:
    model = zoo.seeded(zoo.MLP)
    with pytest.raises(ValueError, match=r"^every must be a positive number of steps, got "):
        Monitor(model, torch.optim.SGD(model.parameters(), lr=LR), every=every)


class _Wrapper:  # a loop's own optimizer wrapper (Lightning's LightningOptimizer is one)
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step(self) -> None:
        self.optimizer.step()


def test_a_wrapper_that_is_no_optimizer_is_refused_with_the_way_in() -> None:
    model = zoo.seeded(zoo.MLP)
    wrapped = _Wrapper(torch.optim.SGD(model.parameters(), lr=LR))
    with pytest.raises(TypeError, match=r"^Monitor needs a torch.optim.Optimizer \(it hooks its "
                       r"step\), got _Wrapper; pass the one inside"):  # fmt: skip
        Monitor(model, wrapped)  # type: ignore[arg-type]
    guarded = GuardedOptimizer(wrapped.optimizer, model)  # a torch Optimizer: its step is hooked
    Monitor(model, guarded).close()
