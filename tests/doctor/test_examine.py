"""examine leaves everything as it was; clean models from other authors get a clean bill;
Finding and Diagnosis behave as their API says."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tests.doctor import zoo
from tests.integration.zoo import GPT, ResNet

from isotrain.contexts import StateAudit, eval_mode
from isotrain.doctor import Diagnosis, Finding, _examine, examine
from isotrain.doctor.ground.snapshot import Snapshot


def _optimizer_state(opt: torch.optim.Optimizer) -> Any:
    return copy.deepcopy(opt.state_dict())


def _same(a: Any, b: Any) -> bool:
    """Bitwise equality of nested optimizer state dicts."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_examine_leaves_model_optimizer_rng_and_globals_bit_for_bit() -> None:
    # A setup whose own eval leaks mode, grad mode and RNG: the doctor must contain all of it.
    setup = zoo.lm_setup(eval_fn=zoo.estimate_loss)
    model, opt = setup["model"], setup["optimizer"]
    zoo.good_step(model, opt, setup["batches"][0])  # optimizer state exists: moments, step
    model.blocks[0].drop.eval()  # a submodule held in eval on purpose
    opt_before = _optimizer_state(opt)
    np.random.rand(), random.random()  # numpy imported and used: its state is audited too
    with StateAudit(model, raise_on_leak=True, check_params=True):
        d = examine(**setup, checks="fast")
        d2 = examine(**{**setup, "eval_fn": zoo.eval_forgets_train}, checks=["mode_leak"])
    assert _same(opt_before, _optimizer_state(opt))
    assert d.of("rng_leak") and d2.of("mode_leak")  # the leaks were there to contain
    assert model.blocks[0].drop.training is False and model.training is True


def test_distributions_argument_checks_come_back_on_after_the_compile_checks() -> None:
    # dynamo's first compile in a process turns torch.distributions' validate_args default off
    # for good; the doctor's own compile checks must not leave it off for the user's steps.
    Dist = torch.distributions.Distribution
    was = Dist._validate_args
    setup = zoo.lm_setup()
    try:
        Dist.set_default_validate_args(True)
        snap = Snapshot(setup["model"], [setup["optimizer"]])
        Dist.set_default_validate_args(False)  # what dynamo's first compile does
        snap.restore()
        assert Dist._validate_args is True
        examine(**setup, checks=["graph_break"])
        assert Dist._validate_args is True
    finally:
        Dist.set_default_validate_args(was)


@pytest.mark.parametrize("name", ["nanogpt", "resnet"])
def test_clean_setups_of_other_authors_get_no_error_and_no_warning(name: str) -> None:
    if name == "nanogpt":
        model = zoo.seeded(lambda: GPT(vocab=32, block_size=16, n_layer=2, n_embd=16))
        batches = zoo.tokens(2, vocab=32)

        def loss_fn(m: torch.nn.Module, b: Any) -> torch.Tensor:
            return m(b[0], b[1])[1]

        task = "lm"
    else:
        model = zoo.seeded(ResNet)
        g = torch.Generator().manual_seed(0)
        batches = [(torch.randn(4, 3, 8, 8, generator=g), torch.tensor([0, 1, 2, 3]))] * 2

        def loss_fn(m: torch.nn.Module, b: Any) -> torch.Tensor:
            return F.cross_entropy(m(b[0]), b[1])

        task = "classification"
    d = examine(model, zoo.adamw(model, 1e-3), batches, loss_fn=loss_fn, task=task,
                eval_fn=zoo.good_eval if name == "resnet" else None, checks="fast")  # fmt: skip
    assert not [f for f in d.findings if f.severity != "info"], d
    assert d.ok and d.of("memory")


def test_a_random_init_hf_gpt2_gets_no_error_and_no_warning() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=32, n_positions=16)
    model = zoo.seeded(lambda: transformers.GPT2LMHeadModel(cfg))
    batches = [{"input_ids": x, "labels": x} for x, _ in zoo.tokens(2, vocab=32)]

    def loss_fn(m: torch.nn.Module, b: Any) -> torch.Tensor:
        return m(**b).loss

    def evaluate(m: torch.nn.Module, bs: Any) -> float:
        with eval_mode(m):
            return float(sum(loss_fn(m, b) for b in bs))

    d = examine(model, zoo.adamw(model, 1e-3), batches, loss_fn=loss_fn, task="lm",
                eval_fn=evaluate, checks="fast")  # fmt: skip
    assert not [f for f in d.findings if f.severity != "info"], d


