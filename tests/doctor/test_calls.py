"""The call watch reads a loss call's arguments the way torch does: by name, positionally, and
through the legacy size_average/reduce pair."""

from __future__ import annotations

import inspect
import itertools
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from isotrain.doctor.ground.calls import LOSSES, CallWatch, bound, reduction, watching_calls

LEGACY = [None, True, False]


def _inputs(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, generator=g)
    if name in ("cross_entropy", "nll_loss"):
        return x.log_softmax(1), torch.tensor([0, 1, 2, 3, 0, 1])
    return x, torch.randn(6, 4, generator=g)


@pytest.mark.parametrize("func", list(LOSSES), ids=list(LOSSES.values()))
def test_the_reduction_read_is_the_one_torch_applies(func: Any) -> None:
    x, y = _inputs(LOSSES[func])
    each = func(x, y, reduction="none")
    applies = {"none": each, "sum": each.sum(), "mean": each.mean()}
    legacy = "size_average" in inspect.signature(func).parameters
    for size_average, reduce in itertools.product(LEGACY, LEGACY) if legacy else [(None, None)]:
        kwargs = {"size_average": size_average, "reduce": reduce} if legacy else {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's deprecation of the pair
            out = func(x, y, **kwargs)
        read = reduction(bound(func, (x, y), kwargs) or {})
        assert torch.allclose(out, applies[read]), (size_average, reduce, read)


def test_positional_arguments_are_read_by_their_parameter() -> None:
    x, y = _inputs("cross_entropy")
    watch = CallWatch()
    with watching_calls(watch):
        F.nll_loss(x, y, None, None, 3, None, "sum")
        F.mse_loss(x, x.detach(), None, None, "none")
        F.huber_loss(x, x.detach(), "sum")
        F.cross_entropy(x, y, size_average=False)
    read = [(c.name, c.ignore_index, c.reduction) for c in watch.calls]
    assert read == [
        ("nll_loss", 3, "sum"),
        ("mse_loss", -100, "none"),
        ("huber_loss", -100, "sum"),
        ("cross_entropy", -100, "sum"),
    ]
