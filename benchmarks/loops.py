"""The training loops the trainer benchmarks compare, and the interleaved rounds that time them.

Every loop trains isotrain.train.model.gpt.GPT from the same seed on the same batches
(isotrain.train.data.batches.get_batch at the same step indices), with the trainer's AdamW parameter
groups, LR schedule and clip norm 1.0:

    plain       a tuned hand-written loop: parameter list kept, fused AdamW,
                zero_grad(set_to_none=True). The reference of every "vs plain" figure.
    nanogpt     the loop as nanoGPT's train.py writes it: clip_grad_norm_(model.parameters())
                (a walk of the module tree every step), a GradScaler that is off unless fp16,
                the loss divided by the accumulation steps, and AdamW fused only on CUDA
    isotrain    isotrain.train.loop.setup(cfg) once, then train_step(run): guard and contexts on
    isotrain-noguard   the same with --guard.no-enabled: separates the guard from the step
    fabric      the plain loop through lightning.fabric.Fabric
    accelerate  the plain loop through accelerate.Accelerator

The guard's spike threshold is set so high (SPIKE_K) that it never fires: the detector runs at
full cost every step, but no timed step is skipped (a skipped update is cheaper, and would
flatter the guard). Each benchmark checks that no step was skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from isotrain.contexts import autocast_if_available, eval_mode
from isotrain.train.config import (
    CheckpointingConfig,
    CompileConfig,
    DataConfig,
    GuardConfig,
    ModelConfig,
    TrainConfig,
)
from isotrain.train.data import batches as data_mod
from isotrain.train.loop import setup
from isotrain.train.step import train_step
from isotrain.train.update.optim import build_optimizer, lr_at
from isotrain.train.weights.load import build_model

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
REFERENCE = "the tuned plain loop"  # what "plain" is, in every result file and picture
# Results made before the tuned loop existed have no "reference": their `plain` was nanoGPT's.
EARLIER_REFERENCE = "`plain` of that run (a nanoGPT-style loop)"
SPIKE_K = 1e6  # the detector's work is the same for any k; this k never fires on real data


@dataclass(frozen=True)
class Shape:
    """Model and batch shape shared by every variant of one comparison."""

    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    block_size: int = 256
    batch_size: int = 16
    dropout: float = 0.0

    @property
    def tokens(self) -> int:
        """Tokens per optimizer step."""
        return self.block_size * self.batch_size

    def label(self) -> str:
        return (
            f"{self.n_layer} layers, d {self.d_model}, {self.n_head} heads, "
            f"T {self.block_size}, B {self.batch_size}"
        )


TINY = Shape()  # the `tiny` preset
SMALL = Shape(n_layer=6, n_head=6, d_model=384, block_size=256, batch_size=16, dropout=0.1)
PROBE = Shape(n_layer=1, n_head=1, d_model=16, block_size=16, batch_size=2)
QUICK = Shape(n_layer=2, n_head=2, d_model=32, block_size=32, batch_size=4)


def train_config(
    shape: Shape,
    *,
    device: str = "cpu",
    precision: str = "fp32",
    guard: bool = True,
    compile_backend: str | None = None,
    checkpointing: str = "none",
) -> TrainConfig:
    """The TrainConfig every variant reads (the baselines use its model, optim and data)."""
    return TrainConfig(
        model=ModelConfig(
            n_layer=shape.n_layer,
            n_head=shape.n_head,
            d_model=shape.d_model,
            block_size=shape.block_size,
            dropout=shape.dropout,
        ),
        data=DataConfig(batch_size=shape.batch_size, max_bytes=1_000_000),
        guard=GuardConfig(enabled=guard, spike_k=SPIKE_K),
        compile=CompileConfig(enabled=compile_backend is not None, backend=compile_backend or ""),
        checkpointing=CheckpointingConfig(policy=checkpointing),
        steps=100_000,  # only the LR schedule reads it: the same for every variant
        device=device,
        precision=precision,  # type: ignore[arg-type]
        progress=False,
        sample_tokens=0,
    )


# ------------------------------------------------------------------------------------ variants
class Variant:
    """One training setup: `step()` runs one optimizer step; `sync()` waits for the device."""

    name = "?"

    def __init__(self, cfg: TrainConfig, corpus: data_mod.Corpus | None) -> None:
        self.cfg, self.corpus, self.i = cfg, corpus, 0
        self.device = torch.device(cfg.device)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # sync: timing boundary

    def batch(self, step: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        x, y = data_mod.get_batch(
            self.corpus.train,  # type: ignore[union-attr]
            batch_size=c.data.batch_size,
            block_size=c.model.block_size,
            seed=c.seed,
            step=self.i if step is None else step,
        )
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.cfg.precision == "fp32":
            return contextlib.nullcontext()
        if self.cfg.precision == "bf16-matmul":  # attention in fp32: the public context
            return autocast_if_available(torch.bfloat16, device=self.device, attention="fp32")
        return torch.autocast(self.device.type, dtype=DTYPES[self.cfg.precision])

    def build(self, *, fused: bool | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(self.cfg.seed)  # the same initial weights in every variant
        model = build_model(self.cfg.model).to(self.device)
        return model, build_optimizer(model, self.cfg.optim, fused=fused)

    def lr(self) -> float:
        return lr_at(self.i, self.cfg.optim, self.cfg.steps)

    def raw_model(self) -> torch.nn.Module:
        return self.model  # type: ignore[attr-defined,no-any-return]

    def eval_loss(self, step: int = 10**6) -> float:
        """The loss on one fixed batch in eval mode: the same in every variant trained alike."""
        x, y = self.batch(step)
        with eval_mode(self.raw_model()) as model, self.autocast():
            return float(model(x, y))  # sync: a check outside the timed steps

    def step(self) -> None:
        raise NotImplementedError


class Plain(Variant):
    """A tuned hand-written loop: the parameter list kept, fused AdamW, grads set to None."""

    name = "plain"

    def __init__(self, cfg: TrainConfig, corpus: data_mod.Corpus | None) -> None:
        super().__init__(cfg, corpus)
        self.model, self.opt = self.build()  # fused AdamW on CPU and CUDA
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        fp16 = cfg.precision == "fp16"
        self.scaler = torch.amp.GradScaler(self.device.type) if fp16 else None

    def step(self) -> None:
        x, y = self.batch()
        with self.autocast():
            loss = self.model(x, y)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.opt)
        else:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.grad_clip)
        lr = self.lr()
        for group in self.opt.param_groups:
            group["lr"] = lr
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.i += 1


class NanoGPT(Variant):
    """The loop of nanoGPT's train.py (grad_accum 1), line for line where it applies."""

    name = "nanogpt"

    def __init__(self, cfg: TrainConfig, corpus: data_mod.Corpus | None) -> None:
        super().__init__(cfg, corpus)
        # nanoGPT's configure_optimizers: `use_fused = fused_available and device_type == 'cuda'`
        self.model, self.opt = self.build(fused=self.device.type == "cuda")
        enabled = cfg.precision == "fp16"  # nanoGPT: GradScaler(enabled=(dtype == 'float16'))
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=enabled)

    def step(self) -> None:
        lr = self.lr()
        for param_group in self.opt.param_groups:
            param_group["lr"] = lr
        x, y = self.batch()
        with self.autocast():
            loss = self.model(x, y)
            loss = loss / self.cfg.grad_accum
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        self.i += 1


