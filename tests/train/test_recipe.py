"""The speedrun recipe: its model switches, Muon beside AdamW as one optimizer, and the
patterns (guard skip, checkpointing, resume) kept exact with both."""

import dataclasses
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from tests.train.trained import params_after, tensors

from isotrain.guard import StepGuard
from isotrain.train import config as C
from isotrain.train import rules as R
from isotrain.train.loop import train
from isotrain.train.model.gpt import GPT, GPTConfig, rotary
from isotrain.train.rundir.metrics import read_metrics
from isotrain.train.rundir.snapshot import load_snapshot
from isotrain.train.update.muon import Muon, MuonAdamW, newton_schulz, split_params
from isotrain.train.update.optim import build_optimizer

RECIPE = dict(positions="rotary", qk_norm=True, activation="relu2", tie_head=False, zero_init=True)


def _tiny(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, d_model=16, block_size=8, **kw))


def _cfg(out, **kw) -> C.TrainConfig:
    """The smoke preset with the recipe's model and optimizer."""
    base = C.PRESETS["smoke"]()
    speed = C.PRESETS["speedrun"]()
    model = dataclasses.replace(
        speed.model, n_layer=2, n_head=2, d_model=32, block_size=32, dropout=0.1
    )
    optim = dataclasses.replace(speed.optim, warmup_steps=2)
    data = dataclasses.replace(base.data, max_bytes=60_000, varlen=kw.pop("varlen", False))
    return dataclasses.replace(base, model=model, optim=optim, data=data, out_dir=str(out), **kw)


# ------------------------------------------------------------------------------ the model
def test_rotary_scores_depend_only_on_the_distance() -> None:
    torch.manual_seed(0)
    q, k = torch.randn(8), torch.randn(8)
    T = 12
    qs, ks = rotary(q.expand(1, 1, T, 8)), rotary(k.expand(1, 1, T, 8))  # same q, k at every t
    scores = qs[0, 0] @ ks[0, 0].T  # (T, T): q at position i against k at position j
    for shift in range(-3, 4):
        diag = torch.diagonal(scores, offset=shift)
        assert torch.allclose(diag, diag[0].expand_as(diag), atol=1e-5), shift
    assert not torch.allclose(scores[0, 0], scores[0, 5])  # and it does depend on the distance
    assert torch.allclose(qs[0, 0, 0], q)  # position 0 is not rotated
    assert torch.allclose(qs.norm(dim=-1), q.norm().expand(1, 1, T))  # a rotation: norms kept


def test_qk_norm_gives_queries_and_keys_unit_rms(monkeypatch) -> None:
    seen, real = {}, F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen["q"], seen["k"] = q, k
        return real(q, k, v, **kw)

    model = _tiny(qk_norm=True)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model(torch.randint(0, 256, (2, 8)))
    for t in (seen["q"], seen["k"]):
        assert torch.allclose(t.pow(2).mean(-1), torch.ones(t.shape[:-1]), atol=1e-3)


def test_relu2_mlp_is_relu_squared() -> None:
    model = _tiny(activation="relu2")
    mlp, x = model.blocks[0].mlp, torch.randn(3, 16)
    expected = mlp.proj(torch.relu(mlp.fc(x)) ** 2)
    assert torch.allclose(mlp(x), expected)


def test_untied_zero_init_head_and_projections() -> None:
    model = _tiny(tie_head=False, zero_init=True, positions="rotary")
    assert model.lm_head.weight is not model.wte.weight and model.wpe is None
    zero = [n for n, p in model.named_parameters() if n.endswith("weight") and not p.any()]
    assert zero == [
        "blocks.0.attn.proj.weight", "blocks.0.mlp.proj.weight",
        "blocks.1.attn.proj.weight", "blocks.1.mlp.proj.weight", "lm_head.weight",
    ]  # fmt: skip
    logits = model(torch.randint(0, 256, (2, 8)))
    assert not logits.any()  # a zero head: the first loss is exactly log(vocab)
    assert model.num_params() == sum(p.numel() for p in model.parameters())


