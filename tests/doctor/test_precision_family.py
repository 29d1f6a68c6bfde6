"""The precision family: each report's bug is named at its severity, its correct twin gets no
error and no warning from any check and is left untouched, other forms of the same bug are
named too, and correct low-precision code (bfloat16 autocast, a GradScaler, a fused optimizer,
a loss autocast computes in float32) gets no finding. Real training code is examined with
every fast check, these among them, in test_real_code.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests.doctor import zoo_precision
from tests.doctor.test_trust import examined_untouched, no_alarm
from tests.doctor.zoo import MLP, features, seeded
from tests.doctor.zoo_precision import near_fit
from torch import nn

from isotrain.doctor import examine

KINDS = ["loss_in_low_precision", "grad_underflow", "optimizer_eps_underflow"]


def _id(v: Any) -> str:
    return getattr(v, "__name__", str(v))


def severities(d: Any, kind: str) -> list[str]:
    return [f.severity for f in d.findings if f.kind == kind]


REPORTS = zoo_precision.BUGS + zoo_precision.HELD_OUT


@pytest.mark.parametrize(("kind", "make", "severity"), REPORTS, ids=_id)
def test_the_bug_is_named(kind: str, make: Any, severity: str) -> None:
    d = examine(**make(False), checks=[kind])
    assert severities(d, kind) == [severity], d


@pytest.mark.parametrize(("kind", "make", "severity"), REPORTS, ids=_id)
def test_the_twin_is_clean_and_untouched(kind: str, make: Any, severity: str) -> None:
    no_alarm(examined_untouched(make(True), checks="all"))


def test_the_findings_name_the_users_line_and_what_was_measured() -> None:
    (f,) = examine(**zoo_precision.setup_bf16_logits_cross_entropy(False), checks=KINDS).findings
    assert f.where.startswith("tests/doctor/zoo_precision.py:"), f
    assert "returned a bfloat16 loss" in f.evidence and "on float32 inputs gives" in f.evidence
    assert "logits.float()" in f.fix
    setup = zoo_precision.setup_fp16_autocast_without_scaler(False)
    (f,) = examine(**setup, checks=["grad_underflow"]).findings
    assert f.where.startswith("tests/doctor/zoo_precision.py:"), f
    assert "divided back" in f.evidence and "GradScaler()" in f.fix
    (f,) = examine(**zoo_precision.setup_adam_eps_in_half(False), checks=KINDS).of(
        "optimizer_eps_underflow"
    )
    assert f.where == "Adam param group 0 (float16)" and "eps=1e-08 rounds to 0" in f.evidence


def _dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _regression(model: nn.Module, opt: Any, *, autocast: torch.dtype | None) -> dict[str, Any]:
    """A regressor near its fit (small gradients), its step under `autocast` if given."""

    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            pred = model(x.to(_dtype(model)))
        loss = F.mse_loss(pred.float(), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return dict(model=model, optimizer=opt, batches=near_fit(model), step=step)


def _regressor() -> nn.Module:
    return seeded(lambda: nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4)))


def _classifier(model: nn.Module, opt: Any) -> dict[str, Any]:
    """A classifier whose step feeds the model its own dtype and the loss float32 logits."""

    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x.to(_dtype(model))).float(), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return dict(model=model, optimizer=opt, batches=features(), step=step)


def test_float16_parameters_without_scaling_lose_gradients_too() -> None:
    model = _regressor()
    setup = _regression(model, None, autocast=None)  # batches made in float32, then
    model.half()  # the whole model cast to float16: its own gradients are float16
    setup["optimizer"] = torch.optim.SGD(model.parameters(), lr=1e-2)
    (f,) = examine(**setup, checks=["grad_underflow"]).findings
    assert f.severity in ("warning", "error") and "keep the parameters in float32" in f.fix, f


@pytest.mark.parametrize("dtype", [torch.bfloat16, None], ids=["bfloat16", "float32"])
def test_small_gradients_outside_float16_are_not_underflow(dtype: torch.dtype | None) -> None:
    model = _regressor()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    d = examine(**_regression(model, opt, autocast=dtype), checks=KINDS)
    assert d.findings == [], d


def test_a_half_model_regression_loss_is_named_and_an_autocast_loss_is_not() -> None:
    model = seeded(MLP).half()

    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x.half()), F.one_hot(y, 4).half())  # BUG: a float16 loss
        loss.backward()
        opt.step()
        return loss.detach()

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    d = examine(model, opt, features(), step=step, checks=["loss_in_low_precision"])
    assert severities(d, "loss_in_low_precision") == ["warning"], d
    assert "F.mse_loss returned a float16 loss" in d.findings[0].evidence

    def autocast_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast runs the loss in float32
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    model = seeded(MLP)
    opt = torch.optim.AdamW(model.parameters())
    assert examine(model, opt, features(), step=autocast_step, checks=KINDS).findings == []


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.Adagrad(ps, lr=1e-2),  # eps=1e-10
        lambda ps: torch.optim.RMSprop(ps, lr=1e-3),  # eps=1e-8
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    ],
    ids=["Adagrad", "RMSprop", "AdamW-foreach"],
)
def test_other_optimizers_whose_eps_float16_rounds_away_are_named(make: Any) -> None:
    model = seeded(MLP).half()
    d = examine(**_classifier(model, make(model.parameters())), checks=KINDS)
    assert severities(d, "optimizer_eps_underflow") == ["error"], d


@pytest.mark.parametrize(
    ("dtype", "kw"),
    [(torch.float16, {"fused": True}), (torch.bfloat16, {}), (torch.float32, {})],
    ids=["float16-fused", "bfloat16", "float32"],
)
def test_optimizers_that_step_low_precision_safely_are_not_named(
    dtype: torch.dtype, kw: dict[str, Any]
) -> None:
    model = seeded(MLP).to(dtype)
    setup = _classifier(model, torch.optim.AdamW(model.parameters(), **kw))
    d = examine(**setup, checks=["optimizer_eps_underflow", "loss_in_low_precision"])
    assert d.findings == [], d


def test_a_step_that_makes_nan_twice_from_the_same_state_is_deterministic() -> None:
    d = examine(**zoo_precision.setup_pytorch_8860_half_adam(False), checks=["nondeterminism"])
    assert d.findings == [], d