class Isotrain(Variant):
    """isotrain.train.loop: setup once (excluded from timing), then train_step per step."""

    name = "isotrain"

    def __init__(self, cfg: TrainConfig, corpus: data_mod.Corpus | None) -> None:
        super().__init__(cfg, corpus)
        torch.manual_seed(cfg.seed)  # the same initial weights as the baselines
        self.run = setup(cfg)
        if cfg.compile.enabled:
            from isotrain.compile import warmup

            x = torch.zeros(cfg.data.batch_size, cfg.model.block_size, dtype=torch.long)
            with self.autocast():
                warmup(self.run.model, [(x.to(self.device),) * 2])

    def raw_model(self) -> torch.nn.Module:
        return self.run.model

    def step(self) -> None:
        train_step(self.run)
        self.i += 1

    def skipped(self) -> int:
        """Steps the guard skipped (a skipped update is cheaper: report it with the timing)."""
        return int(self.run.updater.totals().get("skipped_steps", 0))


class IsotrainNoGuard(Isotrain):
    """isotrain's train_step with `--guard.no-enabled` (PlainUpdater): isolates the guard."""

    name = "isotrain-noguard"

    def __init__(self, cfg: TrainConfig, corpus: data_mod.Corpus | None) -> None:
        guard = dataclasses.replace(cfg.guard, enabled=False)
        super().__init__(dataclasses.replace(cfg, guard=guard), corpus)


class FabricLoop(Variant):
    """The plain loop through Lightning Fabric."""

    name = "fabric"
    PRECISION: ClassVar[dict[str, str]] = {
        "fp32": "32-true",
        "bf16": "bf16-mixed",
        "fp16": "16-mixed",
    }

    def __init__(self, cfg: TrainConfig, corpus: data_mod.Corpus | None) -> None:
        super().__init__(cfg, corpus)
        from lightning.fabric import Fabric

        accel = "cuda" if self.device.type == "cuda" else "cpu"
        self.fabric = Fabric(accelerator=accel, devices=1, precision=self.PRECISION[cfg.precision])
        model, opt = self.build()
        self.model, self.opt = self.fabric.setup(model, opt)

    def raw_model(self) -> torch.nn.Module:
        return self.model.module  # type: ignore[no-any-return]

    def step(self) -> None:
        x, y = self.batch()
        loss = self.model(x, y)  # Fabric applies its precision's autocast in the forward
        self.fabric.backward(loss)
        self.fabric.clip_gradients(self.model, self.opt, max_norm=self.cfg.optim.grad_clip)
        for group in self.opt.param_groups:
            group["lr"] = self.lr()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.i += 1


