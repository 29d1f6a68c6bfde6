"""What a run is made of: the counters a resume continues (`TrainState`) and its parts (`Run`).

Both are plain containers: `loop.setup` fills a `Run` from a config, and a user's own code may
build one from its own model, optimizer and update rule (see `step.train_step`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from isotrain.train.config import TrainConfig
from isotrain.train.parallel import DistInfo

if TYPE_CHECKING:  # annotations only: these modules import nothing from here
    from isotrain.train.step import Batches
    from isotrain.train.updater import Updater

__all__ = ["Run", "TrainState"]


@dataclass
class TrainState:
    """The counters a resumed run continues from (tensors live in the snapshot beside them)."""

    step: int = 0
    tokens_seen: int = 0
    best_val: float = math.inf
    last_val: float | None = None


@dataclass
class Run:
    """Every part of a run. `model` is the raw module (sampling, snapshots); `train_model` is
    what the step calls (checkpointed, compiled, DDP/FSDP-wrapped); both may be the same."""

    cfg: TrainConfig
    dist: DistInfo
    batches: Batches
    model: nn.Module
    train_model: nn.Module
    optimizer: torch.optim.Optimizer
    updater: Updater
    state: TrainState = field(default_factory=TrainState)
    compile_seconds: float = 0.0
    compile_base: Any = None  # compile counters right after warm-up
