"""GuardCallback with the real lightning.Trainer on a tiny random-init MLP, on the CPU."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from tests.op_dtypes import OpDtypes  # noqa: E402

from isotrain.guard import GuardedOptimizer  # noqa: E402
from isotrain.integrations.lightning import GuardCallback  # noqa: E402

K = 3  # the optimizer step (1-based: trainer.global_step after it) whose gradient is NaN
STEPS_PER_EPOCH = K + 1  # the resume test's checkpoint ends the first epoch, after the skip


class _Module(pl.LightningModule):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 1))
        self.armed = False
        self.net[3].weight.register_hook(lambda g: g * float("nan") if self.armed else g)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return (self.net(x) - y).square().mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        torch.rand(1)  # an evaluation that draws from the global RNG
        self.log("val_loss", (self.net(x) - y).square().mean())

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _loader(n_batches: int = STEPS_PER_EPOCH, *, same: bool = False) -> Any:
    g = torch.Generator().manual_seed(1)
    x = (
        torch.randn(4, 6, generator=g).repeat(n_batches, 1)
        if same
        else torch.randn(n_batches * 4, 6, generator=g)
    )
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)


class _Recorder(pl.Callback):
    """Arms the NaN at step `nan_at`; snapshots weights, moments, LR and logged skips per step."""

    def __init__(self, nan_at: int | None) -> None:
        self.nan_at, self.snaps, self.lrs, self.logged = nan_at, {}, {}, {}

    def on_train_batch_start(self, trainer: Any, module: Any, *a: Any) -> None:
        module.armed = trainer.global_step + 1 == self.nan_at

    def on_train_batch_end(self, trainer: Any, module: Any, *a: Any) -> None:
        opt, s = trainer.optimizers[0], trainer.global_step
        params = [p.detach().clone() for p in module.parameters()]
        self.snaps[s] = params + [v.clone() for st in opt.state.values() for v in st.values()]
        self.lrs[s] = opt.param_groups[0]["lr"]
        metrics = trainer.callback_metrics
        if "skipped_steps" in metrics:
            self.logged[s] = (int(metrics["skipped_steps"]), int(metrics["skip_reason"]))


def _fit(
    *, guarded: bool, nan_at: int | None = K, dropout: float = 0.0, ckpt: str | None = None,
    val_every: int | None = None, extra: tuple[Any, ...] = (), same: bool = False, **kw: Any,
) -> tuple[Any, _Recorder]:  # fmt: skip
    rec = _Recorder(nan_at)
    callbacks = [GuardCallback(), rec, *extra] if guarded else [rec, *extra]
    base: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_steps=2 * STEPS_PER_EPOCH, logger=False,
        enable_checkpointing=bool(extra), enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, gradient_clip_val=1.0, callbacks=callbacks, log_every_n_steps=1,
        limit_val_batches=0 if val_every is None else 2, val_check_interval=val_every,
    )  # fmt: skip
    trainer = pl.Trainer(**{**base, **kw})
    module = _Module(dropout)
    val = _loader(2) if val_every else None
    trainer.fit(module, _loader(same=same), val_dataloaders=val, ckpt_path=ckpt)
    return trainer, rec


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _finite(trainer: Any) -> bool:
    return all(bool(p.isfinite().all()) for p in trainer.lightning_module.parameters())


@pytest.mark.parametrize(
    "kw", [{}, {"accumulate_grad_batches": 2}, {"precision": "bf16-mixed"}],
    ids=["fp32", "accum2", "bf16"],
)  # fmt: skip
def test_a_nan_gradient_is_skipped_bitwise_with_the_lr_held_and_logged(kw: dict[str, Any]) -> None:
    trainer, rec = _fit(guarded=True, **kw)
    assert _same(rec.snaps[K], rec.snaps[K - 1])  # params, exp_avg, exp_avg_sq and step
    assert not _same(rec.snaps[K + 1], rec.snaps[K])
    assert rec.lrs[K] == rec.lrs[K - 1] and rec.lrs[K + 1] != rec.lrs[K]
    assert _finite(trainer)
    assert rec.logged[K] == (1, 2) and rec.logged[K - 1] == (0, 0)  # 2: NONFINITE_GRAD
    assert rec.logged[K + 1] == (1, 0)
    guard = trainer.optimizers[0].guard
    assert guard.summary()["skipped_by_reason"]["NONFINITE_GRAD"] == 1
    assert guard.max_norm == 1.0 and trainer.gradient_clip_val == 1.0  # the guard clipped

    plain, _ = _fit(guarded=False, **kw)  # the contrast: the NaN reaches the weights
    assert not _finite(plain)


def test_without_a_nan_the_guarded_run_equals_the_plain_one_bitwise() -> None:
    _, guarded = _fit(guarded=True, nan_at=None)
    _, plain = _fit(guarded=False, nan_at=None)
    assert guarded.snaps.keys() == plain.snaps.keys()
    assert all(_same(guarded.snaps[s], plain.snaps[s]) for s in plain.snaps)
    assert guarded.lrs == plain.lrs


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16-scaler"])
def test_resume_from_a_checkpoint_after_the_skip_equals_the_uninterrupted_run(
    tmp_path: Path, fp16: bool
) -> None:
    # Lightning restarts a plain DataLoader when it resumes (its first epoch after the
    # checkpoint replays batches): with every batch the same, the order cannot matter.
    every_epoch = pl.callbacks.ModelCheckpoint(
        dirpath=tmp_path, every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True
    )
    kw = _fp16 if fp16 else dict
    whole, rec = _fit(guarded=True, extra=(every_epoch,), same=True, **kw())
    cut = tmp_path / f"epoch=0-step={STEPS_PER_EPOCH}.ckpt"
    resumed, again = _fit(guarded=True, ckpt=str(cut), same=True, **kw())
    a, b = (t.optimizers[0].guard.state_dict() for t in (resumed, whole))
    assert a["steps"] == b["steps"] == 2 * STEPS_PER_EPOCH
    skip = [0, 0, 0, 0, 1] if fp16 else [0, 1, 0, 0, 0]  # SCALER_OVERFLOW, or NONFINITE_GRAD
    assert torch.equal(a["by_reason"], b["by_reason"]) and a["by_reason"].tolist() == [7, *skip]
    assert torch.equal(a["spikes"]["values"], b["spikes"]["values"])
    last = 2 * STEPS_PER_EPOCH
    assert _same(again.snaps[last], rec.snaps[last]) and again.lrs[last] == rec.lrs[last]
    assert again.logged[last] == rec.logged[last] == (1, 0)
    if fp16:  # the backed-off scale came back from the checkpoint
        scales = [t.precision_plugin.scaler.get_scale() for t in (resumed, whole)]
        assert scales == [2.0**9, 2.0**9]


def test_validation_changes_the_plain_run_and_leaves_the_guarded_one_bitwise_the_same() -> None:
    """A validation step that draws from the global RNG (here `torch.rand(1)`) changes the
    dropout masks of every plain step after it; under GuardCallback validation runs inside
    `rng_isolated`, so the guarded run equals the plain run without validation, bit for bit."""
    last = 2 * STEPS_PER_EPOCH
    runs = {
        (guarded, every): _fit(guarded=guarded, nan_at=None, dropout=0.2, val_every=every)[1]
        for guarded in (True, False)
        for every in (None, 2)
    }
    snaps = {key: rec.snaps[last] for key, rec in runs.items()}
    assert _same(snaps[True, None], snaps[False, None])  # no validation: guarded == plain
    assert _same(snaps[True, 2], snaps[True, None])  # guarded: validation changes nothing
    assert not _same(snaps[False, 2], snaps[False, None])  # plain: validation changes training


def test_a_missing_lightning_is_a_one_line_error_naming_the_extra(missing_extra) -> None:
    assert missing_extra("lightning", "lightning") == (
        "isotrain.integrations.lightning needs lightning, which is not installed: "
        "pip install 'isotrain[lightning]' "
        "(in a clone of isotrain: .venv/bin/pip install -e '.[lightning]')"
    )


def _bare(**kw: Any) -> Any:
    """A one-step Trainer that writes nothing (no logger, no checkpoint)."""
    return pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, **kw)  # fmt: skip


def test_a_clip_norm_that_disagrees_and_a_scaler_of_its_own_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match=r"gradient_clip_val=1.0\) and GuardCallback\(max_norm"):
        _bare(gradient_clip_val=1.0, callbacks=[GuardCallback(max_norm=0.5)]).fit(
            _Module(), _loader()
        )
    with pytest.raises(ValueError, match=r"takes no scaler: with precision='16-mixed' it uses"):
        GuardCallback(scaler=torch.amp.GradScaler("cpu"))


def _fp16() -> dict[str, Any]:
    """precision='16-mixed' with a GradScaler, as on a GPU (Lightning makes none on a CPU)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    return {"plugins": [pl.plugins.precision.MixedPrecision("16-mixed", "cpu", scaler)]}


