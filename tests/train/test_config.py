"""Config: help on every field, precedence preset < TOML < flags, validation messages."""

import ast
import dataclasses
import inspect
import itertools
import operator

import pytest

from isotrain.train import config as C
from isotrain.train import rules as R
from isotrain.train.cli.main import parse_train_args
from isotrain.train.model import shape as model_module
from isotrain.train.weights.load import build_model


def _sections() -> list[type]:
    return [C.TrainConfig] + [
        type(getattr(C.TrainConfig(), f.name))
        for f in dataclasses.fields(C.TrainConfig)
        if f.name in C.TrainConfig().__dict__
        and dataclasses.is_dataclass(getattr(C.TrainConfig(), f.name))
    ]


def test_every_field_has_help_text() -> None:
    documented: dict[str, set[str]] = {}
    trees = [ast.parse(inspect.getsource(m)) for m in (C, model_module)]
    for cls in (n for t in trees for n in t.body if isinstance(n, ast.ClassDef)):
        body, names = cls.body, set()
        for a, b in itertools.pairwise(body):
            if (
                isinstance(a, ast.AnnAssign)
                and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant)
            ):
                names.add(a.target.id)
        documented[cls.name] = names
    for cls in _sections():
        for f in dataclasses.fields(cls):
            value = getattr(cls(), f.name)
            if dataclasses.is_dataclass(value):
                assert type(value).__doc__, f"section {f.name} needs a class docstring"
            else:
                assert f.name in documented[cls.__name__], f"{cls.__name__}.{f.name} has no help"


PRESET_VALUES = {
    "tiny": {
        **{"model.n_layer": 4, "model.n_head": 4, "model.d_model": 128, "model.block_size": 128},
        **{"model.dropout": 0.0, "data.batch_size": 16, "data.max_bytes": 4_000_000},
        **{"optim.lr": 4e-3, "optim.min_lr": 2e-4, "optim.warmup_steps": 50},
        **{"steps": 1000, "eval_every": 500, "eval_batches": 256, "log_every": 10},
        **{"sample_tokens": 200, "progress": True},
    },
    "small": {
        **{"model.n_layer": 6, "model.n_head": 6, "model.d_model": 384, "model.block_size": 256},
        **{"model.dropout": 0.1, "data.batch_size": 16, "data.max_bytes": 4_000_000},
        **{"optim.lr": 1e-3, "optim.min_lr": 1e-4, "optim.warmup_steps": 100},
        **{"steps": 2000, "eval_every": 250, "eval_batches": 256, "log_every": 10},
        **{"sample_tokens": 200, "progress": True},
    },
    "smoke": {
        **{"model.n_layer": 2, "model.n_head": 2, "model.d_model": 32, "model.block_size": 32},
        **{"model.dropout": 0.0, "data.batch_size": 4, "data.max_bytes": 200_000},
        **{"optim.lr": 2e-3, "optim.min_lr": 2e-4, "optim.warmup_steps": 2},
        **{"steps": 8, "eval_every": 4, "eval_batches": 2, "log_every": 2},
        **{"sample_tokens": 16, "progress": True, "snapshot.every": 0},
    },
    "speedrun": {
        **{"model.n_layer": 4, "model.n_head": 4, "model.d_model": 128, "model.block_size": 128},
        **{"model.positions": "rotary", "model.qk_norm": True, "model.activation": "relu2"},
        **{"model.tie_head": True, "model.zero_init": False, "optim.name": "muon"},
        **{"data.batch_size": 16, "optim.lr": 4e-3, "optim.warmup_steps": 50, "steps": 250},
    },
}


def _gpt_params(n_layer: int, d: int, block_size: int, vocab: int) -> int:
    """GPT parameters from its shapes: embeddings (head tied), blocks, final LayerNorm."""
    per_block = (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d) + 4 * d
    return vocab * d + block_size * d + n_layer * per_block + 2 * d


@pytest.mark.parametrize("name", sorted(PRESET_VALUES))
def test_presets_have_their_values_and_build_their_model(name: str) -> None:
    assert sorted(C.PRESETS) == sorted(PRESET_VALUES)
    cfg = R.validate(C.PRESETS[name]())
    values = {path: operator.attrgetter(path)(cfg) for path in PRESET_VALUES[name]}
    assert values == PRESET_VALUES[name]
    m = cfg.model
    model = build_model(cfg.model)
    n = model.num_params(non_embedding=False)
    n_gpt2 = _gpt_params(m.n_layer, m.d_model, m.block_size, m.vocab_size)
    untied = 0 if m.tie_head else m.vocab_size * m.d_model
    rotary = m.block_size * m.d_model if m.positions == "rotary" else 0
    assert n == n_gpt2 + untied - rotary
    if name == "tiny":  # its docstring: "about 0.8M parameters" (without position embeddings)
        assert abs(model.num_params() - 0.8e6) < 0.05e6


