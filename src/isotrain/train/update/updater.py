"""How a step's gradients become a weight update: loss scaling, clipping, the guard, the step.

Two implementations behind one small interface: `GuardedUpdater` (isotrain.guard, the default)
and `PlainUpdater` (clip and step, what most loops do). Both keep every value on the device
until `read` is called at a log step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from isotrain.guard import (
    FaultInjector,
    Rollback,
    RollbackAction,
    SkipReason,
    StepGuard,
    StepOutcome,
)
from isotrain.train.config import TrainConfig
from isotrain.train.parallel import DistInfo, all_reduce_mean
from isotrain.train.state import Updater

__all__ = ["GuardedUpdater", "PlainUpdater", "SkipLog", "build_updater"]


def _make_scaler(cfg: TrainConfig, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 needs loss scaling; fp32 and bf16 do not."""
    return torch.amp.GradScaler(device.type) if cfg.precision == "fp16" else None


class SkipLog:
    """Every step's skip reason, kept as the device tensor the guard returned and read all
    at once (`drain`, one sync) at a log step, so each skip becomes a record by its step."""

    FOLD = 1024  # unread reasons are concatenated in blocks: bounded list, no op per step

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.blocks: list[torch.Tensor] = []
        self.recent: list[torch.Tensor] = []

    def add(self, step: int, reason: torch.Tensor) -> None:
        """Remember step `step`'s reason (a 0-d int tensor, `SkipReason` codes)."""
        self.steps.append(step)
        self.recent.append(reason)
        if len(self.recent) == self.FOLD:
            self.blocks.append(torch.stack(self.recent))
            self.recent = []

    def drain(self) -> list[tuple[int, str]]:
        """(step, reason name) of each skipped step since the last drain, in step order."""
        if not self.steps:
            return []
        recent = [torch.stack(self.recent)] if self.recent else []
        codes = torch.cat(self.blocks + recent).tolist()  # sync: log steps only
        out = [(s, SkipReason(c).name) for s, c in zip(self.steps, codes) if c]
        self.steps, self.blocks, self.recent = [], [], []
        return out


class PlainUpdater:
    """Clip and step with no skipping: a NaN here reaches the weights (`--guard.no-enabled`;
    with `--guard.inject-nan-at` it shows what the guard prevents)."""

    def __init__(
        self,
        cfg: TrainConfig,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None,
    ) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer, self.scaler, self.max_norm = optimizer, scaler, cfg.optim.grad_clip
        steps = cfg.guard.inject_nan_at
        self.inject = FaultInjector(at_steps=steps) if steps else None
        self.skips = SkipLog()

    def backward(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """Backward of the (scaled) loss; returns the loss as used, faults injected included."""
        if self.inject is not None:
            loss = self.inject.corrupt_loss(loss, step + 1)  # steps as numbered in the logs
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        return loss

    def step(self, loss: torch.Tensor, step: int) -> Any:
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_norm or float("inf"))
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss.detach(), "grad_norm": norm}

    def read(self, outcome: Any) -> dict[str, Any]:
        # mean over ranks (all ranks log at the same steps); an FSDP DTensor gives its full value
        return {k: float(all_reduce_mean(v)) for k, v in outcome.items()}  # sync: log step only

    def drain_skips(self) -> list[tuple[int, str]]:
        """(step, reason) of each step skipped since the last call (reads the device once)."""
        return self.skips.drain()

    def lr_factor(self, step: int) -> float:
        return 1.0

    def recover(self, step: int) -> Any:
        """No recovery without the guard: nothing was skipped."""

    def mark_good(self, step: int) -> None:
        """Nothing to remember without a rollback."""

    def totals(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict() if self.scaler else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


class GuardedUpdater(PlainUpdater):
    """isotrain.guard's StepGuard: non-finite or spiking steps are skipped on the device.

    With `--guard.rollback-after N`, a Rollback restores the last good weights once N
    consecutive steps were skipped. `recover` decides, every `--guard.rollback-check-every`
    steps (a cadence of its own: logging never changes training).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None,
        info: DistInfo,
    ) -> None:
        super().__init__(cfg, model, optimizer, scaler)
        g = cfg.guard
        self.guard = StepGuard(
            optimizer,
            model,
            max_norm=cfg.optim.grad_clip or None,
            scaler=scaler,
            spike_k=g.spike_k or None,
            spike_window=g.spike_window,
            spike_min_samples=min(16, g.spike_window),
            protect_buffers=True,  # a skipped step leaves buffers as before its forward
        )
        self.rollback = (
            Rollback(model, optimizer, every=g.rollback_copy_every, patience=g.rollback_after)
            if g.rollback_after
            else None
        )
        self.check_every = g.rollback_check_every
        self.last_action: RollbackAction | None = None

    def step(self, loss: torch.Tensor, step: int) -> StepOutcome:
        outcome = self.guard.step(loss)
        self.skips.add(step + 1, outcome.reason)  # numbered as in the logs, from 1
        return outcome

    def read(self, outcome: StepOutcome) -> dict[str, Any]:
        rec = outcome.to_dict()  # sync: log step only
        s = self.guard.summary()
        rec.update(skipped_total=s["skipped"], skipped_by_reason=s["skipped_by_reason"])
        if self.rollback is not None:
            rec["rollbacks"] = self.rollback.rollbacks
            if self.last_action is not None:
                rec["rolled_back_to"] = self.last_action.restored_step
        return rec

    def recover(self, step: int) -> RollbackAction | None:
        """Every `check_every` steps: roll back after `rollback_after` consecutive skips."""
        if self.rollback is None or (step + 1) % self.check_every:
            return None
        action = self.rollback.check(step + 1, self.guard)  # sync: its own cadence
        if action is not None:
            self.last_action = action
        return action

    def mark_good(self, step: int) -> None:
        """Take the last good copy now (after a resume: the loaded weights)."""
        if self.rollback is not None:
            applied = self.guard.summary()["applied"]  # sync: once, at resume
            self.rollback.snapshot(step=step, applied=applied)

    def lr_factor(self, step: int) -> float:
        return self.rollback.lr_factor(step) if self.rollback is not None else 1.0

    def totals(self) -> dict[str, Any]:
        s = self.guard.summary()  # sync: end of run
        return {
            "applied_steps": s["applied"],
            "skipped_steps": s["skipped"],
            **{f"skipped_{k.lower()}": v for k, v in s["skipped_by_reason"].items() if v},
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "guard": self.guard.state_dict(),
            "rollback": self.rollback.state_dict() if self.rollback else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.guard.load_state_dict(state["guard"])
        if self.rollback and state.get("rollback"):
            self.rollback.load_state_dict(state["rollback"])


def build_updater(
    cfg: TrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer, info: DistInfo
) -> Updater:
    """The guarded updater unless `--guard.no-enabled`."""
    scaler = _make_scaler(cfg, info.device)
    if cfg.guard.enabled:
        return GuardedUpdater(cfg, model, optimizer, scaler, info)
    return PlainUpdater(cfg, model, optimizer, scaler)