def test_with_a_grad_scaler_an_overflow_is_the_guards_skip_and_the_scale_backs_off_once() -> None:
    trainer, rec = _fit(guarded=True, **_fp16())
    assert _same(rec.snaps[K], rec.snaps[K - 1])  # params, exp_avg, exp_avg_sq and step
    assert not _same(rec.snaps[K + 1], rec.snaps[K]) and _finite(trainer)
    assert rec.lrs[K] == rec.lrs[K - 1] and rec.lrs[K + 1] != rec.lrs[K]  # the LR held
    assert rec.logged[K] == (1, 5) and rec.logged[K - 1] == (0, 0)  # 5: SCALER_OVERFLOW
    guard = trainer.optimizers[0].guard
    assert guard.summary()["skipped_by_reason"]["SCALER_OVERFLOW"] == 1
    assert guard.summary()["loss_scale"] == 2.0**9  # what the steps after the skip used
    scaler = trainer.precision_plugin.scaler
    assert type(scaler) is torch.amp.GradScaler and scaler.get_scale() == 2.0**9  # once
    assert guard.summary()["last_loss"] > 0  # the loss reached the guard: each micro-batch's

    _, plain_rec = _fit(guarded=False, **_fp16())  # the scaler skips, but the LR moves on
    assert plain_rec.lrs[K] != plain_rec.lrs[K - 1]


