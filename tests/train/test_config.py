"""Config: help on every field, precedence preset < TOML < flags, validation messages."""

import ast
import dataclasses
import inspect
import itertools

import pytest

from isotrain.train import config as C
from isotrain.train import model as model_module
from isotrain.train.cli import parse_train_args


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


def test_presets_validate() -> None:
    for name, preset in C.PRESETS.items():
        assert C.validate(preset()) is not None, name


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
            r"--model.d-model 130 is invalid: it must be divisible by --model.n-head \(4\); try",
        ),
        ({"steps": -5}, r"--steps -5 is invalid: it must be a positive integer"),
        (
            {"optim": C.OptimConfig(lr=0.0)},
            r"--optim.lr 0.0 is invalid: the learning rate must be positive",
        ),
        ({"model": C.ModelConfig(dropout=1.0)}, r"--model.dropout 1.0 is invalid"),
        (
            {"data": C.DataConfig(buckets=(64, 512))},
            r"--data.buckets \(64, 512\) is invalid: every bucket",
        ),
        ({"quant": C.QuantConfig(bits=32)}, r"--quant.bits 32 is invalid"),
    ],
)
def test_validation_names_flag_value_and_fix(changes, message) -> None:
    with pytest.raises(C.ConfigError, match=message):
        C.validate(dataclasses.replace(C.TrainConfig(), **changes))
