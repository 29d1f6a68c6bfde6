"""How a step's gradients become a weight update: loss scaling, clipping, the guard, the step.

Two implementations behind one small interface: `GuardedUpdater` (isotrain.guard, the default)
and `PlainUpdater` (clip and step, what most loops do). Both keep every value on the device
until `read` is called at a log step.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from isotrain.train.config import TrainConfig
from isotrain.train.parallel import DistInfo

__all__ = ["PlainUpdater", "Updater", "build_updater"]


class Updater(Protocol):
    """The update rule the loop calls; see the module docstring."""

    def backward(self, loss: torch.Tensor) -> None: ...
    def step(self, loss: torch.Tensor, step: int) -> Any: ...
    def read(self, outcome: Any) -> dict[str, Any]: ...
    def totals(self) -> dict[str, Any]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _make_scaler(cfg: TrainConfig, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 needs loss scaling; fp32 and bf16 do not."""
    return torch.amp.GradScaler(device.type) if cfg.precision == "fp16" else None


class PlainUpdater:
    """Clip and step with no skipping: a NaN here reaches the weights (use the guard)."""

    def __init__(
        self,
        cfg: TrainConfig,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None,
    ) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer, self.scaler, self.max_norm = optimizer, scaler, cfg.optim.grad_clip

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, loss: torch.Tensor, step: int) -> dict[str, torch.Tensor]:
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_norm or float("inf"))
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss, "grad_norm": norm}

    def read(self, outcome: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {k: float(v) for k, v in outcome.items()}  # sync: log step only

    def totals(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict() if self.scaler else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


def build_updater(
    cfg: TrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer, info: DistInfo
) -> Updater:
    """The guarded updater unless `--guard.enabled False`."""
    scaler = _make_scaler(cfg, info.device)
    return PlainUpdater(cfg, model, optimizer, scaler)
