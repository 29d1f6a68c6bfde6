"""The training loop: `setup` builds a `Run`, `train` runs it end to end.

`train` reads as the recipe: setup, maybe resume, warm up, then evaluate / snapshot /
`train_step` / log until the last step. The step itself is in `step.py`, usable on its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import signal
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from isotrain.autograd import bf16_linear_layers, quantize_linear_layers
from isotrain.checkpointing import apply_activation_checkpointing
from isotrain.compile import compile_counters, compile_model, no_recompiles, warmup
from isotrain.contexts import flush_subnormals, rng_isolated
from isotrain.train import watch
from isotrain.train.config import ConfigError, TrainConfig
from isotrain.train.data import batches as data_mod
from isotrain.train.environment import gib, memory_for, require_memory
from isotrain.train.inputs import load_inputs
from isotrain.train.model.gpt import GPT, Block
from isotrain.train.model.memory import step_memory
from isotrain.train.model.sampling import prompt_from, sample
from isotrain.train.parallel import (
    DistInfo,
    LauncherWatch,
    any_rank,
    init_distributed,
    process_group_scope,
    wrap_model,
)
from isotrain.train.precision import resolve_precision
from isotrain.train.report.header import loss_line, precision_line, run_facts, settings_lines
from isotrain.train.report.loggers import MetricsWriter, write_config_file
from isotrain.train.report.progress import Reporter, where_and_next
from isotrain.train.rules import validate
from isotrain.train.rundir.lock import lock_run
from isotrain.train.rundir.resume import (
    StopFlag,
    StopNow,
    maybe_resume,
    stop_on_signals,
)
from isotrain.train.rundir.snapshot import find_snapshots
from isotrain.train.state import Batches, Run, TrainState, bucket_lengths
from isotrain.train.step import evaluate, precision_context, train_step
from isotrain.train.update.optim import build_optimizer
from isotrain.train.update.updater import build_updater
from isotrain.train.weights.load import build_model

__all__ = ["TrainingStopped", "prepare_model", "setup", "start", "train"]

log = logging.getLogger(__name__)
Origin = Mapping[str, str] | None  # dotted setting -> `--preset NAME`, `--config FILE`, `flag`

MODEL_SIZE = "--model.n-layer, --model.d-model or --model.vocab-size"
BATCH = "--data.batch-size or --model.block-size (raise --grad-accum to keep the tokens per step)"
STEP_SIZE = f"{BATCH}, or pass --checkpointing.policy full"


class TrainingStopped(Exception):
    """SIGINT or SIGTERM stopped training; a snapshot of `step` was written first."""

    def __init__(self, signum: int, step: int, out_dir: str, *, finished: bool = False) -> None:
        name = "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name
        super().__init__(
            f"{name}: the run finished at step {step} (snapshot and summary written); the "
            f"end-of-run sample was skipped, try isotrain sample {out_dir}"
            if finished
            else f"{name}: stopped at step {step} after writing its snapshot; run the same "
            f"command again to continue {out_dir}"
        )
        self.signum, self.step = signum, step


def setup(
    cfg: TrainConfig,
    *,
    lock: contextlib.ExitStack | None = None,
    origin: Origin = None,
    measure_precision: bool = True,
) -> Run:
    """Data, model (-> checkpointing -> compile -> DDP/FSDP), optimizer and update rule.

    With `lock`, the run directory's lock is taken first (before the tokenizer or anything
    else is written there) and held until that stack closes. Without `measure_precision`,
    a `--precision auto` that needs its probe leaves `run.cfg.precision` "auto" for `train`
    to measure after the header (the model is built alike: the probe runs only where bf16 is
    native, where `bf16_linear_layers` changes nothing).
    """
    validate(cfg)
    info = init_distributed(cfg.parallel.mode, cfg.device)
    if lock is not None:
        lock.enter_context(lock_run(cfg.out_dir, info))
    _fits(cfg, info)  # the shape as given: before a tokenizer is learned or weights are read
    shape = cfg.model
    cfg, corpus, tokenizer, init = load_inputs(cfg, is_main=info.is_main, origin=origin)
    if cfg.model != shape:  # --init-from's shape, the tokenizer's vocabulary
        _fits(cfg, info)
    cfg, precision = resolve_precision(cfg, info, measure_now=measure_precision)
    data_mod.require_length(corpus, cfg.model.block_size, info.world_size)
    batches = Batches.from_config(cfg, corpus, info)
    with memory_for("building the model", lower=MODEL_SIZE):
        model = build_model(cfg.model)
        if init is not None:  # fine-tuning: weights only; optimizer, schedule, guard start fresh
            model.load_state_dict(init.model.state_dict())
        model = model.to(info.device)
    example = batches.get("train", 0)[:2]
    train_model = prepare_model(cfg, model, info, example=example)
    optimizer = build_optimizer(model, cfg.optim)
    updater = build_updater(cfg, model, optimizer, info)
    _warn_short_warmup(cfg)
    run = Run(cfg, info, batches, model, train_model, optimizer, updater)
    run.tokenizer, run.precision_note = tokenizer, precision
    return run


def _fits(cfg: TrainConfig, info: DistInfo) -> None:
    """Refuse a shape whose training step cannot fit in this machine's memory, counted before
    anything is built (NOTE [step memory])."""
    ckpt = cfg.checkpointing.policy != "none"
    shards = info.world_size if cfg.parallel.mode == "fsdp" else 1
    need = step_memory(
        cfg.model, cfg.data.batch_size, checkpointed=ckpt, low_precision=cfg.precision != "fp32",
        shards=shards,
    )  # fmt: skip
    what = f"model and AdamW state {gib(need.state)}, activations {gib(need.activations)}"
    lower = [MODEL_SIZE] if 4 * need.state >= need.total else []  # what takes the memory
    lower += [BATCH if ckpt else STEP_SIZE] if 4 * need.activations >= need.total else []
    require_memory(need.total, info.device, what=what, lower=", or ".join(lower))


def _warn_short_warmup(cfg: TrainConfig) -> None:
    """A run no longer than its warm-up never reaches --optim.lr: say so, with the fix."""
    warm = cfg.optim.warmup_steps
    if cfg.steps < warm:
        log.warning(
            "--steps %d is less than --optim.warmup-steps %d: the learning rate only "
            "reaches %.1e of --optim.lr %g; try --optim.warmup-steps %d",
            cfg.steps,
            warm,
            cfg.optim.lr * cfg.steps / max(warm, 1),
            cfg.optim.lr,
            max(cfg.steps // 10, 1),
        )


def prepare_model(
    cfg: TrainConfig, model: GPT, info: DistInfo, *, example: tuple[torch.Tensor, ...]
) -> nn.Module:
    """QAT or CPU-bf16 layers, activation checkpointing, per-block compile, then DDP/FSDP.

    Each step changes `model` in place (state-dict keys stay clean); only the last one wraps.
    """
    if cfg.quant.bits:
        quantize_linear_layers(
            model, bits=cfg.quant.bits, activations=cfg.quant.activations, exclude=["lm_head"]
        )
    if cfg.precision in ("bf16", "bf16-matmul") and info.device.type == "cpu":
        bf16_linear_layers(model)  # fast operand layouts where the CPU lacks native bf16
    apply_activation_checkpointing(
        model, policy=cfg.checkpointing.policy, modules=(Block,), example_inputs=example
    )
    if cfg.compile.enabled:
        c = cfg.compile
        compile_model(
            model,
            mode=c.mode,
            regional=c.regional,
            backend=c.backend,
            dynamic=False if cfg.data.varlen else None,
        )
    return wrap_model(model, cfg.parallel.mode, info)


def _log(
    run: Run, reporter: Reporter, metrics: MetricsWriter, outcome: Any, dt: float, tokens: int
) -> None:
    """Read the step outcome (the one sync of a log step) and write it everywhere."""
    _write_skips(run, metrics)
    rec = run.updater.read(outcome)  # sync: log step only
    if run.cfg.compile.enabled:  # counted since warm-up: anything here is a mid-run compile
        c, base = compile_counters(), run.compile_base
        rec.update(
            compiles_after_warmup=c.compilations - base.compilations,
            recompiles_after_warmup=c.recompiles - base.recompiles,
            graph_breaks_after_warmup=c.graph_breaks - base.graph_breaks,
        )
    tps = tokens / max(dt, 1e-9)
    lr = run.optimizer.param_groups[0]["lr"]
    metrics.write(
        "train",
        step=run.state.step,
        lr=lr,
        tokens_per_s=tps,
        tokens_seen=run.state.tokens_seen,
        **rec,
    )
    reporter.progress(
        step=run.state.step,
        loss=rec["loss"],
        lr=lr,
        tokens_per_s=tps,
        skips=rec.get("skipped_total", 0),
    )


def _write_skips(run: Run, metrics: MetricsWriter) -> None:
    """One `skip` record per step skipped since the last call (log steps, snapshots)."""
    for step, reason in run.updater.drain_skips():  # sync: log steps and snapshots only
        metrics.write("skip", step=step, reason=reason)


def _evaluate_and_record(
    run: Run, reporter: Reporter, metrics: MetricsWriter, baseline: float
) -> None:
    val = evaluate(run)
    st = run.state
    st.last_val, st.best_val = val, min(st.best_val, val)
    run.eval_step = st.step
    bpb = _bits_per_byte(run, val=val, unigram_baseline=baseline)
    metrics.write("eval", step=st.step, val_loss=val, unigram_baseline=baseline, **bpb)
    reporter.line(f"eval step {st.step}: {loss_line(run, val, baseline)}")


def _bits_per_byte(run: Run, **losses: float) -> dict[str, float]:
    """Each loss per token as bits per byte of text (`NAME_bpb`), when the bytes are known."""
    out = {f"{k}_bpb": data_mod.bits_per_byte(v, run.batches.corpus) for k, v in losses.items()}
    return {k: v for k, v in out.items() if v is not None}


def start(
    cfg: TrainConfig,
    *,
    lock: contextlib.ExitStack | None = None,
    origin: Origin = None,
    measure_precision: bool = True,
) -> Run:
    """Setup (under `lock`; `origin` and `measure_precision`: see `setup`), then resume when
    the run directory holds a snapshot (or `--resume` asks)."""
    if cfg.resume is not None:
        cfg = dataclasses.replace(cfg, out_dir=cfg.resume)
    run = setup(cfg, lock=lock, origin=origin, measure_precision=measure_precision)
    has_snapshot = bool(find_snapshots(cfg.out_dir))
    if has_snapshot and not cfg.auto_resume and cfg.resume is None:
        raise ConfigError(
            f"--out-dir {cfg.out_dir} already holds a run; pass --resume {cfg.out_dir} to "
            "continue it, or choose another --out-dir"
        )
    if maybe_resume(run, required=cfg.resume is not None):
        run.updater.mark_good(run.state.step)  # rollback returns here, never to the fresh init
    return watch.start(run, lock)  # its monitor; under torchrun the ranks compared first


def train(cfg: TrainConfig, *, origin: Origin = None) -> TrainState:
    """Train end to end: setup or resume, warm up, then evaluate / snapshot / step / log.

    `origin` lets the header say where the settings came from, and `--init-from` warn only
    about the flags it overrides. SIGINT or SIGTERM: a snapshot, then `TrainingStopped`.
    """
    with (
        flush_subnormals(cfg.subnormals == "flush") as flushed,  # first: workers inherit it
        process_group_scope(),
        rng_isolated(seed=cfg.seed),
        stop_on_signals() as stop,
        contextlib.ExitStack() as held,
    ):
        run = start(cfg, lock=held, origin=origin, measure_precision=False)
        st, main = run.state, run.dist.is_main
        baseline = data_mod.unigram_entropy(run.batches.corpus)
        with Reporter(
            total_steps=cfg.steps, enabled=main, live=cfg.progress, start_step=st.step
        ) as reporter:
            facts = run_facts(run, st.step, precision=precision_line(run, origin), flushed=flushed)
            reporter.header([*facts, *settings_lines(origin or {})])
            _measure_precision(run, reporter, stop)
            cfg = run.cfg
            with contextlib.closing(_metrics(run)) as metrics:
                if cfg.compile.enabled:
                    _warm_up(run, reporter, metrics)
                with (
                    no_recompiles() if cfg.compile.fail_on_recompile else contextlib.nullcontext(),
                    memory_for("in a training step", lower=STEP_SIZE),
                ):
                    train_time, stopped = _loop(run, reporter, metrics, baseline, stop)
                reporter.stop()  # the bar ends here; what follows prints below it
                if stopped:
                    _write_skips(run, metrics)
                    watch.save(run)
                    raise TrainingStopped(stop.signal or 0, st.step, cfg.out_dir)
                _evaluate_and_record(run, reporter, metrics, baseline)
                _finish(run, reporter, metrics, baseline, train_time, stop)
        return st


def _measure_precision(run: Run, reporter: Reporter, stop: StopFlag) -> None:
    """`--precision auto`'s probe, once the header is out and the run directory checked: a
    line per round, bounded by --precision-probe-seconds, and a signal stops it at once
    (nothing is trained yet, so nothing is saved)."""
    if run.cfg.precision != "auto":
        return
    if stop:
        raise StopNow(stop.signal or signal.SIGINT)
    stop.urgent = True
    try:
        run.cfg, run.precision_note = resolve_precision(run.cfg, run.dist, progress=reporter.line)
    finally:
        stop.urgent = False
    reporter.line(f"precision  {run.precision_note}")


def _metrics(run: Run) -> MetricsWriter:
    """The run's loggers (rank 0), its config record, and OUT_DIR/config.toml."""
    cfg, main, out = run.cfg, run.dist.is_main, Path(run.cfg.out_dir)
    config = dataclasses.asdict(cfg)
    metrics = MetricsWriter(
        out,
        enabled=main,
        loggers=cfg.report.loggers,
        start_step=run.state.step,
        config=config,
        wandb_project=cfg.report.wandb_project,
    )
    try:
        metrics.write("config", step=run.state.step, config=config)
        if main:
            write_config_file(out, cfg)
    except BaseException:
        metrics.close()
        raise
    return metrics


