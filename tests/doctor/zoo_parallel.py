"""Parallel setups without a framework wrapper, each correct twin beside its bug, for 2+ ranks.

Manual data parallel (each gradient all-reduced by hand, as in the PyTorch distributed tutorial
"Writing Distributed Applications with PyTorch", `average_gradients`), tensor parallel (a
Megatron-LM column/row-parallel Linear pair written by hand, its all_reduce and all_gather in
forward) and expert parallel (tokens routed to one expert per rank with `all_to_all_single`, as
fairseq's MoE layer and DeepSpeed-MoE do). Every function returns `examine`'s keyword
arguments and runs on every rank of a gloo process group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tests.doctor import zoo
from torch import nn


def _data(rank: int, n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The rank's own batches (a shard of the data: each rank draws its own)."""
    g = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)
    ]


def _step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    x, y = batch
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def manual_dp(*, reduce: str) -> dict[str, Any]:
    """Manual data parallel: the same model on every rank, each .grad all-reduced by hand and
    divided by the world size between backward and optimizer.step() (`reduce="after"`); BUG
    with "none" (the all_reduce forgotten) or "before" (done before backward: it averages
    nothing that backward then computes)."""
    model = zoo.seeded(zoo.MLP)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    world = dist.get_world_size()

    def average() -> None:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world

    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad(set_to_none=False)
        if reduce == "before":
            average()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if reduce == "after":
            average()
        opt.step()
        return loss

    return dict(model=model, optimizer=opt, batches=_data(dist.get_rank()), step=step)


class _Sum(torch.autograd.Function):
    """all_reduce in forward (the row-parallel output), identity in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _Gather(torch.autograd.Function):
    """all_gather along the last dim in forward (a column-parallel output), this rank's slice
    of the gradient in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        ctx.width = x.shape[-1]
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        rank = dist.get_rank()
        return grad[..., rank * ctx.width : (rank + 1) * ctx.width]


class TensorParallel(nn.Module):
    """Linear(8, 16) column-parallel (its outputs all-gathered), ReLU, Linear(16, 4)
    row-parallel (its partial sums all-reduced) plus a replicated bias: the full layers are
    built alike on every rank and each rank keeps its shard."""

    def __init__(self, *, reduce: bool = True) -> None:
        super().__init__()
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)  # the full layers alike on every rank
        fc1, fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        part = slice(rank * 16 // world, (rank + 1) * 16 // world)
        self.w1 = nn.Parameter(fc1.weight.detach()[part].clone())
        self.b1 = nn.Parameter(fc1.bias.detach()[part].clone())
        self.w2 = nn.Parameter(fc2.weight.detach()[:, part].clone())
        self.b2 = nn.Parameter(fc2.bias.detach().clone())  # replicated
        self.part, self.reduce = part, reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(_Gather.apply(F.linear(x, self.w1, self.b1)))  # every rank: all 16 features
        partial = F.linear(h[:, self.part], self.w2)
        return (_Sum.apply(partial) if self.reduce else partial) + self.b2


def tensor_parallel(*, reduce: bool) -> dict[str, Any]:
    """Tensor parallel: every rank gets the same batch (by design) and holds its shard of the
    two layers; BUG without `reduce`: the row-parallel partial sums are never all-reduced, so
    each rank's output, loss and replicated bias b2 differ."""
    model = TensorParallel(reduce=reduce)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return dict(model=model, optimizer=opt, batches=_data(0), step=_step)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send)
        ctx.send, ctx.recv = send, recv
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(
            out, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv
        )
        return out, None, None


class ExpertParallel(nn.Module):
    """A router replicated on every rank and one expert per rank (each rank's own weights): the
    top-1 tokens go to their expert's rank with all_to_all_single and come back the same way."""

    def __init__(self, *, splits_exchanged: bool = True) -> None:
        super().__init__()
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        self.router, self.head = nn.Linear(8, world), nn.Linear(8, 4)  # replicated
        torch.manual_seed(1 + rank)
        self.expert = nn.Linear(8, 8)  # this rank's expert
        self.splits_exchanged = splits_exchanged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.router(x).softmax(-1)
        weight, choice = gate.max(-1)
        order = choice.argsort()
        send = torch.bincount(choice, minlength=dist.get_world_size())
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)  # how many tokens each rank sends here
        if not self.splits_exchanged:
            recv = send  # BUG: assumes every rank sends this rank what it sends each rank
        tokens = _AllToAll.apply(x[order], send.tolist(), recv.tolist())
        done = _AllToAll.apply(F.relu(self.expert(tokens)), recv.tolist(), send.tolist())
        out = torch.empty_like(done).index_copy(0, order, done)
        return self.head(out * weight[:, None])


def expert_parallel(*, splits_exchanged: bool = True, reduce: bool = True) -> dict[str, Any]:
    """Expert parallel over the ranks' own data: the replicated router and head have their
    gradients all-reduced by hand, the experts not (each rank trains its own). BUG without
    `splits_exchanged`: the receive sizes are guessed, so ranks disagree on the split sizes
    (gloo fails, NCCL hangs or reads garbage)."""
    model = ExpertParallel(splits_exchanged=splits_exchanged)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shared = [*model.router.parameters(), *model.head.parameters()]
    world = dist.get_world_size()

    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if reduce:
            for p in shared:
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        return loss

    return dict(model=model, optimizer=opt, batches=_data(dist.get_rank()), step=step)


# name, kind, the bug as users write it, its correct twin
CASES: list[tuple[str, str, Any, Any]] = [
    ("manual_dp_forgotten", "gradient_not_synchronized",
     lambda: manual_dp(reduce="none"), lambda: manual_dp(reduce="after")),
    ("manual_dp_before_backward", "gradient_not_synchronized",
     lambda: manual_dp(reduce="before"), lambda: manual_dp(reduce="after")),
    ("tensor_parallel", "gradient_not_synchronized",
     lambda: tensor_parallel(reduce=False), lambda: tensor_parallel(reduce=True)),
    ("expert_parallel_splits", "collective_mismatch",
     lambda: expert_parallel(splits_exchanged=False), expert_parallel),
    ("expert_parallel_router", "gradient_not_synchronized",
     lambda: expert_parallel(reduce=False), expert_parallel),
]  # fmt: skip
