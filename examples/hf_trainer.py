"""Hugging Face Trainer with isotrain's guard: a NaN gradient at a known step is skipped.

A tiny random-init GPT-2 learns to count (token t+1 follows token t, mod 32) with the stock
``transformers.Trainer`` loop. At step ``--nan-at`` one gradient turns NaN. ``GuardedTrainer``
(the only line that changes) skips that optimizer step: weights, AdamW moments and the LR
schedule stay as they were, and the log line says ``skipped_steps 1 (NONFINITE_GRAD)``. The same
run with the plain ``Trainer`` ends with NaN weights. Evaluation, four times, runs isolated
(``eval_mode`` + ``rng_isolated``), so it does not change the training run.

    python examples/hf_trainer.py            # 300 steps, guarded then plain; measured
                                             # 67 s on 2 cores shared with other jobs (load 11)
    python examples/hf_trainer.py --smoke

Patterns: ``GuardedTrainer`` (isotrain.integrations.transformers) over ``GuardedOptimizer`` /
``StepGuard`` (isotrain.guard), ``eval_mode`` and ``rng_isolated`` (isotrain.contexts).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import warnings
from typing import Any

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from isotrain.integrations.transformers import GuardedTrainer


def counting(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Sequences start, start+1, ... (mod 32): the model has to learn "next = this + 1"."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 32, (n, 1), generator=g)
    rows = (starts + torch.arange(16)) % 32
    return [{"input_ids": r, "labels": r} for r in rows]


class NaNAt(transformers.TrainerCallback):
    """Make the gradient of the output layer NaN during optimizer step `step` (1-based)."""

    def __init__(self, model: GPT2LMHeadModel, step: int) -> None:
        self.step, self.armed = step, False
        model.lm_head.weight.register_hook(lambda g: g * math.nan if self.armed else g)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.armed = state.global_step + 1 == self.step


def finite(model: torch.nn.Module) -> bool:
    return all(bool(p.isfinite().all()) for p in model.parameters())


def run(trainer_cls: type, steps: int, nan_at: int, out_dir: str) -> Any:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=32, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(cfg)
    args = TrainingArguments(
        output_dir=out_dir, max_steps=steps, per_device_train_batch_size=16, learning_rate=3e-3,
        warmup_steps=steps // 10, max_grad_norm=1.0, logging_steps=1, eval_strategy="steps",
        eval_steps=steps // 4, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0, seed=0,
    )  # fmt: skip
    trainer = trainer_cls(
        model=model, args=args, train_dataset=counting(4096, 0), eval_dataset=counting(64, 1),
        callbacks=[NaNAt(model, nan_at)],
    )  # fmt: skip
    trainer.remove_callback(transformers.PrinterCallback)  # we print the lines we want below
    trainer.train()
    return trainer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="a few seconds on CPU")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--nan-at", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (tiny model: 1)")
    args = p.parse_args(argv)
    steps = 12 if args.smoke else args.steps
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)  # two threads on a model this small only spin-wait
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Trainer's notes on this toy setup
            trainer = run(GuardedTrainer, steps, args.nan_at, tmp)
            plain = run(transformers.Trainer, steps, args.nan_at, tmp)
    finally:
        transformers.logging.set_verbosity(verbosity)
        torch.set_num_threads(threads)
    logs = [h for h in trainer.state.log_history if "skipped_steps" in h]
    for h in logs:
        if h["step"] in (1, args.nan_at - 1, args.nan_at, args.nan_at + 1, steps):
            print(f"step {h['step']:3d}  loss {h['loss']:.4f}  lr {h['learning_rate']:.6f}  "
                  f"grad_norm {h['grad_norm']:.4f}  skipped_steps {h['skipped_steps']} "
                  f"({h['skip_reason']})")  # fmt: skip
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    s = trainer.optimizer.guard.summary()
    print(f"GuardedTrainer: {s['applied']}/{s['steps']} steps applied, skipped "
          f"{s['skipped_by_reason']}, eval loss {evals[0]:.4f} -> {evals[-1]:.4f}, "
          f"params finite: {finite(trainer.model)}")  # fmt: skip
    print(f"plain Trainer with the same NaN: params finite: {finite(plain.model)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
