"""Data-parallel setups for a world of ranks: each bug as users write it, and a correct twin.

Every function returns `examine`'s keyword arguments and runs on every rank of a process group
(gloo on the CPU in the tests). The model is the zoo's MLP, wrapped in DistributedDataParallel;
the data is one dataset that every rank builds alike, as a real script reads one file.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tests.doctor import zoo
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def dataset(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


def loader(*, sampler: bool = True) -> DataLoader:
    """The rank's batches: DistributedSampler shards the dataset; without it (the bug) every
    rank shuffles the whole dataset with the same seeded generator, so all draw the same."""
    data = dataset()
    if sampler:
        return DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    torch.manual_seed(0)  # every rank seeds alike, as scripts do
    return DataLoader(data, batch_size=8, shuffle=True)


def step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    x, y = batch
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def setup(
    *, wrap: Any = None, sampler: bool = True, train_step: Any = None, find_unused: bool = False
) -> dict[str, Any]:
    """The correct setup (or, with `wrap(model)`, one changed after DDP wrapped it)."""
    model = zoo.seeded(zoo.MLP)
    ddp = DDP(model, find_unused_parameters=find_unused)
    if wrap is not None:
        wrap(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.0)
    batches = list(itertools.islice(loader(sampler=sampler), 2))
    return dict(model=ddp, optimizer=opt, batches=batches, step=train_step or step)


def new_head(model: nn.Module) -> None:
    """BUG: a new classifier head after DDP(model) (a common DDP forum question): DDP's hooks
    wait on the old head's parameters, so no bucket is reduced; the next forward raises
    "Expected to have finished reduction", unless find_unused_parameters=True (that error's
    own advice) marks the old ones unused: then nothing is said and each rank trains alone."""
    model.fc2 = zoo.seeded(lambda: nn.Linear(32, 4), seed=1)


def dtype_round_trip(model: nn.Module) -> None:
    """BUG: the model converted and converted back after wrapping (pytorch#104336 moves it
    between devices; on a CPU a dtype round trip does the same): new grad accumulators."""
    model.double()
    model.float()


def wrapper_on_some_calls() -> Any:
    """BUG: every second call reaches the model through .module (a trainer that wraps only
    sometimes, the HF out-of-sync report): that step's gradients are never averaged."""
    calls = itertools.count()

    def step_some_calls(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        net = model.module if next(calls) % 2 else model
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        return loss

    return step_some_calls


def clipping(*, every_rank: bool) -> Any:
    """BUG without `every_rank`: gradients clipped on one rank only (BLOOM-176B's LayerNorm
    drift, DeepSpeed PR 1801: each rank's update differs, so the replicas part)."""

    def step_clip(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if every_rank or dist.get_rank() == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        opt.step()
        return loss

    return step_clip


def counting(minlength: int) -> Any:
    """A step that all-reduces its class counts for logging; BUG without minlength: bincount's
    length is the largest label + 1, which differs by rank."""

    def step_counting(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        y = y.clamp(max=2) if dist.get_rank() == 1 else y  # rank 1's shard lacks class 3
        loss = step(model, opt, (x, y))
        counts = torch.bincount(y, minlength=minlength)
        dist.all_reduce(counts)
        return loss

    return step_counting


def logging_loss(*, every_rank: bool) -> Any:
    """BUG without `every_rank`: the mean loss all-reduced on rank 0 only, for its log line (a
    collective one rank makes alone: the job hangs there, Lightning#5243)."""

    def step_log(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        loss = step(model, opt, batch)
        if every_rank or dist.get_rank() == 0:
            dist.all_reduce(loss.detach().clone())
        return loss

    return step_log


class Projected(nn.Module):
    """The MLP behind a fixed random projection (a buffer no step writes) and a BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("proj", torch.randn(8, 8))
        self.norm, self.mlp = nn.BatchNorm1d(8), zoo.MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm(x @ self.proj))


def projected(*, broadcast_buffers: bool) -> dict[str, Any]:
    """BUG with broadcast_buffers=False: each rank seeds with its rank before building the
    model (for its own augmentations), and DDP broadcasts parameters but, so configured, not
    buffers: every rank projects its inputs differently. BatchNorm's statistics differ by
    rank either way between DDP's broadcasts: by design, not a finding."""
    torch.manual_seed(dist.get_rank())
    model = Projected()
    ddp = DDP(model, broadcast_buffers=broadcast_buffers)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.0)
    batches = list(itertools.islice(loader(), 2))
    return dict(model=ddp, optimizer=opt, batches=batches, step=step)


def parts(*, summed: bool) -> Any:
    """BUG: one forward through DDP and its loss in two parts, each with a backward of its own
    (retain_graph=True): DDP averages the gradients of one backward per forward, so the second
    part's stay each rank's own. The twin (`summed`) runs one backward on the parts' sum."""

    def step_parts(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        out = model(x)
        ce, penalty = F.cross_entropy(out, y), F.mse_loss(out, torch.zeros_like(out))
        if summed:
            (ce + penalty).backward()
        else:
            ce.backward(retain_graph=True)
            penalty.backward()
        opt.step()
        return (ce + penalty).detach()

    return step_parts


# kind, the bug as users write it, its correct twin
CASES: list[tuple[str, Any, Any]] = [
    ("gradient_not_synchronized", lambda: setup(wrap=new_head), setup),
    ("gradient_not_synchronized", lambda: setup(wrap=new_head, find_unused=True),
     lambda: setup(find_unused=True)),
    ("gradient_not_synchronized", lambda: setup(wrap=dtype_round_trip), setup),
    ("gradient_not_synchronized", lambda: setup(train_step=wrapper_on_some_calls()), setup),
    ("replica_divergence", lambda: setup(train_step=clipping(every_rank=False)),
     lambda: setup(train_step=clipping(every_rank=True))),
    ("same_data_on_ranks", lambda: setup(sampler=False), setup),
    ("replica_divergence", lambda: projected(broadcast_buffers=False),
     lambda: projected(broadcast_buffers=True)),
    ("collective_mismatch", lambda: setup(train_step=counting(0)),
     lambda: setup(train_step=counting(4))),
    ("collective_mismatch", lambda: setup(train_step=logging_loss(every_rank=False)),
     lambda: setup(train_step=logging_loss(every_rank=True))),
    ("gradient_not_synchronized", lambda: setup(train_step=parts(summed=False)),
     lambda: setup(train_step=parts(summed=True))),
]  # fmt: skip
