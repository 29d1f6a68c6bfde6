"""A weights file's model config and tensors, checked before any model is built.

The config a file carries (an export's metadata, a GPT-2 `config.json`) passes the CLI's own
rules (`rules.RULES`, the field types): `d_model -32` or `n_head 0` is one line naming the
file. Then every tensor the config implies is compared by name and shape with the file's
header, computed on the meta device: a 141 kB file whose config asks for 825 GB of weights is
refused before a byte of them is allocated.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

import torch

from isotrain.train.config import ModelConfig
from isotrain.train.fields import check_value, coerce, hints
from isotrain.train.model.gpt import GPT
from isotrain.train.rules import RULES
from isotrain.train.weights.header import FLOAT_DTYPES, TensorEntry, WeightsFileError, json_kind

__all__ = ["check_tensors", "isotrain_shapes", "model_config"]


def _shown(value: Any) -> str:
    """`value` as JSON writes it, cut to 40 characters."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def model_config(
    raw: Any, source: str, *, fix: str, names: Mapping[str, str] | None = None
) -> ModelConfig:
    """`raw` (JSON from a file) as a ModelConfig, checked as the CLI checks `--model.*`: known
    keys, types, ranges, d_model divisible by n_head. `names`: the file's own key names."""
    names = names or {}
    if not isinstance(raw, dict):
        raise WeightsFileError(f"{source}: the model config is a JSON {json_kind(raw)}; {fix}")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise WeightsFileError(
            f"{source}: unknown model setting {unknown[0]!r} (known: {', '.join(sorted(fields))})"
            f"; {fix}"
        )
    values = {}
    for key, value in raw.items():
        hint = hints(ModelConfig)[key]
        why = check_value(value, hint)
        rule = RULES.get(f"model.{key}")
        if why is None and rule is not None and not rule[0](value):
            why = rule[1]
        if why is not None:
            raise WeightsFileError(
                f"{source}: {names.get(key, key)} {_shown(value)} is invalid: {why}; {fix}"
            )
        values[key] = coerce(value, hint)
    cfg = ModelConfig(**values)
    if cfg.d_model % cfg.n_head:
        d, h = names.get("d_model", "d_model"), names.get("n_head", "n_head")
        raise WeightsFileError(
            f"{source}: {d} {cfg.d_model} is invalid: it must be divisible by {h} "
            f"({cfg.n_head}); {fix}"
        )
    return cfg


def isotrain_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in `GPT(cfg)`'s state dict, built on the meta device."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in GPT(cfg).state_dict().items()}


def check_tensors(
    source: str,
    found: Mapping[str, TensorEntry],
    cfg: ModelConfig,
    *,
    shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]],
    ties: tuple[str, str],
    ignore: Callable[[str], bool] = lambda name: False,
) -> None:
    """Every tensor `shapes(cfg)` names is in the file with its shape and a float dtype, and
    nothing else is (but what `ignore` picks); of the tied pair one suffices."""
    seen = {name: t for name, t in found.items() if not ignore(name)}
    if cfg.n_layer > len(seen):  # bounds the meta model too: a block holds several tensors
        raise WeightsFileError(
            f"{source}: the model config asks for {cfg.n_layer} blocks, but the file holds "
            f"{len(seen)} tensors; is the config the one these weights were saved with?"
        )
    expected = shapes(cfg)
    for name, t in seen.items():
        if name not in expected:
            raise WeightsFileError(
                f"{source}: tensor {name!r} has no place in the model its config describes; "
                "is the config the one these weights were saved with?"
            )
        if t.shape != expected[name]:
            raise WeightsFileError(
                f"{source}: tensor {name!r} has shape {list(t.shape)}, but the model config "
                f"needs {list(expected[name])}; is the config the one these weights were saved "
                "with?"
            )
        if t.dtype not in FLOAT_DTYPES:
            raise WeightsFileError(
                f"{source}: tensor {name!r} is {t.dtype}; weights must be one of "
                f"{', '.join(FLOAT_DTYPES)}"
            )
    missing = set(expected) - set(seen)
    if set(ties) & set(seen):  # one name of the tied matrix holds it
        missing -= set(ties)
    if missing:
        raise WeightsFileError(
            f"{source}: {len(missing)} tensors of the model its config describes are missing "
            f"(first: {sorted(missing)[0]!r}); is it a complete checkpoint?"
        )
