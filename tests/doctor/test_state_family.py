"""The state-across-steps family: each report's bug is named at its severity, its correct twin
gets no error and no warning from any check and comes back untouched, and the real-code
setups (zoo_real) get no alarm from the family's checks."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from tests.doctor import zoo_state
from tests.doctor.test_trust import examined_untouched, no_alarm
from tests.doctor.zoo_real import REAL

from isotrain.doctor import examine

FAMILY = ["lr_collapse", "ema_off_decay", "ema_before_step", "sampler_epoch"]
EXTRAS = ("ema", "scheduler", "counter")


def _id(v: Any) -> str:
    return getattr(v, "__name__", str(v))


def kinds_at(d: Any, kind: str) -> list[str]:
    return [f.severity for f in d.findings if f.kind == kind]


@pytest.mark.parametrize(("kind", "make", "severity"), zoo_state.BUILT, ids=_id)
def test_the_bug_is_named(kind: str, make: Any, severity: str) -> None:
    d = examine(**make(False), checks=[kind])
    assert kinds_at(d, kind) == [severity], d


@pytest.mark.parametrize(("kind", "make", "severity"), zoo_state.BUILT, ids=_id)
def test_the_twin_is_clean_and_untouched(kind: str, make: Any, severity: str) -> None:
    setup = make(True)
    d = examined_untouched(setup, checks="all")
    no_alarm(d)
    assert kinds_at(d, kind) == [], d


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_code_gets_no_finding_of_the_family(name: str) -> None:
    setup = {k: v for k, v in REAL[name]().items() if k not in EXTRAS}
    d = examine(**setup, checks=FAMILY)
    assert [f for f in d.findings if f.severity != "info"] == [], d


def test_a_schedule_judged_over_the_declared_run() -> None:
    setup = zoo_state.setup_cosine_per_batch(False)  # T_max=20 calls, a cosine to 0
    assert kinds_at(examine(**setup, checks=["lr_collapse"]), "lr_collapse") == ["warning"]
    short = examine(**zoo_state.setup_cosine_per_batch(False), total_steps=30,
                    checks=["lr_collapse"])  # fmt: skip
    assert short.findings == [], short  # a 30-step run whose cosine ends at step 20


def test_a_schedule_that_restarts_by_design_is_not_a_collapse() -> None:
    setup = zoo_state.setup_cosine_per_batch(True)
    opt = setup["optimizer"]
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=60)
    setup["step"] = zoo_state.stepping(sched)
    assert examine(**setup, checks=["lr_collapse"]).findings == []


def test_the_schedule_is_stepped_on_and_put_back() -> None:
    setup = zoo_state.setup_steplr_per_batch(False)
    opt = setup["optimizer"]
    d = examined_untouched(setup, checks=["lr_collapse"])
    assert "after 13 of the run's 64 calls" in d.of("lr_collapse")[0].evidence
    assert opt.param_groups[0]["lr"] == 1.0


def _plateau(setup: dict[str, Any]) -> Any:
    cells = [c.cell_contents for c in setup["step"].__closure__]
    return next(c for c in cells if isinstance(c, torch.optim.lr_scheduler.ReduceLROnPlateau))


def test_a_plateau_stepped_per_batch_is_judged_on_its_metrics_and_put_back() -> None:
    setup = zoo_state.setup_plateau_per_batch(False)
    sched = _plateau(setup)
    (f,) = examined_untouched(setup, sched, checks=["lr_collapse"]).findings
    assert f.evidence.startswith(
        "ReduceLROnPlateau(patience=10, factor=0.1).step(metric) runs 1 time(s) in each call"
    ), f
    assert "(0.1 -> 1e-08) after 35 of the run's 200 calls" in f.evidence, f
    assert sched.num_bad_epochs == 0 and sched.best == float("inf") and "step" not in vars(sched)


def test_a_plateau_whose_patience_counts_batches_is_not_a_collapse() -> None:
    setup = zoo_state.setup_plateau_per_batch(False)
    _plateau(setup).patience = 1000  # patience set in batches: five epochs
    assert examine(**setup, checks=["lr_collapse"]).findings == []


def test_a_wrong_way_round_decay_is_an_error_and_a_warmup_ema_is_not() -> None:
    setup = zoo_state._ema_setup({"decay": 0.9, "backwards": True})
    (f,) = examine(**setup, checks=["ema_off_decay"]).findings
    assert f.severity == "error" and "its stated decay (0.9)" in f.evidence
    assert examine(**zoo_state._ema_setup({"decay": 0.9}), checks="all").ok


def test_a_per_epoch_scheduler_in_an_epoch_function_is_not_judged_per_call() -> None:
    setup = zoo_state.setup_steplr_per_batch(True)
    opt = setup.pop("optimizer")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)

    def epoch(model: Any, opt: Any, loader: Any) -> None:
        for batch in loader:
            zoo_state.stepping(None)(model, opt, batch)
        sched.step()  # once per epoch, after the batch loop

    del setup["step"]
    d = examine(**setup, optimizer=opt, epoch=epoch, checks=["lr_collapse"])
    assert d.findings == [], d


# Missed when held out (the recall in tests/doctor/state_reports.md counts them); SRGAN#94's
# StepLR, at 150 of the one epoch's 261 steps, is named since NOTE [the first epoch].
_MISSED = {
    "setup_sampler_never_shuffles": "the epoch loop is out of the doctor's sight: named only "
    "as information",
}


@pytest.mark.parametrize(
    ("kind", "make", "severity"),
    [
        pytest.param(*c, marks=pytest.mark.xfail(strict=True, reason=_MISSED[c[1].__name__]))
        if c[1].__name__ in _MISSED else c
        for c in zoo_state.HELD_OUT
    ],
    ids=_id,
)  # fmt: skip
def test_held_out_report_is_named(kind: str, make: Any, severity: str) -> None:
    d = examine(**make(False), checks="all")
    assert severity in kinds_at(d, kind), d


@pytest.mark.parametrize(("kind", "make", "severity"), zoo_state.HELD_OUT, ids=_id)
def test_held_out_twin_is_clean(kind: str, make: Any, severity: str) -> None:
    no_alarm(examined_untouched(make(True), checks="all"))


def test_a_resume_check_needs_both_halves_and_says_what_to_pass() -> None:
    setup = zoo_state.setup_resume_without_rng(True)
    with pytest.raises(ValueError, match="pass save=your_save"):
        examine(**{**setup, "load": None}, checks=["resume_mismatch"])
    del setup["save"], setup["load"]
    (f,) = examine(**setup, checks=["resume_mismatch"]).findings
    assert (f.severity, f.evidence) == (
        "info",
        "not checked: pass save=your_save(path) and load=your_load(path) to check a resume",
    ), f


def test_a_resume_names_what_the_load_left_out() -> None:
    (f,) = examine(
        **zoo_state.setup_resume_weights_only(False), checks=["resume_mismatch"]
    ).findings
    assert f.evidence.endswith(
        "not brought back by your load: optimizer state (moments, step counts), optimizer "
        "hyperparameters (lr)"
    ), f


def test_a_collapse_within_the_first_epoch_is_named_without_a_declared_run() -> None:
    """SRGAN#94's StepLR(50, 0.1) per step: below 1/100 of its peak at 150 of one epoch's 261."""
    (f,) = examine(**zoo_state.setup_srgan_steplr(False), checks=["lr_collapse"]).findings
    assert f.severity == "warning" and "after 150 of the run's 261 calls" in f.evidence, f
    assert "within the first epoch, which every run holds" in f.evidence, f


@pytest.mark.parametrize("shape", ["linear", "cosine", "last fifth"])
def test_a_decay_over_one_epoch_is_no_collapse_without_a_declared_run(shape: str) -> None:
    """A one-epoch fine-tune's schedule: linear or cosine to 0 over the epoch, or constant
    then linear to 0 over its last fifth; each reaches 1/100 of its peak after 80% of it."""
    model, batches = zoo_state.classifier(), zoo_state.loader(100)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n = len(batches)
    factor = {
        "linear": lambda i: 1 - i / n,
        "cosine": lambda i: 0.5 * (1 + math.cos(math.pi * min(i, n) / n)),
        "last fifth": lambda i: min(1.0, (n - i) / (0.2 * n)),
    }[shape]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    d = examine(model, opt, batches, step=zoo_state.stepping(sched), checks=["lr_collapse"])
    assert [f for f in d.findings if f.severity != "info"] == [], d
