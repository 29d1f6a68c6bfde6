"""Parameter groups and the LR schedule."""

import itertools

import pytest
import torch

from isotrain.train.config import OptimConfig
from isotrain.train.model.gpt import GPT, GPTConfig
from isotrain.train.update.optim import build_optimizer, lr_at


def test_decay_only_on_matrices_and_each_parameter_once() -> None:
    model = GPT(GPTConfig(block_size=8, n_layer=1, n_head=1, d_model=8))
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() < 2 for p in no_decay["params"])
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))


def test_schedule_warmup_peak_and_floor() -> None:
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(0, cfg, 100) == pytest.approx(0.1)
    assert lr_at(9, cfg, 100) == pytest.approx(1.0)
    assert lr_at(10, cfg, 100) == pytest.approx(1.0)
    assert lr_at(55, cfg, 100) == pytest.approx(0.55)
    assert lr_at(100, cfg, 100) == pytest.approx(0.1)
    assert lr_at(500, cfg, 100) == pytest.approx(0.1)
    mids = [lr_at(s, cfg, 100) for s in range(10, 101)]
    assert all(a >= b for a, b in itertools.pairwise(mids))


def test_fused_adamw_on_cpu_by_default() -> None:
    model = torch.nn.Linear(2, 2)
    assert build_optimizer(model, OptimConfig()).defaults["fused"] is True
