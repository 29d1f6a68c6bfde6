"""The precision a run trains in: fp32, bf16, bf16-matmul (attention in fp32) or fp16, and
`--precision auto`, which times the model's own step in the first three and keeps the fastest.

`modes` maps each precision to its autocast context, `capability` says what the device offers
bf16 (read from the CPU's flags), `probe` times the steps within a budget, `cache` keeps the
results per machine, `choice` decides. Imports `config`, `parallel`, `model`, `environment`
and `files`; never `state`, `rundir`, `report` or anything above them.
"""

from isotrain.train.precision.cache import cache_key, cache_path
from isotrain.train.precision.capability import bf16_native, cpu_bf16
from isotrain.train.precision.choice import (
    WINS_BELOW,
    PrecisionChoice,
    choose_precision,
    decide,
    resolve_precision,
)
from isotrain.train.precision.modes import AUTOCAST, MODES, autocast_for
from isotrain.train.precision.probe import Measurement, measure, model_steps

__all__ = [
    "AUTOCAST",
    "MODES",
    "WINS_BELOW",
    "Measurement",
    "PrecisionChoice",
    "autocast_for",
    "bf16_native",
    "cache_key",
    "cache_path",
    "choose_precision",
    "cpu_bf16",
    "decide",
    "measure",
    "model_steps",
    "resolve_precision",
]
