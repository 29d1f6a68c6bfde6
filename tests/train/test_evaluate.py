"""The trainer's evaluation: the exact loss of the validation split, the same windows for all."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F

from isotrain.train.config import PRESETS
from isotrain.train.loop import setup
from isotrain.train.step import evaluate


def test_evaluation_is_the_exact_loss_of_the_split_for_every_seed(tmp_path: Path) -> None:
    cfg = dataclasses.replace(PRESETS["smoke"](), eval_batches=10_000, out_dir=str(tmp_path))
    run = setup(cfg)
    T, val = cfg.model.block_size, torch.from_numpy(run.batches.corpus.val.astype("int64"))
    n = (len(val) - 1) // T
    with torch.no_grad():  # every non-overlapping window once, in one batch: the reference
        logits = run.model.eval()(val[: n * T].view(n, T))
        exact = F.cross_entropy(logits.flatten(0, 1), val[1 : n * T + 1]).item()
    run.model.train()
    assert abs(evaluate(run) - exact) < 1e-5
    other = dataclasses.replace(run.batches, seed=7)
    for (x, y), (x7, y7) in zip(run.batches.val(3), other.val(3), strict=True):
        assert torch.equal(x, x7) and torch.equal(y, y7)  # the windows do not depend on the seed
