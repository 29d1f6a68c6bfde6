"""The optimizer (AdamW with decay / no-decay groups, or Muon with AdamW: `--optim.name`) and
the LR schedule as a pure function of step."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from isotrain.train.config import OptimConfig
from isotrain.train.update.muon import MuonAdamW

__all__ = ["build_optimizer", "lr_at", "set_lr"]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Matrices (Linear, Embedding weights) decay; biases and norm gains do not.

    Tied parameters appear once (named_parameters deduplicates them).
    """
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, *, fused: bool | None = None
) -> torch.optim.Optimizer:
    """AdamW over `model`'s trainable parameters, or `MuonAdamW` with `--optim.name muon`.

    `fused=None` picks the fused kernel where this torch has it for the parameters' device:
    it is faster and honours the `found_inf` skip protocol the guard relies on.
    """
    if fused is None:
        device = next(model.parameters()).device.type
        fused = device in ("cuda", "cpu")
    if cfg.name == "muon":
        return MuonAdamW(
            model,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            betas=(cfg.beta1, cfg.beta2),
            momentum=cfg.muon_momentum,
            fused=fused,
        )
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        fused=fused,
    )


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Linear warmup to `lr`, then cosine decay to `min_lr` at `total_steps`."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(total_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Write `lr` into every parameter group (a Python float: no device work)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