# -------------------------------------------------------------------------- the optimizer
def test_muon_takes_the_hidden_matrices_adamw_the_rest() -> None:
    model = _tiny(**RECIPE)
    names = {id(p): n for n, p in model.named_parameters()}
    muon, decay, no_decay = ([names[id(p)] for p in ps] for ps in split_params(model))
    assert muon == [
        f"blocks.{i}.{m}.weight"
        for i in range(2)
        for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    ]
    assert decay == ["wte.weight", "lm_head.weight"]
    assert no_decay and all(
        n.endswith(("bias", "ln1.weight", "ln2.weight", "ln_f.weight")) for n in no_decay
    )
    opt = build_optimizer(model, C.OptimConfig(name="muon"))
    assert isinstance(opt, MuonAdamW)
    assert [(g["rule"], len(g["params"]), g["weight_decay"]) for g in opt.param_groups] == [
        ("muon", 8, 0.1), ("adamw", 2, 0.1), ("adamw", len(no_decay), 0.0),
    ]  # fmt: skip
    tied = _tiny()  # tied head: the embedding once, under its own name
    decayed = split_params(tied)[1]
    assert [p is q for p, q in zip(decayed, (tied.wte.weight, tied.wpe.weight))] == [True, True]


def test_muon_step_is_torch_muons_rule_in_fp32() -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 4))
    g1, g2 = torch.randn(6, 4), torch.randn(6, 4)
    opt = Muon([w], lr=0.1, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw")
    expected, buf = w.detach().clone(), torch.zeros(6, 4)
    for g in (g1, g2):
        w.grad = g.clone()
        opt.step()
        buf = 0.9 * buf + 0.1 * g
        u = newton_schulz(g.lerp(buf, 0.9)[None], (3.4445, -4.775, 2.0315), 5, 1e-7)[0]
        expected = expected * (1 - 0.1 * 0.1) - 0.1 * 0.2 * math.sqrt(6) * u
    assert torch.allclose(w.detach(), expected, atol=1e-6)
    s = torch.linalg.svdvals(
        newton_schulz(torch.randn(1, 32, 16), (3.4445, -4.775, 2.0315), 5, 1e-7)
    )
    assert s.min() > 0.5 and s.max() < 1.5  # orthogonalised: singular values near 1


def _state(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{k}": v.clone()
        for i, st in enumerate(opt.state.values())
        for k, v in st.items()
        if isinstance(v, torch.Tensor)
    }


@pytest.mark.parametrize("mode", ["host", "select"])
def test_guard_skip_leaves_weights_and_both_optimizers_bitwise(mode) -> None:
    model = _tiny(**RECIPE)
    opt = build_optimizer(model, C.OptimConfig(name="muon"))
    guard = StepGuard(opt, model, skip_mode=mode, spike_k=None)
    x = torch.randint(0, 256, (4, 8))

    def step(scale: float = 1.0):
        loss = model(x, x) * scale
        loss.backward()
        return guard.step(loss)

    for _ in range(2):  # both rules have state to keep
        assert step().applied
    muon_keys, adam_keys = (
        {k for g in opt._rules[rule].param_groups for p in g["params"] for k in opt.state[p]}
        for rule in ("muon", "adamw")
    )
    assert muon_keys == {"momentum_buffer"} and adam_keys == {"step", "exp_avg", "exp_avg_sq"}
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = _state(opt)
    outcome = step(float("nan"))
    assert outcome.to_dict()["reason"] == "NONFINITE_LOSS" and guard.summary()["skipped"] == 1
    for n, p in model.named_parameters():
        assert torch.equal(p, weights[n]), n
    after = _state(opt)
    assert after.keys() == state.keys()
    for k in state:
        assert torch.equal(after[k], state[k]), k
    assert step().applied  # and the next good step applies both rules
    assert not torch.equal(model.blocks[0].mlp.fc.weight, weights["blocks.0.mlp.fc.weight"])
    assert not torch.equal(model.wte.weight, weights["wte.weight"])


def test_activation_checkpointing_is_bit_identical_with_the_recipe(tmp_path) -> None:
    plain = params_after(_cfg(tmp_path / "a"), 3)
    for policy in ("full", "selective"):
        ckpt = params_after(
            _cfg(tmp_path / policy, checkpointing=C.CheckpointingConfig(policy=policy)), 3
        )
        assert plain.keys() == ckpt.keys()
        for name in plain:
            assert torch.equal(plain[name], ckpt[name]), (policy, name)


def test_resume_is_bit_exact_with_muon_and_adamw(tmp_path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    kw = dict(snapshot=C.SnapshotConfig(every=3, keep=10), steps=7, eval_every=7, log_every=1)
    train(_cfg(straight, **kw))
    (resumed / "snapshots").mkdir(parents=True)
    shutil.copytree(straight / "snapshots" / "step_0000003", resumed / "snapshots" / "step_0000003")
    assert train(_cfg(resumed, **kw)).step == 7
    a, _ = load_snapshot(straight)
    b, _ = load_snapshot(resumed)
    rules = [g["rule"] for g in a["optimizer"]["param_groups"]]
    assert rules == ["muon", "adamw", "adamw"]
    kinds = {k for st in a["optimizer"]["state"].values() for k in st}
    assert kinds == {"momentum_buffer", "step", "exp_avg", "exp_avg_sq"}
    ta, tb = dict(tensors(a["model"])), dict(tensors(b["model"]))
    ta.update(tensors(a["optimizer"], "opt")), tb.update(tensors(b["optimizer"], "opt"))
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name


def test_a_loaded_state_reaches_both_rules() -> None:
    model = _tiny(**RECIPE)
    opt = build_optimizer(model, C.OptimConfig(name="muon"))
    x = torch.randint(0, 256, (2, 8))
    model(x, x).backward()
    opt.step()
    fresh = build_optimizer(model, C.OptimConfig(name="muon"))
    fresh.load_state_dict(opt.state_dict())
    for rule in ("muon", "adamw"):
        inner = fresh._rules[rule]
        assert inner.state is fresh.state
        assert all(any(g is h for h in fresh.param_groups) for g in inner.param_groups)
    fresh.param_groups[0]["lr"] = 0.5  # the schedule's write reaches the stepping optimizer
    assert fresh._rules["muon"].param_groups[0]["lr"] == 0.5


def test_gpt2_export_refuses_what_gpt2_has_no_place_for() -> None:
    from isotrain.train.data.sources import DataError
    from isotrain.train.model.hf import to_gpt2_state

    with pytest.raises(DataError, match=r"no place for --model.positions rotary, --model.no-tie"):
        to_gpt2_state(_tiny(positions="rotary", tie_head=False))
    assert "transformer.wpe.weight" in to_gpt2_state(
        _tiny(zero_init=True)
    )  # zero init: still GPT-2


def test_muon_with_fsdp_is_refused_with_the_fix(tmp_path) -> None:
    cfg = _cfg(tmp_path, parallel=C.ParallelConfig(mode="fsdp"))
    with pytest.raises(
        C.ConfigError, match=r"--optim.name muon is invalid: .*try --optim.name adamw"
    ):
        R.validate(cfg)


def test_the_five_patterns_compose_with_the_recipe(tmp_path) -> None:
    cfg = _cfg(
        tmp_path,
        compile=C.CompileConfig(enabled=True, backend="eager", fail_on_recompile=True),
        checkpointing=C.CheckpointingConfig(policy="full"),
        quant=C.QuantConfig(bits=8),
        guard=C.GuardConfig(inject_nan_at=(5,)),
        varlen=True,
        steps=6,
    )
    train(cfg)
    records = read_metrics(tmp_path)
    last = [r for r in records if r["kind"] == "train"][-1]
    assert last["compiles_after_warmup"] == 0 and last["recompiles_after_warmup"] == 0
    summary = records[-1]
    assert summary["skipped_nonfinite_loss"] == 1 and summary["steps"] == 6
    assert math.isfinite(summary["val_loss"])