def test_all_checks_on_the_clean_lm_finds_nothing_wrong() -> None:
    d = examine(**zoo.lm_setup(model_kw={"n_layer": 1}), checks="all")
    assert not [f for f in d.findings if f.severity != "info"], d
    assert d.checks == [k for k in d.checks if k != "doctor_error"] and "graph_break" in d.checks


def test_fast_skips_the_compile_and_overfit_checks() -> None:
    d = examine(**zoo.mlp_setup(), checks="fast")
    assert not {"graph_break", "recompile", "cannot_overfit"} & set(d.checks)
    assert "host_sync" in d.checks


def test_bad_arguments_are_refused_with_the_fix() -> None:
    s = zoo.mlp_setup()
    with pytest.raises(ValueError, match="unknown check kind"):
        examine(**{**s, "checks": ["host_sinc"]})
    with pytest.raises(ValueError, match="at least 2 batches"):
        examine(**{**s, "batches": s["batches"][:1]})
    with pytest.raises(ValueError, match="pass step="):
        examine(s["model"], s["optimizer"], s["batches"])
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        examine(s["model"], object(), s["batches"], step=zoo.good_step)  # type: ignore[arg-type]


def test_batches_may_be_an_endless_iterator() -> None:
    def endless() -> Any:
        while True:
            yield from zoo.features()

    d = examine(**{**zoo.mlp_setup(), "batches": endless()}, checks=["host_sync"])
    assert d.ok


def test_the_default_step_drives_loss_fn() -> None:
    s = zoo.mlp_setup()
    d = examine(
        s["model"], s["optimizer"], s["batches"], loss_fn=zoo.ce, checks=["params_unchanged"]
    )
    assert d.findings == []


def test_diagnosis_orders_errors_first_and_serialises() -> None:
    info = Finding("memory", "info", "blocks", "1 MB", "-")
    err = Finding("mode_leak", "error", "drop", "train -> eval", "use eval_mode")
    warn = Finding("host_sync", "warning", "a.py:3", "1 sync", "detach")
    d = Diagnosis([info, warn, err], ["memory", "mode_leak", "host_sync"], 1.25)
    assert [f.severity for f in d.findings] == ["error", "warning", "info"]
    assert not d.ok and Diagnosis([info, warn]).ok
    data = json.loads(json.dumps(d.to_json()))
    assert data["ok"] is False and data["findings"][0]["kind"] == "mode_leak"
    text = str(d)
    assert text.splitlines()[1].startswith("ERROR    mode_leak") and "\033" not in text
    assert "1 error(s), 1 warning(s), 1 info" in text
    with pytest.raises(ValueError, match="severity"):
        Finding("memory", "fatal", "x", "y", "z")  # type: ignore[arg-type]


def test_a_check_that_raises_becomes_a_doctor_error_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(ctx: Any) -> list[Finding]:
        raise RuntimeError("the check met something new\nsecond line")

    checks = tuple(
        dataclasses.replace(c, run=broken) if c.name == "batch_mixing" else c
        for c in _examine.CHECKS
    )
    monkeypatch.setattr(_examine, "CHECKS", checks)
    d = examine(**zoo.mlp_setup(), checks=["batch_mixing", "duplicate_parameter"])
    (err,) = d.findings
    assert (err.kind, err.severity, err.where) == ("doctor_error", "error", "batch_mixing")
    assert err.evidence == "RuntimeError: the check met something new"
    assert "duplicate_parameter" in d.checks  # ran (read-only) and found nothing


def test_a_model_that_cannot_be_deep_copied_is_examined_in_place() -> None:
    s = zoo.mlp_setup()
    s["model"].pending = (i for i in range(3))  # a generator: copy.deepcopy raises
    d = examine(**s, checks="all")
    assert d.ok and not [f for f in d.findings if f.severity != "info"], d
    (memory,) = d.of("memory")  # the one check that changes a copy's structure says why not
    assert memory.evidence.startswith("not checked: the model cannot be deep-copied (TypeError")
