"""Custom autograd: straight-through estimators, a compile-safe custom op, QAT and bf16 layers.

Every Function uses the ``setup_context`` style, so it works eager, under
``torch.compile(fullgraph=True)`` and under ``torch.func`` (``grad``, ``vmap``). This
``__init__`` is the package's whole public API; the ``_``-modules behind it are private.
"""

from isotrain.autograd._cpu import (
    CPU_KIND_ENV,
    CPU_KINDS,
    cpu_flags,
    cpu_model,
    forced_cpu_kind,
    native_bf16_matmul,
)
from isotrain.autograd._linear import Bf16Linear, bf16_linear, bf16_linear_layers
from isotrain.autograd._ops import fused_fake_quantize
from isotrain.autograd._qat import QuantConv1d, QuantConv2d, QuantConv3d, QuantLinear
from isotrain.autograd._qat_convert import QuantReport, quantize_layers, quantize_linear_layers
from isotrain.autograd._ste import (
    LSQQuantizer,
    StraightThroughEstimator,
    fake_quantize,
    gumbel_softmax_st,
    lsq_quantize,
    quantize,
    round_ste,
    sign_ste,
)

__all__ = [
    "CPU_KINDS",
    "CPU_KIND_ENV",
    "Bf16Linear",
    "LSQQuantizer",
    "QuantConv1d",
    "QuantConv2d",
    "QuantConv3d",
    "QuantLinear",
    "QuantReport",
    "StraightThroughEstimator",
    "bf16_linear",
    "bf16_linear_layers",
    "cpu_flags",
    "cpu_model",
    "fake_quantize",
    "forced_cpu_kind",
    "fused_fake_quantize",
    "gumbel_softmax_st",
    "lsq_quantize",
    "native_bf16_matmul",
    "quantize",
    "quantize_layers",
    "quantize_linear_layers",
    "round_ste",
    "sign_ste",
]
