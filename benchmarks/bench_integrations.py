"""Step-time overhead of isotrain's integrations: GuardedTrainer vs Trainer, GuardCallback vs none.

The same small random-init GPT-2 (d 128, 2 layers, T 64, B 8, fp32, clip 1.0, linear LR
schedule) trained by the stock ``transformers.Trainer`` and by ``GuardedTrainer``, and by a
``lightning.Trainer`` with and without ``GuardCallback``. A round runs each of the four for
``--steps`` steps (order rotating) and takes the median time between consecutive steps after
the first few (forward, backward, optimizer, scheduler, logging every 10 steps: all of the
loop); the comparison is the per-round paired ratio guarded / plain, median and 95% interval.
Rounds continue until both ratios are within +-2% (``stats.Stopper``) or the round limit.

    python benchmarks/bench_integrations.py          # ~20 minutes on 2 busy cores
    python benchmarks/bench_integrations.py --quick  # seconds, a smoke run into a temp dir

Writes integrations.{md,json} into benchmarks/results/<cpu-kind>/. Checks: the guarded runs end
on the plain runs' weights bit for bit (fp32, no fault), and no step was skipped. The guard's
spike threshold is set so high that it never fires: the detector runs at full cost every step.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from common import (
    CLOCKS,
    add_common_args,
    check,
    checks_md,
    clock,
    default_clock,
    machine_line,
    out_dir,
    run_meta,
    steady_malloc,
    torch_threads,
    write_results,
)
from stats import Stopper, fmt_ci, half_width, paired_ratios, summarize

VARIANTS = ("hf", "hf+guard", "lightning", "lightning+guard")
PAIRS = {"hf+guard": "hf", "lightning+guard": "lightning"}
NEVER = 1e6  # spike_k: the detector runs, never fires
COLUMNS = ["framework", "variant", "ms/step (median)", "step time vs plain, paired [95% CI]",
           "CI half-width", "skipped"]  # fmt: skip


def _gpt(shape: dict[str, int]) -> Any:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=256, n_positions=shape["T"], n_embd=shape["d"], n_layer=shape["layers"],
        n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def _rows(shape: dict[str, int], steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (shape["T"],), generator=g) for _ in range(steps * shape["B"])]


class _Times:
    """Timestamps at each step's end; the median gap after `skip` steps is the step time."""

    def __init__(self, tick: Any, skip: int) -> None:
        self.tick, self.skip, self.at = tick, skip, []

    def mark(self) -> None:
        self.at.append(self.tick())

    def step_s(self) -> float:
        gaps = [b - a for a, b in zip(self.at, self.at[1:])][self.skip :]
        return statistics.median(gaps)


def run_hf(guarded: bool, shape: dict[str, int], steps: int, times: _Times) -> dict[str, Any]:
    import transformers

    from isotrain.integrations.transformers import GuardedTrainer

    class Mark(transformers.TrainerCallback):
        def on_step_end(self, *a: Any, **kw: Any) -> None:
            times.mark()

    model, data = _gpt(shape), [{"input_ids": r, "labels": r} for r in _rows(shape, steps)]
    with tempfile.TemporaryDirectory() as tmp:
        args = transformers.TrainingArguments(
            output_dir=tmp, max_steps=steps, per_device_train_batch_size=shape["B"],
            learning_rate=1e-3, warmup_steps=2, max_grad_norm=1.0, logging_steps=10,
            save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
            dataloader_num_workers=0, seed=0,
        )  # fmt: skip
        kw: dict[str, Any] = {"guard_options": {"spike_k": NEVER}} if guarded else {}
        cls = GuardedTrainer if guarded else transformers.Trainer
        trainer = cls(model=model, args=args, train_dataset=data, callbacks=[Mark()], **kw)
        trainer.remove_callback(transformers.PrinterCallback)
        trainer.train()
    skipped = trainer.optimizer.guard.summary()["skipped"] if guarded else 0
    return {"weights": [p.detach().clone() for p in model.parameters()], "skipped": skipped}


def run_lightning(
    guarded: bool, shape: dict[str, int], steps: int, times: _Times
) -> dict[str, Any]:
    import lightning.pytorch as pl

    from isotrain.integrations.lightning import GuardCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = _gpt(shape)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.gpt(input_ids=batch, labels=batch).loss

        def on_train_batch_end(self, *a: Any) -> None:
            times.mark()

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    module = Module()
    loader = torch.utils.data.DataLoader(torch.stack(_rows(shape, steps)), batch_size=shape["B"])
    callbacks = [GuardCallback(spike_k=NEVER)] if guarded else []
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, gradient_clip_val=1.0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        log_every_n_steps=10, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(module, loader)
    skipped = trainer.optimizers[0].guard.summary()["skipped"] if guarded else 0
    return {"weights": [p.detach().clone() for p in module.parameters()], "skipped": skipped}


