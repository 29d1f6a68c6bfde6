"""Each kind the doctor reports, found on a setup with that bug and absent from its clean twin."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
from tests.doctor import (
    zoo,
    zoo_alignment,
    zoo_data,
    zoo_losses,
    zoo_model,
    zoo_precision,
    zoo_ranks,
    zoo_reports,
    zoo_state,
    zoo_update,
    zoo_weights,
    zoo_world,
)
from tests.doctor.zoo import lm_setup, mlp_setup

from isotrain.doctor import KINDS, examine


def _new_head() -> dict[str, Any]:
    setup = mlp_setup()
    setup["model"].fc2 = torch.nn.Linear(32, 4)  # a new head, after the optimizer was built
    return setup


def _keep_grads_step(model: torch.nn.Module, opt: Any, batch: Any) -> torch.Tensor:
    opt.zero_grad(set_to_none=False)  # zeroes every .grad in place, a frozen one's too
    loss = zoo.ce(model, batch)
    loss.backward()
    opt.step()
    return loss.detach()


def _frozen_after_optimizer() -> dict[str, Any]:
    """Fine-tuning: train, then freeze the backbone and go on with the same optimizer; the
    frozen layer's zeroed .grad keeps it in AdamW's update, so weight decay moves it
    (https://discuss.pytorch.org/t/why-there-is-still-a-small-change-in-frozen-layer-parameters/153740)."""
    setup = mlp_setup(step=_keep_grads_step)
    setup["optimizer"] = torch.optim.AdamW(setup["model"].parameters(), weight_decay=0.01)
    _keep_grads_step(setup["model"], setup["optimizer"], setup["batches"][0])
    setup["model"].fc1.requires_grad_(False)  # freezing after building the optimizer
    return setup


def _frozen_but_skipped() -> dict[str, Any]:
    setup = mlp_setup()
    setup["optimizer"] = torch.optim.AdamW(setup["model"].parameters(), weight_decay=0.01)
    setup["model"].fc1.requires_grad_(False)  # grads stay None: AdamW skips it, harmlessly
    return setup


def _head_twice() -> dict[str, Any]:
    setup = mlp_setup()
    model = setup["model"]
    with warnings.catch_warnings():  # torch warns of the duplicate, once, and goes on
        warnings.simplefilter("ignore")
        setup["optimizer"] = torch.optim.AdamW([*model.parameters(), *model.fc2.parameters()])
    return setup


def _mlp(**model_kw: Any) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        model = zoo.seeded(lambda: zoo.MLP(**model_kw))
        return mlp_setup(model=model, optimizer=zoo.adamw(model))

    return make


def _seq(bug: bool) -> dict[str, Any]:
    model = zoo.seeded(lambda: zoo.SeqMixer(bug=bug))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(6, 5, 8, generator=g), torch.randint(0, 4, (6,), generator=g))] * 2
    return dict(model=model, optimizer=zoo.adamw(model), batches=batches, step=zoo.good_step)


def _padded(eps: float) -> dict[str, Any]:
    model = zoo.seeded(lambda: zoo.PaddedClassifier(eps))
    ids = torch.randint(1, 16, (4, 6), generator=torch.Generator().manual_seed(0))
    ids[1] = 0  # an all-padding row: its embeddings are zero
    batches = [(ids, torch.tensor([0, 1, 2, 3]))] * 2
    return dict(model=model, optimizer=zoo.adamw(model), batches=batches, step=zoo.good_step)


def _branchy(bug: bool) -> dict[str, Any]:
    model = zoo.seeded(lambda: zoo.BranchyNet(bug=bug))
    return mlp_setup(model=model, optimizer=zoo.adamw(model))


ONE = {"n_layer": 1}
# kind, buggy setup, clean twin, the severity the bug earns
CASES: list[tuple[str, Callable[[], dict[str, Any]], Callable[[], dict[str, Any]], str]] = [
    ("host_sync", lambda: mlp_setup(step=zoo.step_with_item), mlp_setup, "warning"),
    ("host_sync", lambda: mlp_setup(step=zoo.step_with_mask), mlp_setup, "warning"),
    ("host_sync", lambda: mlp_setup(step=zoo.step_with_to_cpu),
     lambda: mlp_setup(step=zoo.step_moving_its_batch), "warning"),
    ("mode_leak", lambda: mlp_setup(eval_fn=zoo.eval_forgets_train), mlp_setup, "error"),
    ("grad_mode_leak", lambda: mlp_setup(eval_fn=zoo.eval_grad_off), mlp_setup, "error"),
    ("autocast_leak", lambda: mlp_setup(eval_fn=zoo.eval_autocast_on), mlp_setup, "error"),
    ("global_state_leak", lambda: mlp_setup(eval_fn=zoo.eval_deterministic), mlp_setup, "warning"),
    ("eval_in_train_mode", lambda: mlp_setup(eval_fn=zoo.eval_without_eval), mlp_setup, "error"),
    ("rng_leak", lambda: lm_setup(eval_fn=zoo.estimate_loss),
     lambda: lm_setup(eval_fn=zoo.estimate_loss_isolated), "warning"),
    ("unused_parameter", _mlp(unused=True), _mlp(), "warning"),
    ("parameter_not_in_optimizer", _new_head, mlp_setup, "error"),
    ("frozen_parameter_in_optimizer", _frozen_after_optimizer, _frozen_but_skipped, "warning"),
    ("duplicate_parameter", _head_twice, mlp_setup, "error"),
    ("weight_decay_on_norm_or_bias",
     lambda: mlp_setup(optimizer=torch.optim.AdamW(mlp_setup()["model"].parameters())),
     mlp_setup, "info"),
    ("params_unchanged", lambda: mlp_setup(step=zoo.step_zero_grad_late), mlp_setup, "error"),
    ("loss_at_init", _mlp(head_std=5.0), _mlp(), "warning"),
    ("batch_mixing", lambda: _seq(True), lambda: _seq(False), "error"),
    ("causal_leak", lambda: lm_setup(model_kw={"mask": "triu"}), lm_setup, "error"),
    ("nonfinite_forward", lambda: _padded(0.0), lambda: _padded(1e-6), "error"),
    ("overflow_risk", lambda: lm_setup(model_kw={"d": 64, "score_scale": "multiply"}),
     lambda: lm_setup(model_kw={"d": 64}), "warning"),
    ("nondeterminism", lambda: mlp_setup(step=zoo.step_with_numpy_noise),
     lambda: mlp_setup(step=zoo.step_with_torch_noise), "warning"),
    ("graph_break", lambda: _branchy(True), lambda: _branchy(False), "warning"),
    ("recompile", lambda: lm_setup(batches=zoo.tokens(2, lengths=(8, 12)), model_kw=ONE),
     lambda: lm_setup(batches=zoo.tokens(2), model_kw=ONE), "warning"),
    ("cannot_overfit",
     lambda: mlp_setup(optimizer=torch.optim.SGD(mlp_setup()["model"].parameters(), lr=1e-6)),
     mlp_setup, "warning"),
    ("memory", lm_setup, lm_setup, "info"),
    ("doctor_error", lambda: mlp_setup(step=zoo.step_raises), mlp_setup, "error"),
]  # fmt: skip
CASES += zoo_reports.CASES  # the bugs of public reports, each with its link
CASES += [(k, partial(setup, False), partial(setup, True), sev) for k, setup, sev in zoo_data.CASES]
CASES += zoo_losses.CASES + zoo_update.CASES + zoo_state.CASES + zoo_model.CASES  # newer families
CASES += zoo_precision.CASES + zoo_alignment.CASES + zoo_weights.CASES


