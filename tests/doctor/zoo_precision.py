"""The precision family's zoo: each public report rebuilt as a small setup, with its correct
twin (`make(fixed)`: False is the report's bug, True the same step done right). The reports
are listed in precision_reports.md."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from tests.doctor.zoo import MLP, ce, features, seeded
from torch import nn
from torch.func import functional_call


def _regressor() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))


def near_fit(model: nn.Module, n: int = 2, rows: int = 1024) -> list[Any]:
    """Batches whose targets the model already fits to within 1e-3: late training, where
    gradients are small."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randn(rows, 8, generator=g)
        with torch.no_grad():
            y = model(x) + 1e-3 * torch.randn(rows, 4, generator=g)
        out.append((x, y))
    return out


def setup_adam_eps_in_half(fixed: bool) -> dict[str, Any]:
    """https://github.com/afiaka87/glide-finetune/issues/5: a model cast to float16 trained with
    Adam's default eps=1e-8, which is 0 in float16: NaN after the first step (the fix there,
    https://github.com/afiaka87/glide-finetune/pull/6, passes eps=1e-4)."""
    model = seeded(MLP).half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4 if fixed else 1e-8)

    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x.half()).float(), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return dict(model=model, optimizer=opt, batches=features(), step=step)


def setup_fp16_autocast_without_scaler(fixed: bool) -> dict[str, Any]:
    """https://github.com/engichang1467/Open-Rig3R/issues/35: autocast in float16 with no
    GradScaler anywhere; late in training the small gradients lose their low bits or flush to
    0 in the float16 backward."""
    model = seeded(_regressor)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", enabled=fixed)

    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            pred = model(x)
        loss = F.mse_loss(pred.float(), y)
        scaler.scale(loss).backward()  # BUG (unfixed): a disabled scaler scales nothing
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    return dict(model=model, optimizer=opt, batches=near_fit(model), step=step)


class Bf16Compute(nn.Module):
    """FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16) in short: float32 parameters, each
    cast to bfloat16 for the forward, no autocast region; the output stays bfloat16."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cast = {n: p.to(torch.bfloat16) for n, p in self.inner.named_parameters()}
        return functional_call(self.inner, cast, (x.to(torch.bfloat16),))


def setup_bf16_logits_cross_entropy(fixed: bool) -> dict[str, Any]:
    """https://github.com/Modalities/modalities/pull/464: the causal-LM cross-entropy gets the
    model's bfloat16 logits with no autocast region open, so the loss is bfloat16."""
    model = seeded(lambda: Bf16Compute(MLP()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        if fixed:
            logits = logits.float()
        loss = F.cross_entropy(logits, y)  # BUG (unfixed): bfloat16 logits
        loss.backward()
        opt.step()
        return loss.detach()

    return dict(model=model, optimizer=opt, batches=features(), step=step)


class HappyNet(nn.Module):
    """pytorch#8860's network in short: convolutions, two fully connected layers, a softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        self.fc1, self.fc2 = nn.Linear(16 * 2 * 2, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(self.convs(x).flatten(1)))
        return F.softmax(self.fc2(h), dim=1)


def _images(n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(n)]  # fmt: skip


def setup_pytorch_8860_half_adam(fixed: bool) -> dict[str, Any]:
    """https://github.com/pytorch/pytorch/issues/8860 (held out): NaN loss when training in
    half precision: a convnet cast with .half(), Adam, a softmax output. The twin keeps the
    parameters in float32 under float16 autocast with a GradScaler, Adam's eps as it was."""
    model = seeded(HappyNet)
    if not fixed:
        model.half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=fixed)

    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16, enabled=fixed):
            probs = model(x if fixed else x.half())
        loss = F.nll_loss(torch.log(probs.float().clamp_min(1e-6)), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    return dict(model=model, optimizer=opt, batches=_images(), step=step)


def setup_so_74092624_half_model_and_data(fixed: bool) -> dict[str, Any]:
    """https://stackoverflow.com/questions/74092624 (held out): the model and the data cast
    with .half() for training, results "not good at all"; automatic mixed precision (float32
    parameters, autocast, a GradScaler) trained well."""
    model = seeded(MLP)
    if not fixed:
        model.half()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=fixed)
    criterion = nn.CrossEntropyLoss()

    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fixed):
            loss = criterion(model(x if fixed else x.half()), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    return dict(model=model, optimizer=opt, batches=features(), step=step)


BUGS: list[tuple[str, Any, str]] = [
    ("optimizer_eps_underflow", setup_adam_eps_in_half, "error"),
    ("grad_underflow", setup_fp16_autocast_without_scaler, "warning"),
    ("loss_in_low_precision", setup_bf16_logits_cross_entropy, "warning"),
]
# rebuilt once after the checks were done, tested once (precision_reports.md)
HELD_OUT: list[tuple[str, Any, str]] = [
    ("optimizer_eps_underflow", setup_pytorch_8860_half_adam, "error"),
    ("loss_in_low_precision", setup_so_74092624_half_model_and_data, "warning"),
]

# (kind, bug, clean twin, severity), as tests/doctor/test_zoo.py's CASES
CASES: list[tuple[str, Any, Any, str]] = [
    (kind, partial(make, False), partial(make, True), severity)
    for kind, make, severity in BUGS + HELD_OUT
]

__all__ = ["BUGS", "CASES", "HELD_OUT", "ce", "near_fit"]
