"""What the trainer's bitwise tests compare: a few steps' weights, a snapshot's tensors by path."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from isotrain.train import config as C
from isotrain.train.loop import setup
from isotrain.train.step import train_step


def params_after(cfg: C.TrainConfig, steps: int) -> dict[str, torch.Tensor]:
    """The model's state after `steps` training steps of a fresh run from `cfg`."""
    torch.manual_seed(cfg.seed)
    run = setup(cfg)
    for _ in range(steps):
        train_step(run)
    return {k: v.detach().clone() for k, v in run.model.state_dict().items()}


def tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside nested dicts, lists and tuples, with its path."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{prefix}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{prefix}[{i}]")
