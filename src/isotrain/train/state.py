"""What a run is made of: its counters (`TrainState`), batches, update rule and parts (`Run`).

These are plain containers and one protocol: `loop.setup` fills a `Run` from a config, and a
user's own code may build one from its own model, optimizer and update rule
(`updater.GuardedUpdater` or anything with the `Updater` methods) to call `step.train_step`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from isotrain.compile import default_buckets
from isotrain.train.config import TrainConfig
from isotrain.train.data import batches as data_mod
from isotrain.train.data.tokenizer import ByteTokenizer, Tokenizer
from isotrain.train.model.gpt import GPT
from isotrain.train.parallel import DistInfo

__all__ = ["Batches", "Run", "TrainState", "Updater", "bucket_lengths"]


def bucket_lengths(cfg: TrainConfig) -> tuple[int, ...]:
    """The padded lengths of variable-length mode (or the one fixed length)."""
    if not cfg.data.varlen:
        return (cfg.model.block_size,)
    return cfg.data.buckets or default_buckets(cfg.model.block_size)


@dataclass(frozen=True)
class Batches:
    """Micro-batch `micro` of `step` on this rank: a pure function of (seed, step, micro, rank)."""

    corpus: data_mod.Corpus
    batch_size: int
    block_size: int
    seed: int
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    buckets: tuple[int, ...] | None = None  # variable-length mode: documents padded to these
    doc_starts: dict[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: TrainConfig, corpus: data_mod.Corpus, info: DistInfo) -> Batches:
        """The batches `cfg` asks for, drawn from `corpus` for this rank."""
        varlen = cfg.data.varlen
        return cls(
            corpus,
            cfg.data.batch_size,
            cfg.model.block_size,
            cfg.seed,
            info.rank,
            info.world_size,
            info.device,
            bucket_lengths(cfg) if varlen else None,
            {s: data_mod.document_starts(getattr(corpus, s)) for s in ("train", "val")}
            if varlen
            else {},
        )

    def get(self, split: str, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Inputs, targets (on the device) and the number of real target tokens."""
        kw = dict(
            batch_size=self.batch_size,
            seed=self.seed,
            step=step,
            micro=micro,
            rank=self.rank,
            world_size=self.world_size,
            stream=data_mod.TRAIN if split == "train" else data_mod.VAL,
        )
        tokens = getattr(self.corpus, split)
        if self.buckets is not None:
            x, y, n = data_mod.get_doc_batch(
                tokens, self.doc_starts[split], buckets=self.buckets, **kw
            )
        else:
            x, y = data_mod.get_batch(tokens, block_size=self.block_size, **kw)
            n = y.numel()
        return x.to(self.device), y.to(self.device), n

    def val(self, max_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The evaluation batches (NOTE [evaluation windows]); variable-length mode: the first
        `max_batches` validation batches of whole documents."""
        if self.buckets is not None:
            return [self.get("val", i)[:2] for i in range(max_batches)]
        windows = data_mod.eval_windows(
            self.corpus.val,
            batch_size=self.batch_size,
            block_size=self.block_size,
            max_batches=max_batches,
            rank=self.rank,
            world_size=self.world_size,
        )
        return [(x.to(self.device), y.to(self.device)) for x, y in windows]


class Updater(Protocol):
    """The update rule `train_step` calls: backward, a (guarded) step, LR factor, recovery.

    Values stay on the device until `read` is called at a log step.
    """

    def backward(self, loss: torch.Tensor, step: int) -> torch.Tensor: ...
    def step(self, loss: torch.Tensor, step: int) -> Any: ...
    def read(self, outcome: Any) -> dict[str, Any]: ...
    def drain_skips(self) -> list[tuple[int, str]]: ...
    def lr_factor(self, step: int) -> float: ...
    def recover(self, step: int) -> Any: ...
    def mark_good(self, step: int) -> None: ...
    def totals(self) -> dict[str, Any]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


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
    model: GPT
    train_model: nn.Module
    optimizer: torch.optim.Optimizer
    updater: Updater
    state: TrainState = field(default_factory=TrainState)
    compile_seconds: float = 0.0
    compile_base: Any = None  # compile counters right after warm-up
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)  # text <-> ids for samples
    precision_note: str = ""  # the precision and why (auto's choice and its measured ratio)
    eval_step: int | None = None  # the step state.last_val was measured at (None: not yet)
    monitor: Any = None  # the run's isotrain.doctor.Monitor (None: --doctor.every 0)
