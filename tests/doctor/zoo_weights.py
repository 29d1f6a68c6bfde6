"""Per-class loss weights given in the wrong order, each beside its clean twin.

Every `setup_*(fixed)` returns the keyword arguments of `isotrain.doctor.examine`, with 8
batches of class targets in the proportions the report's data had (the doctor counts the
targets of the calls it traces). The bug ones (fixed=False) cite the public report they were
written from.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from tests.doctor.zoo import adamw, seeded
from torch import nn

BATCHES, ROWS, FEATURES = 8, 64, 8


def labelled(shares: list[float], seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """BATCHES batches of ROWS rows whose class ids follow `shares` (in order of class id),
    shuffled within each batch."""
    g = torch.Generator().manual_seed(seed)
    counts = [round(s * ROWS) for s in shares]
    counts[0] += ROWS - sum(counts)
    ids = torch.cat([torch.full((n,), c) for c, n in enumerate(counts)])
    return [(torch.randn(ROWS, FEATURES, generator=g), ids[torch.randperm(ROWS, generator=g)])
            for _ in range(BATCHES)]  # fmt: skip


def weighted_setup(weight: torch.Tensor, batches: Any) -> dict[str, Any]:
    """A linear classifier trained with nn.CrossEntropyLoss(weight=weight)."""
    model = seeded(lambda: nn.Linear(FEATURES, len(weight)))
    criterion = nn.CrossEntropyLoss(weight=weight)

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return criterion(model(x), y)

    return dict(model=model, optimizer=adamw(model), batches=batches, loss_fn=loss_fn)


def setup_binary_weights_swapped(fixed: bool) -> dict[str, Any]:
    """https://github.com/amanshenoy/multilogue-net/issues/21: `loss_weights =
    torch.FloatTensor([1/0.0816, 1/0.9184])` for 'fear', whose label 0 is the frequent one:
    each class gets the other's inverse frequency."""
    share = [0.9184, 0.0816]
    weight = [1 / share[0], 1 / share[1]] if fixed else [1 / share[1], 1 / share[0]]  # BUG
    return weighted_setup(torch.tensor(weight), labelled(share, seed=1))


def setup_frequencies_as_weights(fixed: bool) -> dict[str, Any]:
    """https://github.com/mlcommons/GaNDLF/issues/209: the penalty weights equal the class
    frequencies ({0: 0.80, 1: 0.15, 2: 0.05} here); they should weigh rare classes up."""
    share = [0.80, 0.15, 0.05]
    weight = [1 / (3 * s) for s in share] if fixed else share  # BUG: the frequencies
    return weighted_setup(torch.tensor(weight), labelled(share, seed=2))


def setup_weights_in_count_order(fixed: bool) -> dict[str, Any]:
    """https://github.com/wxjiao/HiGRUs/pull/12: the weights are built by iterating a word
    count dict (`for k, v in ladict.word2count.items()`), whose order is not the label index."""
    names = ["neutral", "joy", "sadness", "anger"]  # label ids 0..3
    share = [0.50, 0.25, 0.15, 0.10]
    batches = labelled(share, seed=3)
    counts = Counter(names[int(c)] for _, y in batches for c in y)  # insertion: first seen
    rows = names if fixed else list(counts)  # BUG: the count dict's order, not the label ids
    weight = [max(counts.values()) / counts[k] for k in rows]
    return weighted_setup(torch.tensor(weight), batches)


def setup_hand_set_costs() -> dict[str, Any]:
    """Correct on purpose: a cost per class set by hand (class 0, the most frequent, the most
    costly to miss), not derived from the frequencies."""
    return weighted_setup(torch.tensor([3.0, 1.0, 1.0, 1.0]), labelled([0.4, 0.1, 0.3, 0.2]))


def setup_uniform_weights() -> dict[str, Any]:
    """Correct: weight=torch.ones(C) on imbalanced classes."""
    return weighted_setup(torch.ones(3), labelled([0.7, 0.2, 0.1]))


def segmentation_step(weight: torch.Tensor) -> Any:
    """A per-pixel (N, C, H, W) cross_entropy with a class weight, as F.cross_entropy."""

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y, weight=weight, ignore_index=255)

    return loss_fn


RATES = [0.5, 0.25, 0.1, 0.05]  # each label's share of positive targets


def multi_label(rates: list[float], seed: int = 9) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """BATCHES batches of ROWS rows, each label positive in exactly its share of the rows."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(BATCHES):
        y = torch.zeros(ROWS, len(rates))
        for label, rate in enumerate(rates):
            y[torch.randperm(ROWS, generator=g)[: round(rate * ROWS)], label] = 1.0
        out.append((torch.randn(ROWS, FEATURES, generator=g), y))
    return out


def positive_setup(pos_weight: torch.Tensor) -> dict[str, Any]:
    """A multi-label linear head trained with nn.BCEWithLogitsLoss(pos_weight=pos_weight)."""
    model = seeded(lambda: nn.Linear(FEATURES, len(RATES)))
    criterion = nn.BCEWithLogitsLoss(pos_weight=pos_weight)

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return criterion(model(x), y)

    return dict(model=model, optimizer=adamw(model), batches=multi_label(RATES), loss_fn=loss_fn)


def setup_pos_weight_inverted(fixed: bool) -> dict[str, Any]:
    """Planted: pos_weight = positives / negatives per label, the inverse of the documented
    negatives / positives (300 / 100 = 3)."""
    r = torch.tensor([(1 - p) / p for p in RATES])
    return positive_setup(r if fixed else 1 / r)


def setup_pos_weight_reordered(fixed: bool) -> dict[str, Any]:
    """Planted: the labels' negative/positive ratios listed most common first, while the
    labels are in another order (GRLModel#4's slip, on pos_weight)."""
    r = torch.tensor([(1 - p) / p for p in RATES])
    return positive_setup(r if fixed else r[torch.tensor([2, 0, 3, 1])])


def setup_pos_weight_constant() -> dict[str, Any]:
    """Correct on purpose: one pos_weight of 2 for every label."""
    return positive_setup(torch.full((len(RATES),), 2.0))


BUILT_FROM: list[Any] = [
    setup_binary_weights_swapped,
    setup_frequencies_as_weights,
    setup_weights_in_count_order,
]
PLANTED: list[Any] = [setup_pos_weight_inverted, setup_pos_weight_reordered]


# -- held out: rebuilt once the check was done, tested once ------------------------------------
MELD_IDS = ["neutral", "surprise", "fear", "sadness", "joy", "disgust", "anger"]
MELD_TRAIN = {"neutral": 4710, "surprise": 1205, "fear": 268, "sadness": 683, "joy": 1743,
              "disgust": 271, "anger": 1109}  # fmt: skip


def setup_meld_paper_order(fixed: bool) -> dict[str, Any]:
    """https://github.com/declare-lab/MELD/issues/51: the README's weights [4, 15, 15, 3, 1,
    6, 3] follow the paper's order of the emotions, not the annotation files' label ids; the
    report gives [1, 3, 15, 6, 3, 15, 4] for the ids."""
    total = sum(MELD_TRAIN.values())
    share = [MELD_TRAIN[k] / total for k in MELD_IDS]
    weight = [1.0, 3.0, 15.0, 6.0, 3.0, 15.0, 4.0] if fixed else [4.0, 15.0, 15.0, 3.0, 1.0,
                                                                  6.0, 3.0]  # fmt: skip
    return weighted_setup(torch.tensor(weight), labelled(share, seed=4))


def setup_attribute_ratios_reordered(fixed: bool) -> dict[str, Any]:
    """https://github.com/slf12/GRLModel/issues/4: pedestrian attributes weighted by their
    positive ratios, the ratios listed in another order than the attributes are predicted
    (a weighted binary_cross_entropy_with_logits, one weight per attribute)."""
    g = torch.Generator().manual_seed(5)
    ratio = torch.tensor([0.55, 0.50, 0.32, 0.10, 0.06, 0.23])  # per attribute, predicted order
    xs = [torch.randn(ROWS, FEATURES, generator=g) for _ in range(BATCHES)]
    batches = [(x, (torch.rand(ROWS, 6, generator=g) < ratio).float()) for x in xs]
    listed = ratio if fixed else ratio[torch.tensor([1, 2, 0, 5, 3, 4])]  # BUG: another order
    weight = torch.exp(1 - listed)  # DeepMAR's weighting: rarer attributes weigh more
    model = seeded(lambda: nn.Linear(FEATURES, 6))

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.binary_cross_entropy_with_logits(model(x), y, weight=weight)

    return dict(model=model, optimizer=adamw(model), batches=batches, loss_fn=loss_fn)


HELD_OUT: list[tuple[Any, str]] = [
    (setup_meld_paper_order, "hand-rounded weights, inverse frequencies only within 1.44x"),
    (
        setup_attribute_ratios_reordered,
        "a binary loss's per-attribute weight is not judged",
    ),
]


# (kind, bug, clean twin, severity), as tests/doctor/test_zoo.py's CASES
CASES: list[tuple[str, Any, Any, str]] = [
    ("class_weight_order", (lambda m=make: m(False)), (lambda m=make: m(True)), "warning")
    for make in BUILT_FROM + PLANTED
]