class AccelerateLoop(Variant):
    """The plain loop through Hugging Face Accelerate."""

    name = "accelerate"
    PRECISION: ClassVar[dict[str, str]] = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}

    def __init__(self, cfg: TrainConfig, corpus: data_mod.Corpus | None) -> None:
        super().__init__(cfg, corpus)
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)  # a process-wide singleton: allow a new precision
        self.acc = Accelerator(
            cpu=self.device.type == "cpu", mixed_precision=self.PRECISION[cfg.precision]
        )
        model, opt = self.build()
        self.model, self.opt = self.acc.prepare(model, opt)

    def raw_model(self) -> torch.nn.Module:
        return self.acc.unwrap_model(self.model)  # type: ignore[no-any-return]

    def step(self) -> None:
        x, y = self.batch()
        loss = self.model(x, y)  # Accelerate wraps the forward in its autocast
        self.acc.backward(loss)
        self.acc.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        for group in self.opt.param_groups:
            group["lr"] = self.lr()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.i += 1


VARIANTS: dict[str, type[Variant]] = {
    v.name: v for v in (Plain, NanoGPT, Isotrain, IsotrainNoGuard, FabricLoop, AccelerateLoop)
}


def load_corpus() -> data_mod.Corpus:
    return data_mod.load_corpus(None, max_bytes=1_000_000, val_fraction=0.1)


def build(specs: dict[str, tuple[type[Variant], TrainConfig]]) -> dict[str, Variant]:
    """Build each labelled variant; one whose library is missing is reported and left out."""
    corpus = load_corpus()
    out: dict[str, Variant] = {}
    for label, (cls, cfg) in specs.items():
        threads = torch.get_num_threads()
        try:
            out[label] = cls(cfg, corpus)
        except ImportError as e:
            print(f"[skip] {label}: {e} (pip install -e '.[bench]')", file=sys.stderr)
        torch.set_num_threads(threads)  # in case a library changed it
    return out


def make_variants(names: list[str], cfg: TrainConfig) -> dict[str, Variant]:
    """The named variants of VARIANTS, all on `cfg`."""
    return build({n: (VARIANTS[n], cfg) for n in names})


# ---------------------------------------------------------------------------------- timing
def interleave(
    variants: dict[str, Variant],
    *,
    rounds: int,
    steps: int = 1,
    warmup: int = 0,
    first_warmup: int = 2,
    until: Callable[[int], bool] | None = None,
    on_round: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, dict[str, list[float]]]:
    """Seconds for `steps` steps per variant per round, on two clocks; the order rotates.

    Runs `rounds` rounds, or fewer when `until(rounds_done)` says stop. Returns
    {"wall": {name: [...]}, "cpu": {name: [...]}}: process CPU time leaves out the time a busy
    machine kept the process waiting (with one torch thread it equals wall time when idle); on
    CUDA only wall time (after a synchronize) means anything.
    """
    names = list(variants)
    for v in variants.values():  # allocator, optimizer state, lazy init: outside every round
        for _ in range(first_warmup):
            v.step()
        v.sync()
    times: dict[str, dict[str, list[float]]] = {"wall": {n: [] for n in names}}
    times["cpu"] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        row = {}
        for name in names[k:] + names[:k]:
            v = variants[name]
            for _ in range(warmup):
                v.step()
            v.sync()
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                v.step()
            v.sync()
            c1, w1 = time.process_time(), time.perf_counter()
            times["wall"][name].append(w1 - w0)
            times["cpu"][name].append(c1 - c0)
            row[name] = w1 - w0
        if on_round is not None:
            on_round(r, row)
        if until is not None and until(r + 1):
            break
    return times


def losses(variants: dict[str, Variant]) -> dict[str, float]:
    """Each variant's loss on one fixed batch (compare before and after the timed steps)."""
    return {n: v.eval_loss() for n, v in variants.items()}


def loss_check(
    before: dict[str, float],
    after: dict[str, float],
    *,
    rel_tol: float,
    exact: tuple[str, ...] = (),
) -> tuple[bool, str]:
    """The same loss from the same weights, the same after training (within `rel_tol`), and a
    loss that moved in every variant (each one trained). Variants in `exact` must end bit for
    bit where `plain` ends: they run the same kernels in the same order."""

    def spread(d: dict[str, float]) -> float:
        return (max(d.values()) - min(d.values())) / abs(min(d.values()))

    moved = all(after[n] != before[n] for n in after)
    same = all(after[n] == after["plain"] for n in exact if n in after)
    ok = spread(before) <= rel_tol and spread(after) <= rel_tol and moved and same
    detail = (
        f"losses before {min(before.values()):.6f}-{max(before.values()):.6f}, after "
        f"{min(after.values()):.6f}-{max(after.values()):.6f}: relative spread "
        f"{spread(before):.1e} / {spread(after):.1e} (tolerance {rel_tol:g}); "
        f"every variant trained: {moved}"
    )
    if exact:
        detail += f"; {', '.join(exact)} bit-equal to plain after training: {same}"
    return ok, detail


def skipped(variants: dict[str, Variant]) -> dict[str, int]:
    """Steps the guard skipped, per isotrain variant (must be 0 for a fair timing)."""
    return {n: v.skipped() for n, v in variants.items() if isinstance(v, Isotrain)}
