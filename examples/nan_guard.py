"""A training loop that survives NaN and Inf: guarded steps, no host syncs, rollback.

We inject faults on purpose: a NaN loss at a few fixed steps, a burst of NaN losses (a run
"going bad"), and an Inf in one random gradient element now and then. ``StepGuard`` decides
on the device whether each step is finite (and not a loss/gradient spike) and applies or skips
the update without a host-device sync; the outcome of each step stays on the device until a
log step reads a whole window of them at once. After ``patience`` consecutive skips,
``Rollback`` restores the last good weights and cools the learning rate down.

    python examples/nan_guard.py --skip-mode select --forbid-syncs   # the accelerator path
    python examples/nan_guard.py --smoke

Measured once on 2 CPU cores shared with other jobs (Intel Xeon): the full run (1000 steps, a
progress line every 50) took 32 s of CPU time, 109 s wall; 55 steps skipped (8 NaN losses,
47 Inf gradients), 1 rollback, validation MSE 0.0033, parameters finite throughout.

Patterns: ``StepGuard`` (isotrain.guard), ``FaultInjector``, ``Rollback`` and
``forbid_host_sync`` (isotrain.testing), ``eval_mode`` (isotrain.contexts).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

from isotrain.contexts import eval_mode
from isotrain.guard import FaultInjector, Rollback, SkipReason, StepGuard
from isotrain.testing import forbid_host_sync


def batch(gen: torch.Generator, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.rand(n, 1, generator=gen) * 2 * math.pi
    return x, torch.sin(3 * x) + 0.5 * torch.cos(x)  # a wiggly 1-D regression target


def params_finite(model: nn.Module) -> bool:
    return bool(torch.stack([p.isfinite().all() for p in model.parameters()]).all())  # sync


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="a few seconds on CPU")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--skip-mode", default="auto", choices=["auto", "select", "host"])
    p.add_argument("--forbid-syncs", action="store_true", help="raise on any host sync in the step")
    args = p.parse_args(argv)
    steps, log_every = (60, 10) if args.smoke else (args.steps, 50)

    torch.manual_seed(0)
    width = 64
    model = nn.Sequential(
        nn.Linear(1, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1)
    )
    base_lr = 1e-2
    opt = torch.optim.AdamW(model.parameters(), lr=base_lr)
    guard = StepGuard(opt, model, max_norm=1.0, spike_window=32, spike_min_samples=8,
                      skip_mode=args.skip_mode)  # fmt: skip
    if args.forbid_syncs:
        guard.sync_check = forbid_host_sync  # any .item()/bool() inside the step now raises
    rollback = Rollback(model, opt, every=10, patience=4, max_rollbacks=3, cooldown_steps=10)
    burst = range(log_every * 3 - 6, log_every * 3)  # 6 bad steps in a row: beyond patience
    faults = [
        FaultInjector(at_steps=[3, 17, *burst], kind="nan", target="loss"),
        FaultInjector(probability=0.05, kind="inf", target="grad", seed=1),
    ]
    gen = torch.Generator().manual_seed(0)
    outcomes, window_start = [], 0
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = base_lr * rollback.lr_factor(step)  # 1.0 unless just rolled back
        x, y = batch(gen)
        loss = faults[0].corrupt_loss(F.mse_loss(model(x), y), step)
        loss.backward()
        faults[1].corrupt_grads(model, step)  # one element of one gradient becomes Inf
        outcomes.append(guard.step(loss.detach()))  # device tensors only: nothing waits here

        if (step + 1) % log_every == 0:
            # The log step: one host read for the window's outcomes, one for the counters.
            window = torch.stack([torch.stack([o.applied.long(), o.reason]) for o in outcomes])
            for i, (applied, reason) in enumerate(window.tolist()):  # sync: log step
                if not applied:
                    print(f"  step {window_start + i:4d}: skipped ({SkipReason(reason).name})")
            s = guard.summary()
            print(f"step {step:4d}  loss {s['last_loss']:.4f}  applied {s['applied']}/"
                  f"{s['steps']}  params finite: {params_finite(model)}")  # fmt: skip
            action = rollback.check(step, guard)  # snapshot if healthy, restore if stuck
            if action is not None:
                print(f"  rollback #{action.rollbacks} to step {action.restored_step}; "
                      f"LR cooled down until step {action.cooldown_until}")  # fmt: skip
            outcomes, window_start = [], step + 1

    with eval_mode(model) as m:
        x, y = batch(torch.Generator().manual_seed(123), 512)
        val = F.mse_loss(m(x), y).item()
    s = guard.summary()
    print(f"done: {s['applied']} applied, {s['skipped']} skipped {s['skipped_by_reason']}, "
          f"{rollback.rollbacks} rollbacks, val mse {val:.4f}, "
          f"params finite: {params_finite(model)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