def one(name: str, shape: dict[str, int], steps: int, tick: Any) -> tuple[float, dict[str, Any]]:
    times = _Times(tick, skip=min(5, steps // 3))
    run = run_hf if name.startswith("hf") else run_lightning
    out = run(name.endswith("+guard"), shape, steps, times)
    return times.step_s(), out


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--steps", type=int, default=30, help="steps per run (one run per round)")
    p.add_argument("--min-rounds", type=int, default=12)
    p.add_argument("--max-rounds", type=int, default=36)
    p.add_argument("--clock", choices=["cpu", "wall"], default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.min_rounds, args.max_rounds = 8, 2, 2
    return args


def measure(args: argparse.Namespace) -> dict[str, Any]:
    shape = {"d": 32, "layers": 1, "T": 16, "B": 2} if args.quick else {
        "d": 128, "layers": 2, "T": 64, "B": 8}  # fmt: skip
    tick = clock(args.clock or default_clock("cpu", args.threads))
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    equal, skipped = True, 0

    def ratios() -> dict[str, list[float]]:
        return {g: paired_ratios({"p": times[p], "g": times[g]}, "p", speed=False)["g"]
                for g, p in PAIRS.items()}  # fmt: skip

    stop = Stopper(ratios, min_rounds=args.min_rounds, max_rounds=args.max_rounds, check_every=2)
    rounds = 0
    while not stop(rounds):
        order = VARIANTS[rounds % 4 :] + VARIANTS[: rounds % 4]
        outs = {}
        for name in order:
            t, outs[name] = one(name, shape, args.steps, tick)
            times[name].append(t)
        for g, p in PAIRS.items():
            equal &= all(torch.equal(a, b) for a, b in zip(outs[g]["weights"], outs[p]["weights"]))
            skipped += outs[g]["skipped"]
        rounds += 1
    return {"shape": shape, "times": times, "ratios": ratios(), "equal": equal,
            "skipped": skipped, "stop": stop.record(rounds)}  # fmt: skip


def markdown(res: dict[str, Any]) -> str:
    m, shape = res["measured"], res["measured"]["shape"]
    lines = [
        "# Integrations: step time with and without the guard, inside each framework's trainer",
        "",
        f"Command: `{res['meta']['command']}`",
        "",
        f"Machine: {machine_line(res['meta'])}",
        "",
        f"Model: GPT-2, d {shape['d']}, {shape['layers']} layers, T {shape['T']}, B {shape['B']},"
        f" fp32, clip 1.0, AdamW. Clock: {CLOCKS[res['args']['clock'] or 'cpu']}. "
        f"{m['stop']['rounds']} rounds ({m['stop']['reason']}).",
        "",
        "Other work on the machine shows in the load average above: the per-round pairing and the "
        "CPU-time clock keep the ratio, not the absolute ms, reliable.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for name in VARIANTS:
        fw, guarded = name.split("+")[0], name.endswith("+guard")
        ms = 1e3 * statistics.median(res["measured"]["times"][name])
        ratio, width = "1 (reference)", "-"
        if guarded:
            s = summarize(m["ratios"][name])
            ratio, width = fmt_ci(s), f"+-{100 * half_width(s):.1f}%"
        variant = ("GuardedTrainer" if fw == "hf" else "GuardCallback()") if guarded else "plain"
        skip = str(m["skipped"]) if guarded else "-"
        lines.append(f"| {fw} | {variant} | {ms:.2f} | {ratio} | {width} | {skip} |")
    return "\n".join([*lines, "", *checks_md(res["checks"])])


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = out_dir(args)
    load_before = os.getloadavg()[0]
    import transformers

    log = logging.getLogger("lightning.pytorch")
    level, verbosity = log.level, transformers.logging.get_verbosity()
    log.setLevel(logging.ERROR)  # the frameworks' banners, per run
    transformers.logging.set_verbosity_error()
    try:
        with torch_threads(args.threads), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the frameworks' notes on this toy setup
            measured = measure(args)
            meta = run_meta("bench_integrations.py", argv, load_before)
    finally:
        log.setLevel(level)
        transformers.logging.set_verbosity(verbosity)
    res = {
        "meta": meta,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "measured": measured,
        "checks": {
            "equal weights": check(measured["equal"], "guarded == plain, bit for bit, every round"),
            "no skipped steps": check(measured["skipped"] == 0, f"{measured['skipped']} skipped"),
        },
    }
    return write_results(out, "integrations", res, markdown(res))


if __name__ == "__main__":
    steady_malloc()
    raise SystemExit(main())
