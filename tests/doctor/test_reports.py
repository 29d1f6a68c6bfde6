"""The kinds of public reports, beyond the zoo's pairs: where each finding points, Hugging Face
models given dict batches without a loss_fn, and a DataLoader as the batches."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tests.doctor import zoo
from torch.utils.data import DataLoader, TensorDataset

from isotrain.doctor import examine


def _gpt2() -> Any:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=16)
    return zoo.seeded(lambda: transformers.GPT2LMHeadModel(cfg))


def _padded(pad: int, *, masked: bool) -> list[dict[str, torch.Tensor]]:
    out = []
    for seed in (1, 2):
        ids = torch.randint(1, 32, (4, 16), generator=torch.Generator().manual_seed(seed))
        mask = torch.ones_like(ids)
        ids[1:, 10:], mask[1:, 10:] = pad, 0
        labels = ids.masked_fill(mask == 0, -100) if masked else ids.clone()
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def test_dict_batches_of_a_model_that_returns_its_loss_need_no_loss_fn() -> None:
    model = _gpt2()
    batches = _padded(0, masked=True)
    d = examine(model, zoo.adamw(model), batches, checks=["params_unchanged", "unused_parameter"])
    assert d.findings == []
    unlabelled = [{k: v for k, v in b.items() if k != "labels"} for b in batches]
    found = examine(model, zoo.adamw(model), unlabelled, checks=["params_unchanged"])
    (err,) = found.of("doctor_error")
    assert "the step raised ValueError: the model returned no .loss for a dict" in err.evidence
    with pytest.raises(ValueError, match="a dict batch needs neither"):
        examine(model, zoo.adamw(model), [(b["input_ids"],) for b in batches])


def test_a_dataloader_is_examined_by_its_first_batches_and_its_order_is_left_alone() -> None:
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(32, 8), torch.randint(0, 4, (32,)))
    loader = DataLoader(data, batch_size=8, shuffle=True, generator=g)
    twin = DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3))
    model = zoo.seeded(zoo.MLP)
    d = examine(model, zoo.adamw(model), loader, step=zoo.good_step, checks=["host_sync"])
    assert d.ok
    assert all(torch.equal(a[0], b[0]) for a, b in zip(loader, twin, strict=True))