def _loop(
    run: Run, reporter: Reporter, metrics: MetricsWriter, baseline: float, stop: Any
) -> tuple[float, bool]:
    """Steps until the end or a stop signal; returns training seconds and whether it stopped."""
    cfg, st = run.cfg, run.state
    first, timer, stopping = st.step, _Timer(st.tokens_seen), False
    clock, late, launcher = _SnapshotClock(cfg.snapshot.minutes), False, LauncherWatch()
    while st.step < cfg.steps and not stopping:
        eval_due = st.step % cfg.eval_every == 0
        every = cfg.snapshot.every
        snapshot_due = late or (eval_due if every is None else bool(every) and st.step % every == 0)
        if st.step != first and (eval_due or snapshot_due):
            with timer.paused():  # evaluation and snapshots stay out of tokens/s
                if eval_due:
                    _evaluate_and_record(run, reporter, metrics, baseline)
                if snapshot_due:
                    _write_skips(run, metrics)  # a crash after the snapshot keeps them
                    watch.save(run)
                    clock.reset()
        outcome = watch.after_step(run, train_step(run))  # Diverged if the ranks disagree
        if not stop and launcher.gone():  # torchrun's agent died: stop as for SIGTERM
            log.warning("the launcher (PID %s) exited: stopping with a snapshot", launcher.parent)
            stop.signal = signal.SIGTERM
        log_step = st.step % cfg.log_every == 0 or st.step == cfg.steps
        if log_step:
            _log(run, reporter, metrics, outcome, *timer.lap(st.tokens_seen))
        # Ranks must stop (and snapshot) at the same step, or their collectives never meet.
        if not run.dist.distributed:
            stopping, late = bool(stop), clock.due()
        elif log_step:
            stopping = any_rank(bool(stop), run.dist.device)  # sync: log steps only
            late = any_rank(clock.due(), run.dist.device)  # sync: log steps only
    return timer.total, stopping