def test_with_a_grad_scaler_and_no_overflow_the_guarded_run_equals_the_plain_one_bitwise() -> None:
    _, guarded = _fit(guarded=True, nan_at=None, **_fp16())
    _, plain = _fit(guarded=False, nan_at=None, **_fp16())
    assert guarded.snaps.keys() == plain.snaps.keys()
    assert all(_same(guarded.snaps[s], plain.snaps[s]) for s in plain.snaps)
    assert guarded.lrs == plain.lrs


class _Manual(_Module):
    """Manual optimization: the module wraps its optimizer in GuardedOptimizer itself."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        self.armed = self.trainer.global_step + 1 == K
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.optimizer.observe_loss(loss)  # the LightningOptimizer's GuardedOptimizer
        opt.step()

    def configure_optimizers(self) -> Any:
        return GuardedOptimizer(torch.optim.AdamW(self.parameters(), lr=1e-2), self)


def test_manual_optimization_uses_guarded_optimizer_directly() -> None:
    module = _Manual()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2 * STEPS_PER_EPOCH, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, _loader())
    guard = trainer.optimizers[0].guard
    assert guard.summary()["skipped_by_reason"]["NONFINITE_GRAD"] == 1 and guard.steps == 8
    assert _finite(trainer)
    with pytest.raises(ValueError, match="GuardCallback guards automatic optimization"):
        _bare(callbacks=[GuardCallback()]).fit(_Manual(), _loader())


class _ArmAt(pl.Callback):
    """Arms the NaN gradient at the given optimizer steps (1-based)."""

    def __init__(self, *steps: int) -> None:
        self.steps = steps

    def on_train_batch_start(self, trainer: Any, module: Any, *a: Any) -> None:
        module.armed = trainer.global_step + 1 in self.steps


def test_skips_between_log_steps_reach_the_loggers(tmp_path: Path) -> None:
    logger = pl.loggers.CSVLogger(tmp_path, name="run", version=0)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=8, logger=logger, log_every_n_steps=5,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[GuardCallback(), _ArmAt(3, 7)],
    )  # fmt: skip
    trainer.fit(_Module(), _loader(8))
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        rows = [(r["step"], r["skipped_steps"], r["skip_reason"]) for r in csv.DictReader(f)]
    # Logged at step index 4 (the 5th step): the skip of step 3, reason 2 (NONFINITE_GRAD);
    # the skip of step 7 came after the last log step: written when training ended.
    assert rows == [("4", "1.0", "2.0"), ("7", "2.0", "2.0")]


class _DeadBranch(_Module):
    """BUG: a branch whose output is multiplied by 0, so its weights never train."""

    def __init__(self, dead: bool) -> None:
        super().__init__()
        self.extra, self.dead = nn.Linear(6, 1), dead

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        scale = 0.0 if self.dead else 1.0
        return (self.net(x) + scale * self.extra(x) - y).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.0)


@pytest.mark.parametrize("dead", [True, False])
def test_monitor_every_checks_the_fit_and_names_a_branch_that_never_trains(dead: bool) -> None:
    callback = GuardCallback(monitor_every=2)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=24, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback],
    )  # fmt: skip
    trainer.fit(_DeadBranch(dead), _loader())
    monitor = callback.monitor
    assert monitor.step == 24 and monitor.checked_at == 24  # every optimizer step counted
    found = [(f.kind, f.severity, f.where) for f in monitor.findings]
    assert found == ([("params_unchanged", "warning", "extra.weight, extra.bias")] if dead else [])
    with pytest.raises(ValueError, match=r"^monitor_every must be 0 \(off\) or a number of steps"):
        GuardCallback(monitor_every=-1)


class _Attending(pl.LightningModule):
    """A linear layer, then scaled_dot_product_attention over the batch's rows (B, 1, T, D)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(6, 8)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.proj(x).view(1, 1, 4, 8)  # (B, H, T, D)
        out = nn.functional.scaled_dot_product_attention(h, h, h, is_causal=True)
        return (out.float().sum(-1).view(4, 1) - y).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("cpu_kind", ["avx2", "avx512-bf16"], indirect=True)
