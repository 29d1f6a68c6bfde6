"""Lightning Trainer with isotrain's guard: a NaN gradient at a known step is skipped.

A small MLP fits a wiggly 1-D curve with the stock ``lightning.Trainer`` loop (automatic
optimization, an LR schedule stepped per batch, ``gradient_clip_val=1.0``). At step ``--nan-at``
one gradient turns NaN. ``GuardCallback()`` (the only line that changes) skips that optimizer
step: weights, AdamW moments and the LR stay as they were, and the logged ``skipped_steps`` and
``skip_reason`` say so. The same run without it ends with NaN weights. Validation during training
runs isolated (``eval_mode`` + ``rng_isolated``), so it does not change the training run.

    python examples/lightning_trainer.py     # 400 steps, guarded then plain; measured
                                             # 45 s on 2 cores shared with other jobs (load 11)
    python examples/lightning_trainer.py --smoke

Patterns: ``GuardCallback`` (isotrain.integrations.lightning) over ``GuardedOptimizer`` /
``StepGuard`` (isotrain.guard), ``eval_mode`` and ``rng_isolated`` (isotrain.contexts).
"""

from __future__ import annotations

import argparse
import logging
import math
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from isotrain.guard import SkipReason
from isotrain.integrations.lightning import GuardCallback


class Curve(pl.LightningModule):
    def __init__(self, steps: int, nan_at: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Dropout(0.05), nn.Linear(64, 1))
        self.steps, self.nan_at, self.lines = steps, nan_at, []
        self.net[-1].weight.register_hook(lambda g: g * math.nan if self.armed() else g)

    def armed(self) -> bool:
        return self.trainer.global_step + 1 == self.nan_at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_mse", F.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=self.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        m, step = self.trainer.callback_metrics, self.trainer.global_step
        if "skipped_steps" in m and step in (1, self.nan_at - 1, self.nan_at, self.nan_at + 1):
            lr = self.trainer.optimizers[0].param_groups[0]["lr"]
            self.lines.append(f"step {step:3d}  loss {float(outputs['loss']):.4f}  lr {lr:.6f}  "
                              f"skipped_steps {int(m['skipped_steps'])} "
                              f"({SkipReason(int(m['skip_reason'])).name})")  # fmt: skip


def curve(n: int, seed: int) -> Any:
    x = torch.rand(n, 1, generator=torch.Generator().manual_seed(seed)) * 2 * math.pi
    data = torch.utils.data.TensorDataset(x, torch.sin(3 * x) + 0.5 * torch.cos(x))
    return torch.utils.data.DataLoader(data, batch_size=64, shuffle=seed == 0)


def fit(guarded: bool, steps: int, nan_at: int) -> tuple[pl.Trainer, Curve]:
    module = Curve(steps, nan_at)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, gradient_clip_val=1.0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        val_check_interval=steps // 4, check_val_every_n_epoch=None, num_sanity_val_steps=0,
        log_every_n_steps=1,  # a log line per step, to show each; the default 50 is cheaper
        callbacks=[GuardCallback()] if guarded else [],
    )  # fmt: skip
    trainer.fit(module, curve(64 * steps, 0), curve(256, 1))
    return trainer, module


def finite(module: nn.Module) -> bool:
    return all(bool(p.isfinite().all()) for p in module.parameters())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="a few seconds on CPU")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--nan-at", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (tiny model: 1)")
    args = p.parse_args(argv)
    steps = 12 if args.smoke else args.steps
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)  # two threads on a model this small only spin-wait
    log, level = (
        logging.getLogger("lightning.pytorch"),
        logging.getLogger("lightning.pytorch").level,
    )
    log.setLevel(logging.ERROR)  # Lightning's banner lines
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's notes on this toy setup
            trainer, module = fit(True, steps, args.nan_at)
            _, plain = fit(False, steps, args.nan_at)
    finally:
        log.setLevel(level)
        torch.set_num_threads(threads)
    print("\n".join(module.lines))
    s = trainer.optimizers[0].guard.summary()
    print(f"GuardCallback: {s['applied']}/{s['steps']} steps applied, skipped "
          f"{s['skipped_by_reason']}, val mse {float(trainer.callback_metrics['val_mse']):.4f}, "
          f"params finite: {finite(module)}")  # fmt: skip
    print(f"plain Lightning with the same NaN: params finite: {finite(plain)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
