"""GuardedTrainer with the real transformers.Trainer on a tiny random-init GPT-2, on the CPU."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.op_dtypes import OpDtypes, SdpaDtypes  # noqa: E402

from isotrain.integrations.transformers import GuardedTrainer  # noqa: E402

K = 3  # the step (1-based, Trainer's global_step after it) whose gradient is NaN
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _model() -> Any:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    return transformers.GPT2LMHeadModel(cfg)


def _data(n: int = 64) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 32, (8,), generator=g) for _ in range(n)]
    return [{"input_ids": x, "labels": x} for x in rows]


class _Recorder(transformers.TrainerCallback):
    """Injects a NaN gradient at step `nan_at` and snapshots weights, moments and LR per step."""

    def __init__(self, model: Any, nan_at: int | None) -> None:
        self.nan_at, self.armed, self.snaps = nan_at, False, {}
        self.lrs: dict[int, float] = {}
        model.lm_head.weight.register_hook(lambda g: g * float("nan") if self.armed else g)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.armed = state.global_step + 1 == self.nan_at

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        model, opt = kw["model"], kw["optimizer"]
        params = [p.detach().clone() for p in model.parameters()]
        moments = [v.clone() for s in opt.state.values() for v in s.values()]
        self.snaps[state.global_step] = params + moments
        self.lrs[state.global_step] = opt.param_groups[0]["lr"]


def _args(tmp: Path, **kw: Any) -> Any:
    base: dict[str, Any] = dict(
        output_dir=str(tmp), max_steps=6, per_device_train_batch_size=4, learning_rate=1e-2,
        warmup_steps=2, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=DEVICE == "cpu", dataloader_num_workers=0, disable_tqdm=True, seed=0,
    )  # fmt: skip
    return transformers.TrainingArguments(**{**base, **kw})


def _train(tmp: Path, *, guarded: bool, nan_at: int | None = K, **kw: Any) -> tuple[Any, Any]:
    model = _model()
    rec = _Recorder(model, nan_at)
    cls = GuardedTrainer if guarded else transformers.Trainer
    trainer = cls(model=model, args=_args(tmp, **kw), train_dataset=_data(), callbacks=[rec])
    if kw.get("fp16") and DEVICE == "cpu":  # what accelerate does on a GPU: fp16 autocast and
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # a scaler
        trainer.accelerator.native_amp = True
    trainer.train()
    return trainer, rec


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _finite(model: Any) -> bool:
    return all(bool(p.isfinite().all()) for p in model.parameters())


# Said on a CPU before the test gives accelerate its scaler (a filter spec: no colons in it).
FP32 = ".*fp16=True, but accelerate runs no fp16 autocast"
PRECISIONS = [
    pytest.param({}, id="fp32"),
    pytest.param({"gradient_accumulation_steps": 2}, id="accum2"),
    pytest.param({"bf16": True}, id="bf16"),
    pytest.param({"fp16": True}, id="fp16", marks=pytest.mark.filterwarnings(f"ignore:{FP32}")),
]


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU's fp16: accelerate runs it in fp32")
def test_fp16_that_accelerate_runs_in_fp32_is_said(tmp_path: Path) -> None:
    with pytest.warns(UserWarning) as said:
        trainer = GuardedTrainer(
            model=_model(), args=_args(tmp_path, fp16=True), train_dataset=_data()
        )
    assert [str(w.message) for w in said if "GuardedTrainer" in str(w.message)] == [
        "GuardedTrainer: fp16=True, but accelerate runs no fp16 autocast and no GradScaler on "
        "cpu: this run trains in fp32 (bf16=True gives mixed precision there)"
    ]
    assert trainer.accelerator.scaler is None


@pytest.mark.parametrize("kw", PRECISIONS)
def test_a_nan_gradient_is_skipped_bitwise_with_the_lr_held_and_logged(
    tmp_path: Path, kw: dict[str, Any]
) -> None:
    trainer, rec = _train(tmp_path, guarded=True, **kw)
    mixed = "bf16" if kw.get("bf16") else "fp16" if kw.get("fp16") else "no"
    assert trainer.accelerator.mixed_precision == mixed
    assert (trainer.accelerator.scaler is not None) == (mixed == "fp16")
    assert _same(rec.snaps[K], rec.snaps[K - 1])  # params, exp_avg, exp_avg_sq and step
    assert not _same(rec.snaps[K + 1], rec.snaps[K])
    assert rec.lrs[K] == rec.lrs[K - 1] and rec.lrs[K + 1] != rec.lrs[K]
    assert _finite(trainer.model)
    logs = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    reason = "SCALER_OVERFLOW" if mixed == "fp16" else "NONFINITE_GRAD"
    assert logs[K]["skipped_steps"] == 1 and logs[K]["skip_reason"] == reason
    assert logs[K + 1]["skipped_steps"] == 0 and logs[K + 1]["skip_reason"] == "OK"
    assert math.isnan(logs[K]["grad_norm"]) and math.isfinite(logs[K + 1]["grad_norm"])
    summary = trainer.optimizer.guard.summary()
    assert summary["skipped"] == 1 and summary["skipped_by_reason"][reason] == 1
    if mixed == "fp16":  # the scale backed off once, by the guard's one update
        assert trainer.accelerator.scaler.get_scale() == summary["loss_scale"] == 2.0**9
        return  # without isotrain the scaler skips the step too: no contrast to show

    plain, _ = _train(tmp_path / "plain", guarded=False, **kw)  # the contrast: NaN reaches it
    assert not _finite(plain.model)


@pytest.mark.filterwarnings(f"ignore:{FP32}")
@pytest.mark.parametrize("kw", [{}, {"fp16": True}], ids=["fp32", "fp16"])
def test_without_a_nan_the_guarded_run_equals_the_plain_one_bitwise(
    tmp_path: Path, kw: dict[str, Any]
) -> None:
    _, guarded = _train(tmp_path, guarded=True, nan_at=None, **kw)
    _, plain = _train(tmp_path / "plain", guarded=False, nan_at=None, **kw)
    assert all(_same(guarded.snaps[s], plain.snaps[s]) for s in plain.snaps)
    assert guarded.lrs == plain.lrs


class _StopAt(transformers.TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        control.should_training_stop = state.global_step == self.step


def test_resume_after_a_skip_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    whole, rec = _train(tmp_path / "whole", guarded=True)
    model = _model()
    args = _args(tmp_path / "cut", save_strategy="steps", save_steps=K + 1)
    cut = GuardedTrainer(
        model=model,
        args=args,
        train_dataset=_data(),
        callbacks=[_Recorder(model, K), _StopAt(K + 1)],
    )
    cut.train()
    assert cut.state.global_step == K + 1 and cut.optimizer.guard.summary()["skipped"] == 1
    model = _model()
    resumed_rec = _Recorder(model, K)
    args = _args(tmp_path / "cut")
    resumed = GuardedTrainer(model=model, args=args, train_dataset=_data(), callbacks=[resumed_rec])
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / f"checkpoint-{K + 1}"))
    a, b = resumed.optimizer.guard.state_dict(), whole.optimizer.guard.state_dict()
    assert a["steps"] == b["steps"] == 6 and torch.equal(a["by_reason"], b["by_reason"])
    assert torch.equal(a["spikes"]["values"], b["spikes"]["values"])
    assert _same(resumed_rec.snaps[6], rec.snaps[6])
    assert resumed_rec.lrs[6] == rec.lrs[6]


def test_evaluation_changes_the_plain_run_and_leaves_the_guarded_one_bitwise_the_same(
    tmp_path: Path,
) -> None:
    """Trainer's own evaluation advances the global torch RNG, so with dropout the plain run
    trains on after an evaluation with other masks; GuardedTrainer evaluates inside
    `rng_isolated`, so its run equals the plain run without evaluation, bit for bit."""
    plain = transformers.Trainer(model=_model(), args=_args(tmp_path), eval_dataset=_data(8))
    before = torch.get_rng_state()
    plain.evaluate()
    assert not torch.equal(torch.get_rng_state(), before)  # eval mode: no dropout draws here
    runs = {}
    for guarded, every in ((True, None), (True, 2), (False, None), (False, 2)):
        model = _model()
        model.transformer.drop.p = 0.1  # dropout: training itself draws from the RNG
        rec = _Recorder(model, None)
        kw = {"eval_strategy": "steps", "eval_steps": every} if every else {}
        cls = GuardedTrainer if guarded else transformers.Trainer
        trainer = cls(
            model=model, args=_args(tmp_path, **kw), train_dataset=_data(),
            eval_dataset=_data(8), callbacks=[rec],
        )  # fmt: skip
        trainer.train()
        runs[guarded, every] = rec.snaps[6]
    assert _same(runs[True, None], runs[False, None])  # no evaluation: guarded == plain
    assert _same(runs[True, 2], runs[True, None])  # guarded: evaluation changes nothing
    assert not _same(runs[False, 2], runs[False, None])  # plain: evaluation changes training


def test_importing_isotrain_imports_no_framework() -> None:
    code = (
        "import sys, isotrain, isotrain.integrations; "
        "assert not {'transformers', 'lightning', 'pytorch_lightning'} & set(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_missing_transformers_is_a_one_line_error_naming_the_extra(missing_extra) -> None:
    assert missing_extra("transformers", "transformers") == (
        "isotrain.integrations.transformers needs transformers, which is not installed: "
        "pip install 'isotrain[transformers]' "
        "(in a clone of isotrain: .venv/bin/pip install -e '.[transformers]')"
    )


def test_max_norm_and_the_scaler_come_from_the_trainer_not_guard_options(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"max_norm from args.max_grad_norm and the scaler"):
        GuardedTrainer(model=_model(), args=_args(tmp_path), guard_options={"max_norm": 2.0})


def test_a_second_train_call_keeps_one_guard_and_its_counters(tmp_path: Path) -> None:
    trainer = GuardedTrainer(model=_model(), args=_args(tmp_path), train_dataset=_data())
    trainer.train()
    trainer.train()
    chain, opt = [], trainer.optimizer
    while opt is not None:
        chain.append(type(opt).__name__)
        opt = getattr(opt, "optimizer", None)
    assert chain == ["GuardedOptimizer", "AcceleratedOptimizer", "AdamW"]
    assert trainer.optimizer.guard.steps == 12


@pytest.mark.parametrize("dead", [True, False])
def test_monitor_every_checks_the_run_and_names_a_layer_that_never_trains(
    tmp_path: Path, dead: bool
) -> None:
    model = _model()
    if dead:  # BUG: the position embedding's gradient is thrown away (a hook left from a test)
        model.transformer.wpe.weight.register_hook(torch.zeros_like)
    args = _args(tmp_path, max_steps=24, logging_steps=50)
    trainer = GuardedTrainer(model=model, args=args, train_dataset=_data(), monitor_every=2)
    trainer.train()
    monitor = trainer.monitor
    assert monitor.step == 24 and monitor.checked_at == 24
    found = [(f.kind, f.severity, f.where) for f in monitor.findings]
    assert found == ([("params_unchanged", "warning", "transformer.wpe.weight")] if dead else [])
    with pytest.raises(ValueError, match=r"^monitor_every must be 0 \(off\) or a number of steps"):
        GuardedTrainer(model=model, args=args, train_dataset=_data(), monitor_every=-1)


@pytest.mark.parametrize("cpu_kind", ["avx2", "avx512-bf16"], indirect=True)
def test_bf16_matmul_runs_the_matmuls_in_bf16_and_attention_in_fp32(
    tmp_path: Path, cpu_kind: str
) -> None:
    model = _model()
    assert model.config._attn_implementation == "sdpa"
    args = _args(tmp_path, max_steps=2)
    trainer = GuardedTrainer(model=model, args=args, train_dataset=_data(), precision="bf16-matmul")
    with SdpaDtypes() as sdpa, OpDtypes() as seen:
        trainer.train()
    assert sdpa.calls == 2 and sdpa.dtypes == {torch.float32}  # one layer, two steps
    # AVX2: the Linear head in Bf16Linear's layout op; GPT-2's Conv1D layers are ATen's addmm.
    assert ("layout_mm" in seen.ops) is (cpu_kind == "avx2")
    assert seen.where(lambda op: op in {"mm", "addmm", "layout_mm"}) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert trainer.state.global_step == 2 and _finite(model)


def test_bf16_matmul_beside_trainers_own_mixed_precision_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        GuardedTrainer(model=_model(), args=_args(tmp_path, bf16=True), precision="bf16-matmul")
    assert str(info.value) == (
        "GuardedTrainer(precision='bf16-matmul') runs its own bf16 autocast, and args.bf16=True "
        "asks for another: pass one of them (NOTE [bf16-matmul in trainers])"
    )
    with pytest.raises(ValueError, match=r"precision='bf16'\): use None .* or 'bf16-matmul'"):
        GuardedTrainer(model=_model(), args=_args(tmp_path), precision="bf16")