def test_bf16_matmul_runs_the_matmuls_in_bf16_and_attention_in_fp32(cpu_kind: str) -> None:
    module, guard = _Attending(), GuardCallback(precision="bf16-matmul")
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[guard],
    )  # fmt: skip
    with OpDtypes() as seen:
        trainer.fit(module, _loader(2))
    linear = {"avx2": {"layout_mm"}, "avx512-bf16": {"addmm", "mm"}}[cpu_kind]
    assert {op for op in seen.ops if op in {"mm", "addmm", "layout_mm"}} == linear
    assert seen.where(lambda op: op in linear) == {torch.bfloat16}  # forward and backward
    sdpa = [op for op in seen.ops if "scaled_dot_product" in op]
    assert any(op.endswith("_backward") for op in sdpa), sdpa
    assert seen.where(lambda op: "scaled_dot_product" in op) == {torch.float32}
    assert trainer.global_step == 2 and module.proj.weight.dtype == torch.float32
    assert "train_step_context" not in vars(trainer.precision_plugin)  # undone at teardown


def test_bf16_matmul_beside_lightnings_own_mixed_precision_is_refused() -> None:
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, precision="bf16-mixed",
        callbacks=[GuardCallback(precision="bf16-matmul")],
    )  # fmt: skip
    with pytest.raises(ValueError) as info:
        trainer.fit(_Attending(), _loader(1))
    assert str(info.value) == (
        "GuardCallback(precision='bf16-matmul') runs its own bf16 autocast, and "
        "Trainer(precision='bf16-mixed') asks for another: pass one of them (NOTE [bf16-matmul "
        "in trainers])"
    )