class _SnapshotClock:
    """Wall time since the last snapshot, for `--snapshot.minutes` (0: never due)."""

    def __init__(self, minutes: float) -> None:
        self.period, self.last = minutes * 60.0, time.monotonic()

    def due(self) -> bool:
        return self.period > 0 and time.monotonic() - self.last >= self.period

    def reset(self) -> None:
        self.last = time.monotonic()


def _warm_up(run: Run, reporter: Reporter, metrics: MetricsWriter) -> None:
    """Compile every shape the run will see (train and eval) now, timed on its own."""
    cfg = run.cfg
    shapes = [
        (torch.zeros(cfg.data.batch_size, n, dtype=torch.long, device=run.dist.device),) * 2
        for n in bucket_lengths(cfg)
    ]
    with precision_context(cfg.precision, run.dist.device):
        stats = warmup(run.model, shapes, also_eval=True)
    run.compile_seconds, run.compile_base = stats.wall_seconds, compile_counters()
    metrics.write(
        "compile",
        step=run.state.step,
        seconds=stats.wall_seconds,
        compilations=stats.compilations,
        graph_breaks=stats.graph_breaks,
    )
    reporter.line(
        f"compiled {len(shapes)} shape(s) in {stats.wall_seconds:.1f} s "
        f"({stats.compilations} graphs, {stats.graph_breaks} graph breaks)"
    )


