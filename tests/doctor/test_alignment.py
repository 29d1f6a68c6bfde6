"""A language model's targets against the tokens it reads (labels_not_shifted,
labels_shifted_twice): each form of the bug named with its evidence, each twin clean under
every check, and the caller's objects left bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
from tests.doctor import zoo_alignment as za
from tests.doctor.test_trust import examined_untouched, no_alarm

from isotrain.doctor import examine

KINDS = ["labels_not_shifted", "labels_shifted_twice"]
# setup -> (kind, the phrase of its evidence that says what was measured)
SAID = {
    "setup_decoder_fed_its_target": (
        "labels_not_shifted", "100% of its 64 targets equal the input token at the same "
        "position in argument 2 (8% equal the token one position on)"),
    "setup_pre_shifted_labels_hf": (
        "labels_shifted_twice", "100% of its 60 targets equal the input token two positions "
        "on in input_ids (10% equal the token one position on)"),
    "setup_shift_then_shifting_loss": (
        "labels_shifted_twice", "100% of its 60 targets equal the input token two positions "
        "on in argument 1 (10% equal the token one position on)"),
    "setup_decoder_shifts_inside": (
        "labels_shifted_twice", "100% of its 60 targets equal the input token one position "
        "on in argument 2 (8% equal the token at the same position, which the model reads "
        "shifted right)"),
    "setup_blip_redundant_shift": (
        "labels_shifted_twice", "100% of its 60 targets equal the input token one position on "
        "in argument 2 (7% equal the token at the same position, which the model reads shifted "
        "right)"),
    "setup_monai_latent_transformer": (
        "labels_not_shifted", "100% of its 64 targets equal the input token at the same "
        "position in argument 1 (7% equal the token one position on)"),
}  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "make"), za.BUGS + za.HELD_OUT, ids=lambda v: getattr(v, "__name__", v)
)
def test_each_misalignment_is_named_with_what_was_measured(kind: str, make: Any) -> None:
    if make is za.setup_pre_shifted_labels_hf:
        pytest.importorskip("transformers")
    d = examined_untouched(make(False), checks=KINDS)
    (f,) = d.findings
    assert (f.kind, f.severity) == (SAID[make.__name__][0], "error") == (kind, "error")
    assert SAID[make.__name__][1] in f.evidence
    no_alarm(examined_untouched(make(True), checks="all"))


@pytest.mark.parametrize("make", za.TWINS, ids=lambda m: m.__name__)
def test_correct_code_that_looks_misaligned_is_clean(make: Any) -> None:
    d = examined_untouched(make(), checks="all")
    no_alarm(d)
    assert not d.of("labels_not_shifted") and not d.of("labels_shifted_twice")


def test_a_decoder_without_its_mask_leaks_and_an_encoders_input_read_both_ways_does_not() -> None:
    d = examined_untouched(za.setup_decoder_without_its_mask(False), checks=["causal_leak"])
    (f,) = d.findings
    assert (f.kind, f.severity) == ("causal_leak", "error")
    assert f.evidence.startswith("changing token 7 of argument 2 (the decoder's input) changed")
    assert examine(**za.setup_decoder_without_its_mask(True), checks=["causal_leak"]).findings == []


def test_text_whose_rows_end_in_a_frequent_token_has_no_padding() -> None:
    # rows 1 and 3 end in token 11 (runs of 1 and 3), which the text uses elsewhere too
    x, _ = za._windows(1)
    assert x[1, -1] == x[3, -1] == 11 and int((x[:, :-3] == 11).sum()) > 0
    no_alarm(examine(**za.twin_multi_token_heads(), checks=["padding_in_loss"]))
