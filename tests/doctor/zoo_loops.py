"""More training setups rebuilt from public repositories' own loops (zoo_real.REAL holds them
too): an epoch function examined with epoch=, a gradient norm measured without clipping, and
a trainer object whose EMA helper keeps its state two levels below it.

Each `real_*` function returns examine's keyword arguments for correct code; the builders
beside them make the same loop with one thing changed, for the tests' buggy twins.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["LOOPS", "mnist_epoch", "seeded"]


def seeded(setup: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """`setup` built under seed 0, the caller's RNG untouched."""

    @functools.wraps(setup)
    def built(*args: Any, **kwargs: Any) -> dict[str, Any]:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return setup(*args, **kwargs)

    return built


class MnistNet(nn.Module):
    """pytorch/examples mnist's Net, smaller: two convolutions, max-pool, dropout, two Linears,
    log_softmax (its loss is nll_loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 4, 3), nn.Conv2d(4, 8, 3)
        self.drop1, self.drop2 = nn.Dropout(0.25), nn.Dropout(0.5)
        self.fc1, self.fc2 = nn.Linear(32, 16), nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)  # (B, 8, 2, 2)
        x = self.drop1(torch.flatten(x, 1))
        return F.log_softmax(self.fc2(self.drop2(F.relu(self.fc1(x)))), dim=1)


def _train(args: Any, model: nn.Module, device: Any, train_loader: Any, optimizer: Any,
           epoch: int, scheduler: Any = None) -> None:  # fmt: skip
    """mnist's train() as it is written (`scheduler`: stepped after every batch when given, the
    per-epoch schedule misplaced)."""
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        if batch_idx % args.log_interval == 0:
            args.log.append(
                "Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}".format(  # noqa: UP032
                    epoch, batch_idx * len(data), len(train_loader.dataset),
                    100.0 * batch_idx / len(train_loader), loss.item(),
                )
            )  # fmt: skip


def _test(model: nn.Module, device: Any, test_loader: Any) -> float:
    """mnist's test(): model.eval(), summed nll_loss over len(test_loader.dataset)."""
    model.eval()
    test_loss = 0.0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            test_loss += F.nll_loss(model(data), target, reduction="sum").item()
    return test_loss / len(test_loader.dataset)


@seeded
def mnist_epoch(*, log_interval: int = 10, step_size: int = 1, gamma: float = 0.7,
                epochs: int = 14, per_batch: bool = False) -> dict[str, Any]:  # fmt: skip
    """pytorch/examples mnist: Adadelta, StepLR(step_size, gamma) stepped once per epoch after
    train() (or, `per_batch`, inside its batch loop), `epochs` epochs of a 6-batch loader."""
    args = SimpleNamespace(log_interval=log_interval, log=[])  # the log lines, not printed
    device = torch.device("cpu")
    model = MnistNet()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=step_size, gamma=gamma)
    data = TensorDataset(torch.randn(48, 1, 8, 8), torch.randint(0, 10, (48,)))
    loader = DataLoader(data, batch_size=8)

    def epoch(model: nn.Module, optimizer: Any, train_loader: Any) -> None:
        _train(args, model, device, train_loader, optimizer, 1, scheduler if per_batch else None)
        if not per_batch:
            scheduler.step()

    return {"model": model, "optimizer": optimizer, "batches": loader, "epoch": epoch,
            "eval_fn": lambda model, loader: _test(model, device, loader),
            "total_steps": epochs * len(loader)}  # fmt: skip


def real_mnist_epoch() -> dict[str, Any]:
    """pytorch/examples mnist's train(args, model, device, train_loader, optimizer, epoch) as
    epoch=: a log line reading loss.item() every log_interval batches, StepLR(1, 0.7) after
    each epoch over a declared 14-epoch run, test() leaving the model in eval mode."""
    return mnist_epoch()


@seeded
def real_grad_norm_measured() -> dict[str, Any]:
    """A loop that logs the gradient norm without clipping it: `clip_grad_norm_(params,
    float('inf'))`, the common form in public training loops (max_norm / norm is inf inside
    it, clamped to 1)."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    norms: list[torch.Tensor] = []

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
        opt.step()
        return loss

    batches = [(torch.randn(6, 8), torch.randint(0, 3, (6,))) for _ in range(2)]
    return {"model": model, "optimizer": opt, "batches": batches, "step": step}


class ShadowState:
    """Level 3: an EMA's shadow tensors and its update counter."""

    def __init__(self, model: nn.Module) -> None:
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.steps = 0


class EmaHelper:
    """Level 2: an EMA helper holding its state object."""

    def __init__(self, model: nn.Module, decay: float = 0.99) -> None:
        self.decay = decay
        self.state = ShadowState(model)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.state.steps += 1
        for n, p in model.named_parameters():
            self.state.shadow[n].lerp_(p.detach(), 1 - self.decay)


class Trainer:
    """Level 1: a research repo's Trainer object (lucidrains' denoising-diffusion-pytorch keeps
    `self.ema` and `self.step` on its Trainer), its training step a method."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.opt, self.ema, self.step = opt, EmaHelper(model), 0

    def train_step(self, model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        self.ema.update(model)
        self.ema.state.last_loss = loss.detach()  # an attribute the first step creates
        self.step += 1
        return loss


@seeded
def real_nested_trainer() -> dict[str, Any]:
    """A Trainer whose train_step (a bound method) updates an EMA helper holding its shadow
    dict and counter: state three levels below the name the step is reached by."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = Trainer(model, opt)
    batches = [(torch.randn(6, 8), torch.randint(0, 3, (6,))) for _ in range(2)]
    return {"model": model, "optimizer": opt, "batches": batches, "step": trainer.train_step}


LOOPS = {
    "mnist_epoch": real_mnist_epoch,
    "grad_norm_measured": real_grad_norm_measured,
    "nested_trainer": real_nested_trainer,
}