class _Timer:
    """Wall time of training steps only: evaluation and snapshots are paused out."""

    def __init__(self, tokens: int) -> None:
        self.last, self.tokens = time.perf_counter(), tokens
        self.excluded = self.total = 0.0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.excluded += time.perf_counter() - start

    def lap(self, tokens: int) -> tuple[float, int]:
        """Seconds of training and tokens since the last lap."""
        now = time.perf_counter()
        dt, n = now - self.last - self.excluded, tokens - self.tokens
        self.total += dt
        self.last, self.tokens, self.excluded = now, tokens, 0.0
        return dt, n


def _finish(
    run: Run,
    reporter: Reporter,
    metrics: MetricsWriter,
    baseline: float,
    train_time: float,
    stop: StopFlag,
) -> None:
    """Final snapshot, the summary, then a sample (a signal during it skips the rest of it)."""
    cfg, st = run.cfg, run.state
    watch.save(run)
    summary = _summary(run, baseline, train_time)
    metrics.write("summary", **summary)
    if cfg.sample_tokens and not stop:
        stop.urgent = True  # nothing is left to save: a signal stops the sample at once
        try:
            prompt = prompt_from(run.batches.corpus.val, run.tokenizer, seed=cfg.seed)
            text = sample(
                run.model, prompt, cfg.sample_tokens, tokenizer=run.tokenizer, seed=cfg.seed
            )
            reporter.line(
                "sample (prompt from the validation data, then the model):\n" + prompt + text
            )
        except StopNow:
            pass
        finally:
            stop.urgent = False
    reporter.ending(
        {k: f"{v:.4f}" if isinstance(v, float) else str(v) for k, v in summary.items()},
        where_and_next(cfg.out_dir, cfg.report.loggers),
    )
    if stop:
        raise TrainingStopped(stop.signal or 0, st.step, cfg.out_dir, finished=True)


def _summary(run: Run, baseline: float, train_time: float) -> dict[str, Any]:
    """The summary record of a finished run."""
    st = run.state
    summary = {
        "steps": st.step,
        "tokens_seen": st.tokens_seen,
        "val_loss": st.last_val,
        "best_val_loss": st.best_val,
        "unigram_baseline": baseline,
        **_bits_per_byte(
            run,
            val=math.nan if st.last_val is None else st.last_val,
            best_val=st.best_val,
            unigram_baseline=baseline,
        ),
        "tokenizer": run.tokenizer.describe(),
        "train_seconds": train_time,
        **run.updater.totals(),
    }
    if run.cfg.compile.enabled:
        summary["compile_seconds"] = run.compile_seconds
    return summary
