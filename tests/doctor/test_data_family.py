"""The data family: each report's bug is named at its severity, its correct twin gets no
error and no warning from any check, and the caller's objects (dataset included) are left
as they were."""

from __future__ import annotations

from typing import Any

import pytest
from tests.doctor import zoo_data
from tests.doctor.test_trust import examined_untouched, no_alarm

from isotrain.doctor import examine


def _id(v: Any) -> str:
    return getattr(v, "__name__", str(v))


def kinds_at(d: Any, kind: str) -> list[str]:
    return [f.severity for f in d.findings if f.kind == kind]


@pytest.mark.parametrize(("kind", "make", "severity"), zoo_data.CASES, ids=_id)
def test_the_bug_is_named(kind: str, make: Any, severity: str) -> None:
    d = examine(**make(False), checks=[kind])
    assert kinds_at(d, kind) == [severity], d


@pytest.mark.parametrize(("kind", "make", "severity"), zoo_data.CASES, ids=_id)
def test_the_twin_is_clean_and_untouched(kind: str, make: Any, severity: str) -> None:
    no_alarm(examined_untouched(make(True), checks="all"))


def test_shuffle_off_over_mixed_data_is_clean() -> None:
    d = examine(**zoo_data.setup_stored_mixed(), checks=["batch_class_mix"])
    assert not kinds_at(d, "batch_class_mix"), d


def test_the_dataset_is_read_in_a_worker_not_in_place() -> None:
    setup = zoo_data.setup_pairs(False)
    examine(**setup, checks=["batch_size_mismatch"])  # examine's own read of the batches
    by_examine = setup["batches"].dataset.reads
    setup = zoo_data.setup_pairs(False)
    examine(**setup, checks=["pair_transform_mismatch"])
    assert setup["batches"].dataset.reads == by_examine


@pytest.mark.parametrize(("kind", "make", "severity"), zoo_data.HELD_OUT, ids=_id)
def test_held_out_report_is_named(kind: str, make: Any, severity: str) -> None:
    d = examine(**make(False), checks="all")
    assert any(
        f.severity in ("error", "warning")
        for f in d.findings
        if f.kind.startswith(("labels", "batch", "pair", "dataloader"))
    ), d


@pytest.mark.parametrize("make", zoo_data.HELD_OUT_SETUPS, ids=_id)
def test_held_out_twin_is_clean(make: Any) -> None:
    no_alarm(examined_untouched(make(True), checks="all"))


@pytest.mark.parametrize(("kind", "make", "severity"), zoo_data.SPLIT_HELD_OUT, ids=_id)
def test_held_out_split_report_is_named_and_its_twin_clean(
    kind: str, make: Any, severity: str
) -> None:
    assert kinds_at(examine(**make(False), checks="all"), kind) == [severity]
    no_alarm(examined_untouched(make(True), checks="all"))


@pytest.mark.parametrize("as_numpy", [False, True])
def test_a_few_duplicate_rows_are_information_not_an_overlap(as_numpy: bool) -> None:
    train, val = zoo_data.Images(400), zoo_data.Images(200, seed=1)
    val.data[0] = train.data[7]  # one row of 200 (0.5%) also in the training data
    if as_numpy:  # a torchvision-style `.data` held as an ndarray
        train.data, val.data = train.data.numpy(), val.data.numpy()
    (f,) = examine(**zoo_data.split_setup(train, val), checks=["train_val_overlap"]).findings
    assert f.severity == "info", f
    assert f.evidence.startswith("1 of 200 samples of the eval loader are also in the training")


def test_without_an_eval_loader_the_splits_are_not_checked() -> None:
    setup = zoo_data.split_setup(zoo_data.Images(80), zoo_data.Images(16, seed=1))
    setup["eval_fn"] = None
    d = examine(**setup, checks=["train_val_overlap", "eval_augmented"])
    assert [(f.kind, f.severity) for f in d.findings] == [
        ("eval_augmented", "info"),
        ("train_val_overlap", "info"),
    ], d
    assert d.findings[0].evidence.startswith("not checked: no eval DataLoader found"), d


def test_the_missed_0_1_mask_over_255_is_named_since_by_the_losses_contract() -> None:
    """pytorch#53959, missed by labels_truncated when held out; target_out_of_range was since
    widened to hard 0/1 labels scaled below 1 (built from it, so no held-out evidence)."""
    d = examine(**zoo_data.setup_onehot_npy(False), checks="all")
    assert [(f.kind, f.severity) for f in d.findings if f.severity != "info"] == [
        ("target_out_of_range", "error")
    ], d


def test_an_image_only_brightened_beside_its_unmoved_mask_is_clean() -> None:
    no_alarm(examined_untouched(zoo_data.setup_photometric_only(), checks="all"))


def test_a_turn_names_both_angles() -> None:
    (f,) = examine(
        **zoo_data.setup_turned_image_only(False), checks=["pair_transform_mismatch"]
    ).findings
    assert "the image came back turned by" in f.evidence and "the mask by +0" in f.evidence, f
