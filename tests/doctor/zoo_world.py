"""Data-parallel setups whose replicas stay equal while the world is wrong: the ranks' data
split, and the applied gradient's scale. Each bug as users write it (from the reports in
tests/doctor/ranks_reports.md) beside a correct twin; every function returns `examine`'s
keyword arguments and runs on every rank of a gloo process group.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tests.doctor import zoo, zoo_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def _ddp(train_step: Any, batches: Any, *, sgd: bool = False) -> dict[str, Any]:
    model = DDP(zoo.seeded(zoo.MLP))
    params = model.parameters()
    opt = torch.optim.SGD(params, lr=0.1) if sgd else torch.optim.AdamW(params, lr=1e-2)
    return dict(model=model, optimizer=opt, batches=batches, step=train_step)


def split(sampler: Any = None, **loader: Any) -> dict[str, Any]:
    """The correct DDP setup, its DataLoader built with `sampler` (default: a
    DistributedSampler seeded alike on every rank) and handed to the doctor whole."""
    data = zoo_ranks.dataset()
    chosen = DistributedSampler(data, seed=0) if sampler is None else sampler(data)
    batches = DataLoader(data, batch_size=8, sampler=chosen, **loader)
    return _ddp(zoo_ranks.step, batches)


def seed_per_rank(data: Any) -> DistributedSampler:
    """BUG (mlcommons/training#625): each worker seeds its DistributedSampler with its own seed:
    the ranks take their slices of different permutations."""
    return DistributedSampler(data, seed=dist.get_rank())


def replicas_per_node(data: Any) -> DistributedSampler:
    """BUG: num_replicas counted as GPUs per node x nodes (4) on a world of 2: half the data
    is never drawn."""
    return DistributedSampler(data, num_replicas=2 * dist.get_world_size(), rank=dist.get_rank())


def epoch_on_rank_0(data: Any, *, every_rank: bool) -> DistributedSampler:
    """BUG without `every_rank`: set_epoch called by the main process only (inside its
    `if rank == 0:` logging block): the ranks shuffle with other epochs."""
    sampler = DistributedSampler(data, seed=0)
    if every_rank or dist.get_rank() == 0:
        sampler.set_epoch(1)
    return sampler


def whole_data_per_rank() -> dict[str, Any]:
    """BUG: no DistributedSampler, each rank shuffles the whole dataset with its own seed (a
    script that seeds with its rank for its augmentations)."""
    g = torch.Generator().manual_seed(dist.get_rank())
    return split(lambda data: torch.utils.data.RandomSampler(data, generator=g))


class RankBatches:
    """Correct: a batch sampler of the user's own that deals out the batches of one shared
    permutation, one in world_size to each rank (as accelerate's BatchSamplerShard does); the
    DataLoader's own `sampler` is then an unused SequentialSampler."""

    def __init__(self, n: int, batch_size: int) -> None:
        self.n, self.batch_size, self.epoch = n, batch_size, 0

    def __iter__(self) -> Any:
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch))
        batches = order.split(self.batch_size)
        yield from (b.tolist() for b in batches[dist.get_rank() :: dist.get_world_size()])

    def __len__(self) -> int:
        return -(-self.n // self.batch_size) // dist.get_world_size()


def rank_batches() -> dict[str, Any]:
    data = zoo_ranks.dataset()
    loader = DataLoader(data, batch_sampler=RankBatches(len(data), 8))
    return _ddp(zoo_ranks.step, loader)


def long_live_seed(data: Any) -> DistributedSampler:
    """Held out (NVlabs/LongLive#71): the sampler's seed is the time multiplied by the rank."""
    return DistributedSampler(data, shuffle=True, seed=int(time.time()) * dist.get_rank())


def scaled_loss(factor: str) -> Any:
    """BUG (neuralmagic/sparseml#135): backward on the loss x world_size (`"mul"`) or
    / world_size (`"div"`) under DDP, the unscaled loss returned for the log."""

    def step_scaled(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        world = dist.get_world_size()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        (loss * world if factor == "mul" else loss / world).backward()
        opt.step()
        return loss

    return step_scaled


def summed_grads(*, divide: bool) -> Any:
    """BUG without `divide`: each .grad all-reduced (SUM) on top of DDP's average. With the
    divide it is the redundant but harmless average of kubeflow/pytorch-operator#122."""

    def step_summed(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            if divide:
                p.grad /= dist.get_world_size()
        opt.step()
        return loss

    return step_summed


def gathered_times_world(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> Any:
    """Correct: a loss over the whole world's outputs gathered without autograd (only this
    rank's part carries a gradient), so it is multiplied by the world size to undo DDP's
    average (the contrastive losses of Tevatron and OpenGait)."""
    x, y = batch
    world, rank = dist.get_world_size(), dist.get_rank()
    opt.zero_grad(set_to_none=True)
    out = model(x)
    outs = [torch.zeros_like(out) for _ in range(world)]
    labels = [torch.zeros_like(y) for _ in range(world)]
    dist.all_gather(outs, out.detach())
    dist.all_gather(labels, y)
    outs[rank] = out
    loss = F.cross_entropy(torch.cat(outs), torch.cat(labels))
    (loss * world).backward()
    opt.step()
    return loss


def automodel_seq_cls(*, fixed: bool) -> Any:
    """Held out (NVIDIA-NeMo/Automodel#3830): a per-rank mean loss multiplied by dp_size over
    two accumulation micro-batches; fixed: the plain mean over the micro-batches."""

    def step_seq_cls(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        logged = torch.zeros(())
        for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True):
            loss = F.cross_entropy(model(xs), ys)
            (loss / 2 if fixed else loss * dist.get_world_size()).backward()
            logged += loss.detach() / 2
        opt.step()
        return logged

    return step_seq_cls


def accumulate(*, world: bool) -> Any:
    """Gradient accumulation over 4 micro-batches, DDP's no_sync on all but the last. BUG with
    `world`: each micro-batch's loss / 4 x world_size (as if DDP summed the gradients); without
    it the correct loop: loss / 4."""

    def step_accumulate(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> Any:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        logged, micro = torch.zeros(()), list(zip(x.chunk(4), y.chunk(4), strict=True))
        for i, (xs, ys) in enumerate(micro):
            last = i == len(micro) - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = F.cross_entropy(model(xs), ys)
                scaled = loss / len(micro)
                (scaled * dist.get_world_size() if world else scaled).backward()
            logged += loss.detach() / len(micro)
        opt.step()
        return logged

    return step_accumulate


def loss_parts(*, divided: bool) -> Any:
    """Data parallel by hand (DDP allows one backward per forward): one forward, its loss in
    two parts (cross-entropy and a logit penalty) each with a backward of its own, then each
    .grad averaged over ranks. BUG with `divided`: each part / world_size too (the divide of a
    SUM all-reduce kept beside the average); without it each part backwarded whole."""

    def step_parts(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> Any:
        x, y = batch
        world = dist.get_world_size()
        opt.zero_grad(set_to_none=True)
        out = model(x)
        ce, penalty = F.cross_entropy(out, y), F.mse_loss(out, torch.zeros_like(out))
        (ce / world if divided else ce).backward(retain_graph=True)
        (penalty / world if divided else penalty).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        return ce.detach() + penalty.detach()

    return step_parts


def by_hand(train_step: Any) -> dict[str, Any]:
    """A model no framework wraps, every rank starting from the same weights."""
    model = zoo.seeded(zoo.MLP)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return dict(model=model, optimizer=opt, batches=_batches(), step=train_step)


def _batches() -> list[Any]:
    return list(zoo_ranks.loader())[:2]


# kind, the bug as users write it, its correct twin
CASES: list[tuple[str, Any, Any]] = [
    ("data_split_across_ranks", lambda: split(seed_per_rank), split),
    ("data_split_across_ranks", lambda: split(replicas_per_node), split),
    ("data_split_across_ranks", whole_data_per_rank, rank_batches),
    ("data_split_across_ranks", lambda: split(lambda d: epoch_on_rank_0(d, every_rank=False)),
     lambda: split(lambda d: epoch_on_rank_0(d, every_rank=True))),
    ("gradient_scaled_by_world", lambda: _ddp(scaled_loss("mul"), _batches(), sgd=True),
     lambda: _ddp(zoo_ranks.step, _batches(), sgd=True)),
    ("gradient_scaled_by_world", lambda: _ddp(scaled_loss("div"), _batches()),
     lambda: _ddp(zoo_ranks.step, _batches())),
    ("gradient_scaled_by_world", lambda: _ddp(summed_grads(divide=False), _batches()),
     lambda: _ddp(summed_grads(divide=True), _batches())),
    ("gradient_scaled_by_world", lambda: _ddp(scaled_loss("mul"), _batches()),
     lambda: _ddp(gathered_times_world, _batches())),
    ("gradient_scaled_by_world", lambda: _ddp(accumulate(world=True), _batches(), sgd=True),
     lambda: _ddp(accumulate(world=False), _batches(), sgd=True)),
    ("gradient_scaled_by_world", lambda: by_hand(loss_parts(divided=True)),
     lambda: by_hand(loss_parts(divided=False))),
]  # fmt: skip

# the held-out reports, rebuilt once after the checks were done (tests/doctor/ranks_reports.md)
HELD_OUT: list[tuple[str, Any, Any]] = [
    ("data_split_across_ranks", lambda: split(long_live_seed), split),
    ("gradient_scaled_by_world", lambda: _ddp(automodel_seq_cls(fixed=False), _batches()),
     lambda: _ddp(automodel_seq_cls(fixed=True), _batches())),
]  # fmt: skip
