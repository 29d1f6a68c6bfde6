"""The losses family: each loss against its input contract, and padding counted in the loss
with or without an attention mask; every bug beside a clean twin that gets no alarm, and the
caller's objects left bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests.doctor import zoo_losses as zl
from tests.doctor.test_trust import examined_untouched, no_alarm

from isotrain.doctor import examine

CONTRACT = ["softmax_before_loss", "not_log_probabilities", "target_out_of_range",
            "loss_weight_shape", "loss_unread"]  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "setup", "severity"), zl.BUGS, ids=lambda v: getattr(v, "__name__", v)
)
def test_each_broken_contract_is_named_and_its_twin_is_clean(
    kind: str, setup: Any, severity: str
) -> None:
    d = examined_untouched(setup(False), checks=[kind])
    found = d.of(kind)
    assert [f.severity for f in found] == [severity], d
    assert found[0].fix != "-" and "zoo_losses.py" in found[0].where
    no_alarm(examined_untouched(setup(True), checks="all"))


def test_padding_named_by_the_models_pad_id_is_an_error() -> None:
    d = examine(**zl.setup_padding_no_mask(False, config=True), checks=["padding_in_loss"])
    (f,) = d.of("padding_in_loss")
    assert f.severity == "error" and "pad_token_id=0" in f.evidence and "22 positions" in f.evidence
    no_alarm(examine(**zl.setup_padding_no_mask(True, config=True), checks="all"))


def _lm_rows(tail: str) -> dict[str, Any]:
    """Unpadded rows (no tail fill), or rows that each end in one eos (a real target)."""
    setup = zl.setup_padding_no_mask(True, config=tail == "eos")
    for batch in setup["batches"]:
        ids = torch.randint(3, 16, batch["input_ids"].shape, generator=zl._gen(9))
        if tail == "eos":
            ids[:, -1] = 2  # the config's eos id, one per row
            setup["model"].config.pad_token_id = 2  # pad = eos, as GPT-2 setups set it
        batch["input_ids"], batch["labels"] = ids, ids.clone()
    return setup


@pytest.mark.parametrize("tail", ["none", "eos"])
def test_rows_without_padding_or_with_one_eos_each_are_not_padding(tail: str) -> None:
    no_alarm(examine(**_lm_rows(tail), checks=["padding_in_loss"]))


def test_a_hand_written_loss_is_said_unread_never_an_alarm() -> None:
    d = examined_untouched(zl.setup_hand_written(), checks=CONTRACT)
    (f,) = d.of("loss_unread")
    assert f.severity == "info" and "no torch loss function" in f.evidence
    no_alarm(d)


def test_a_torch_loss_whose_contract_is_not_read_is_named() -> None:
    def margin(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.multi_margin_loss(model(x), y)

    d = examine(**zl._mlp_setup(margin), checks=CONTRACT)
    assert [(f.kind, f.severity) for f in d.findings] == [("loss_unread", "info")]
    assert "F.multi_margin_loss" in d.findings[0].evidence


def test_masked_log_probabilities_with_minus_inf_are_log_probabilities() -> None:
    def masked_nll(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = model(x).masked_fill(torch.arange(4) == 3, float("-inf"))  # class 3 is banned
        return F.nll_loss(F.log_softmax(logits, dim=1), y.clamp(max=2))

    no_alarm(examine(**zl._mlp_setup(masked_nll), checks=CONTRACT))


def test_a_step_that_raises_is_said_not_checked() -> None:
    def broken(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        raise RuntimeError("boom")

    d = examine(**zl._mlp_setup(broken), checks=["not_log_probabilities"])
    (f,) = d.of("not_log_probabilities")
    assert f.severity == "info" and "boom" in f.evidence


@pytest.mark.parametrize(
    ("kind", "setup", "severity"), zl.HELD_OUT, ids=lambda v: getattr(v, "__name__", v)
)
def test_held_out_reports(kind: str, setup: Any, severity: str) -> None:
    d = examined_untouched(setup(False), checks=[kind])
    assert [f.severity for f in d.of(kind)] == [severity], d
    no_alarm(examined_untouched(setup(True), checks="all"))


def test_every_kind_of_the_contract_check_has_a_case() -> None:
    assert {case[0] for case in zl.CASES} >= set(CONTRACT) | {"padding_in_loss"}


def test_a_bfloat16_softmax_before_cross_entropy_is_probabilities() -> None:
    def bf16_softmax(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        probs = F.softmax(model(x).bfloat16(), dim=1)  # rows sum to 1 only to bf16 precision
        return F.cross_entropy(probs, y).float()

    d = examine(**zl._mlp_setup(bf16_softmax), checks=["softmax_before_loss"])
    assert [f.severity for f in d.of("softmax_before_loss")] == ["error"], d


@pytest.mark.parametrize("form", ["smoothed", "heatmap", "negatives"])
def test_binary_targets_off_0_and_1_on_purpose_are_not_scaled_labels(form: str) -> None:
    no_alarm(examined_untouched(zl.setup_soft_binary_targets(form), checks="all"))


def test_a_mask_scaled_by_to_tensor_names_the_scale() -> None:
    (f,) = examine(**zl.setup_mask_over_255(False), checks=["target_out_of_range"]).findings
    assert "only the values 0 and 0.003922 = 1/255" in f.evidence, f
    assert f.fix.startswith("keep the mask out of the image transform"), f
