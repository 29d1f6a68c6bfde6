"""The run header: what a run is (model, data, tokenizer, device, precision, steps, run
directory) and where its settings came from, in lines that fit a terminal."""

from __future__ import annotations

import collections
from collections.abc import Mapping

import torch

from isotrain.train.config import flag
from isotrain.train.data import batches as data_mod
from isotrain.train.precision.capability import forced_kind_note
from isotrain.train.state import Run

__all__ = ["loss_line", "precision_line", "run_facts", "settings_lines"]


def run_facts(run: Run, first: int, *, precision: str, flushed: bool) -> list[str]:
    """The run header: model, data, device (with subnormal flushing on a CPU; the CPU kind when
    ISOTRAIN_CPU_KIND forces it), precision (as the caller describes it: the setting, or what
    auto chose and why), run directory."""
    cfg, m = run.cfg, run.cfg.model
    params = run.model.num_params()
    where = f"resumed at step {first}" if first else "new run"
    if cfg.init_from and not first:
        where += f", weights from --init-from {cfg.init_from}"
    dev = run.dist.device
    threads = ""
    if dev.type == "cpu":
        asked = cfg.subnormals == "flush"
        how = "flushed to zero" if flushed else "kept"
        why = " (this CPU cannot flush them)" if asked and not flushed else ""
        n = torch.get_num_threads()
        threads = f", {n} thread{'s' if n != 1 else ''}, subnormals {how}{why}"
    world = f", {run.dist.world_size} ranks ({cfg.parallel.mode})" if run.dist.distributed else ""
    forced = forced_kind_note() if dev.type == "cpu" else ""
    return [
        f"model      {params / 1e6:.2f}M parameters: {m.n_layer} layers, d_model {m.d_model}, "
        f"{m.n_head} heads, context {m.block_size}",
        f"data       {run.batches.corpus.describe()}",
        f"tokenizer  {run.tokenizer.describe()}",
        f"device     {dev}{threads}{world}",
        *([f"cpu kind   {forced}"] if forced else []),
        f"precision  {precision}",
        f"steps      {cfg.steps}, batch {cfg.data.batch_size} x {cfg.grad_accum}, "
        f"eval every {cfg.eval_every}, log every {cfg.log_every}",
        f"run dir    {cfg.out_dir} ({where})",
    ]


def settings_lines(origin: Mapping[str, str]) -> list[str]:
    """`settings   --preset smoke (16), --config FILE (2), flags --steps --out-dir`."""
    counts = collections.Counter(v for v in origin.values() if v != "flag")
    parts = [f"{source} ({n})" for source, n in counts.items()]
    flags = [flag(k) for k, v in origin.items() if v == "flag"]
    parts += [f"flags {' '.join(flags)}"] if flags else []
    return [f"settings   {', '.join(parts)}"] if parts else []


def loss_line(run: Run, val: float, baseline: float) -> str:
    """Validation loss (per token, and in bits per byte when known) beside the unigram
    baseline to beat, in one line that fits 80 columns."""
    unit = "nats/byte" if run.tokenizer.kind == "bytes" else "nats/token"
    bpb = data_mod.bits_per_byte(val, run.batches.corpus)
    in_bits = "" if bpb is None else f" ({bpb:.4f} bits/byte)"
    return f"val loss {val:.4f} {unit}{in_bits}, unigram {baseline:.4f}"


def precision_line(run: Run, origin: Mapping[str, str] | None) -> str:
    """The header's precision: the setting and where it came from, or what auto chose (or is
    about to measure) and why."""
    precision = run.cfg.precision
    if precision != "auto" and origin and origin.get("precision", "flag") != "flag":
        return f"{precision} ({origin['precision']})"  # not a flag they passed
    return run.precision_note or precision