def test_flags_override_toml_which_overrides_preset(tmp_path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text("steps = 7\n[model]\nd_model = 64\nn_head = 2\n[data]\nbuckets = [16, 32]\n")
    cfg = parse_train_args(["--preset", "smoke", "--config", str(toml), "--steps", "9"])
    assert cfg.steps == 9 and cfg.model.d_model == 64 and cfg.model.n_head == 2
    assert cfg.data.buckets == (16, 32)
    assert cfg.model.n_layer == C.PRESETS["smoke"]().model.n_layer


def test_toml_unknown_key_and_missing_file(tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nwidth = 3\n")
    with pytest.raises(C.ConfigError, match="unknown setting 'model.width'"):
        C.apply_toml(C.TrainConfig(), bad)
    with pytest.raises(C.ConfigError, match="--config /nope.toml: no such file"):
        C.apply_toml(C.TrainConfig(), "/nope.toml")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"model": C.ModelConfig(d_model=130, n_head=4)},
            "--model.d-model 130 is invalid: it must be divisible by --model.n-head (4); "
            "try --model.d-model 128",
        ),
        ({"steps": -5}, "--steps -5 is invalid: it must be a positive integer; try --steps 1000"),
        (
            {"optim": C.OptimConfig(lr=0.0)},
            "--optim.lr 0.0 is invalid: the learning rate must be positive; try --optim.lr 0.004",
        ),
        (
            {"optim": C.OptimConfig(lr=1e-3, min_lr=1e-2)},
            "--optim.min-lr 0.01 is invalid: use 0 <= min_lr <= lr; try --optim.min-lr 0.0001",
        ),
        (
            {"model": C.ModelConfig(dropout=1.0)},
            "--model.dropout 1.0 is invalid: use [0, 1); try --model.dropout 0.0",
        ),
        (
            {"data": C.DataConfig(buckets=(64, 512))},
            "--data.buckets 64 512 is invalid: every bucket must be in 1..--model.block-size "
            "(128); try --data.buckets 64 128",
        ),
        (
            {"data": C.DataConfig(buckets=(64, 32))},
            "--data.buckets 64 32 is invalid: list the lengths in increasing order, without "
            "repeats; try --data.buckets 32 64",
        ),
        (
            {"quant": C.QuantConfig(bits=32)},
            "--quant.bits 32 is invalid: use 0 (off) or 1..16; try --quant.bits 0",
        ),
        # types, from the annotations, whatever the source (here: Python)
        ({"steps": True}, "--steps True is invalid: it must be an integer; try --steps 1000"),
        (
            {"precision": "fp8"},
            "--precision 'fp8' is invalid: it must be one of 'auto', 'fp32', "
            "'bf16', 'bf16-matmul', 'fp16'; try --precision auto",
        ),
        (
            {"model": C.ModelConfig(bias=1)},
            "--model.bias 1 is invalid: it must be true or false; try --model.bias",
        ),
        (
            {"optim": C.OptimConfig(lr=float("nan"))},
            "--optim.lr nan is invalid: it must be a finite number; try --optim.lr 0.004",
        ),
        (
            {"data": C.DataConfig(path=3)},
            "--data.path 3 is invalid: it must be a string or nothing; try --data.path None",
        ),
        (
            {"guard": C.GuardConfig(inject_nan_at=(1.5,))},
            "--guard.inject-nan-at (1.5,) is invalid: it must be a list of integers; "
            "try --guard.inject-nan-at",
        ),
    ],
)
def test_validation_names_flag_value_and_fix(changes, message) -> None:
    with pytest.raises(C.ConfigError) as info:
        R.validate(dataclasses.replace(C.TrainConfig(), **changes))
    assert str(info.value) == message


def test_every_field_type_is_one_the_checker_knows() -> None:
    """Each field's default fits its own annotation, and its type reads as words: a field of
    a new type cannot slip past the TOML and flag checks unnoticed."""
    from isotrain.train.fields import describe, hints, matches

    for cls in _sections():
        for f in dataclasses.fields(cls):
            value = getattr(cls(), f.name)
            if dataclasses.is_dataclass(value):
                continue
            hint = hints(cls)[f.name]
            assert matches(value, hint), (cls.__name__, f.name)
            assert "<" not in describe(hint) and "typing" not in describe(hint), describe(hint)
