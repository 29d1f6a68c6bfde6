"""The trainer applies all five patterns at once, and each leaves the arithmetic intact."""

import copy
import dataclasses

import pytest
import torch
from tests.train.trained import params_after

from isotrain.autograd import QuantLinear
from isotrain.autograd import _linear as autograd_linear
from isotrain.train import config as C
from isotrain.train import loop
from isotrain.train.loop import setup, train
from isotrain.train.rundir.metrics import read_metrics
from isotrain.train.step import train_step


def _cfg(tmp_path, **kw) -> C.TrainConfig:
    base = C.PRESETS["smoke"]()
    data = dataclasses.replace(base.data, max_bytes=60_000, varlen=kw.pop("varlen", False))
    return dataclasses.replace(base, data=data, out_dir=str(tmp_path), **kw)


def test_activation_checkpointing_leaves_training_bit_identical(tmp_path) -> None:
    plain = params_after(_cfg(tmp_path), 3)
    for policy in ("full", "every:2", "selective", "budget:50%"):
        ckpt = params_after(_cfg(tmp_path, checkpointing=C.CheckpointingConfig(policy=policy)), 3)
        assert plain.keys() == ckpt.keys()
        for name in plain:
            assert torch.equal(plain[name], ckpt[name]), (policy, name)


def test_quantization_aware_training_changes_the_forward_only_through_weights(tmp_path) -> None:
    cfg = _cfg(tmp_path, quant=C.QuantConfig(bits=4))
    run = setup(cfg)
    layers = [m for m in run.model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * cfg.model.n_layer  # qkv, attn proj, fc, mlp proj per block
    for layer in layers:
        # The weight the forward really uses: a bias-free copy applied to the identity.
        probe = copy.deepcopy(layer)
        with torch.no_grad():
            probe.bias.zero_()
            w_eff = probe(torch.eye(layer.in_features)).t()  # (out, in)
        levels = max(len(row.unique()) for row in w_eff)
        assert levels <= 2**4 and not torch.equal(w_eff, layer.weight)
        # ... and it is this weight rounded: within half a step absmax(row) / 7 of it.
        half_step = layer.weight.detach().abs().amax(dim=1, keepdim=True) / 7 / 2
        assert ((w_eff - layer.weight).abs() <= half_step * (1 + 1e-5)).all()
    assert type(run.model.lm_head) is torch.nn.Linear  # tied to the embedding: kept exact
    assert run.model.lm_head.weight is run.model.wte.weight
    train_step(run)
    assert all(torch.isfinite(p).all() for p in run.model.parameters())


def test_all_five_patterns_compose_without_recompiles(tmp_path) -> None:
    cfg = _cfg(
        tmp_path,
        compile=C.CompileConfig(enabled=True, backend="eager", fail_on_recompile=True),
        varlen=True,
        checkpointing=C.CheckpointingConfig(policy="full"),
        quant=C.QuantConfig(bits=8),
        guard=C.GuardConfig(inject_nan_at=(5,)),
        steps=6,
    )
    train(cfg)
    records = read_metrics(tmp_path)
    (compiled,) = [r for r in records if r["kind"] == "compile"]
    assert compiled["compilations"] >= 2  # one graph per bucket (16, 32), train and eval
    last = [r for r in records if r["kind"] == "train"][-1]
    assert last["compiles_after_warmup"] == 0 and last["recompiles_after_warmup"] == 0
    assert last["skipped_total"] == 1
    summary = records[-1]
    assert summary["skipped_nonfinite_loss"] == 1 and summary["compile_seconds"] > 0


def test_without_the_guard_an_injected_nan_reaches_the_weights(tmp_path) -> None:
    for enabled in (True, False):
        run = setup(_cfg(tmp_path, guard=C.GuardConfig(enabled=enabled, inject_nan_at=(2,))))
        for _ in range(2):
            train_step(run)
        finite = all(torch.isfinite(p).all() for p in run.model.parameters())
        assert finite is enabled


def test_quantized_activations_train_and_differ_from_weights_only(tmp_path) -> None:
    weights = setup(_cfg(tmp_path, quant=C.QuantConfig(bits=4)))
    both = setup(_cfg(tmp_path, quant=C.QuantConfig(bits=4, activations=True)))
    assert (
        both.model.blocks[0].mlp.fc.activations and not weights.model.blocks[0].mlp.fc.activations
    )
    for run in (weights, both):
        train_step(run)
        assert all(torch.isfinite(p).all() for p in run.model.parameters())
    assert not torch.equal(weights.model.wte.weight, both.model.wte.weight)


def test_cpu_bf16_uses_layout_linears_with_the_same_losses(tmp_path, monkeypatch) -> None:
    losses, kinds = {}, {}
    full = C.CheckpointingConfig(policy="full")
    cases = [("stock", True, None), ("layout", False, None), ("ckpt", False, full)]
    for key, native, ckpt in cases:
        monkeypatch.setattr(autograd_linear, "native_bf16_matmul", lambda native=native: native)
        torch.manual_seed(0)
        extra = {"checkpointing": ckpt} if ckpt else {}
        run = setup(_cfg(tmp_path / key, precision="bf16", **extra))
        kinds[key] = type(run.model.blocks[0].mlp.fc).__name__
        losses[key] = [float(train_step(run).loss) for _ in range(3)]
    assert kinds == {"stock": "Linear", "layout": "Bf16Linear", "ckpt": "Bf16Linear"}
    assert losses["layout"] == pytest.approx(losses["stock"], rel=1e-2)
    assert losses["ckpt"] == losses["layout"]  # recomputation repeats the same products
    assert type(setup(_cfg(tmp_path / "fp32")).model.lm_head).__name__ == "Linear"


def test_a_skipped_step_leaves_the_models_buffers_as_before_its_forward(
    tmp_path, monkeypatch
) -> None:
    # The trainer's GPT has no buffers; give it one its forward writes (as BatchNorm does).
    build = loop.build_model

    def count(module: torch.nn.Module, args: tuple, out: object) -> None:
        module.tokens_seen.add_(args[0].numel())

    def with_counter(cfg: C.ModelConfig) -> torch.nn.Module:
        model = build(cfg)
        model.register_buffer("tokens_seen", torch.zeros((), dtype=torch.long))
        model.register_forward_hook(count)
        return model

    monkeypatch.setattr(loop, "build_model", with_counter)
    run = setup(_cfg(tmp_path, guard=C.GuardConfig(inject_nan_at=(2,))))
    assert run.updater.guard.buffers is not None  # protect_buffers is on in the trainer
    seen = []
    for _ in range(3):
        train_step(run)
        seen.append(int(run.model.tokens_seen))
    tokens = seen[0]
    assert tokens > 0 and seen == [tokens, tokens, 2 * tokens]  # step 2 was skipped