def _id(case: tuple[Any, ...]) -> str:
    return case[0]


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_the_doctor_finds_the_bug_and_nothing_wrong_in_the_clean_twin(case: Any) -> None:
    kind, buggy, clean, severity = case
    checks = [kind] if kind != "doctor_error" else ["host_sync"]
    found = examine(**buggy(), checks=checks)
    assert [f.severity for f in found.of(kind)].count(severity) >= 1, found
    assert found.ok == (severity != "error")
    twin = examine(**clean(), checks=checks)
    assert not [f for f in twin.findings if f.severity in ("error", "warning")], twin


def test_every_kind_has_a_case_in_the_zoo() -> None:
    across = {c[0] for c in zoo_ranks.CASES + zoo_world.CASES}  # test_ranks*.py: worlds of two
    monitor = {"lost_update", "nonfinite_grad", "lr_off_schedule"}  # test_monitor, test_ranks
    assert {c[0] for c in CASES} | {"buffer_write_in_eval"} | across | monitor == set(KINDS)


def test_a_host_sync_is_located_at_the_users_line_and_counted_per_step() -> None:
    lines, start = inspect.getsourcelines(zoo.step_with_item)
    line = start + next(i for i, s in enumerate(lines) if "loss.item()" in s)
    (f,) = examine(**mlp_setup(step=zoo.step_with_item), checks=["host_sync"]).of("host_sync")
    assert f.where.endswith(f"zoo.py:{line}")
    assert f.evidence.startswith("1 sync(s) per step from .item()")


def test_a_copy_to_the_host_is_a_sync_where_the_line_names_the_host() -> None:
    lines, start = inspect.getsourcelines(zoo.step_with_to_cpu)
    line = start + next(i for i, s in enumerate(lines) if '.to("cpu")' in s)
    (f,) = examine(**mlp_setup(step=zoo.step_with_to_cpu), checks=["host_sync"]).of("host_sync")
    assert f.where.endswith(f"zoo.py:{line}") and f.severity == "warning"
    assert f.evidence == '1 sync(s) per step from .to("cpu")'
    assert f.fix.startswith("move values to the host only at log steps")


def test_batchnorm_mixing_is_information_not_an_error() -> None:
    from tests.integration.zoo import ResNet

    model = zoo.seeded(ResNet)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, 8, 8, generator=g), torch.tensor([0, 1, 2, 3]))] * 2
    d = examine(model, zoo.adamw(model), batches, step=zoo.good_step, checks=["batch_mixing"])
    assert [(f.severity, f.where) for f in d.findings] == [("info", "BatchNorm")]


def test_batchnorm_statistics_written_by_evaluation_are_found() -> None:
    from tests.integration.zoo import ResNet

    model = zoo.seeded(ResNet)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 3, 8, 8, generator=g), torch.tensor([0, 1, 2, 3]))] * 2
    kw = dict(step=zoo.good_step, checks=["buffer_write_in_eval", "eval_in_train_mode"])
    bad = examine(model, zoo.adamw(model), batches, eval_fn=zoo.eval_without_eval, **kw)
    assert {f.kind for f in bad.findings} == {"buffer_write_in_eval", "eval_in_train_mode"}
    assert "bn1.running_mean" in bad.of("buffer_write_in_eval")[0].where
    good = examine(model, zoo.adamw(model), batches, eval_fn=zoo.good_eval, **kw)
    assert good.findings == []


def test_a_check_that_cannot_run_says_so() -> None:
    d = examine(**mlp_setup(task=None), checks=["causal_leak", "loss_at_init"])
    assert {(f.kind, f.severity) for f in d.findings} == {
        ("causal_leak", "info"),
        ("loss_at_init", "info"),
    }
    assert all(f.evidence.startswith("not checked: needs task=") for f in d.findings)
