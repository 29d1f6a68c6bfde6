"""A fused fake-quantize ``torch.library.custom_op`` and quantization-aware training layers.

``fused_fake_quantize`` is the compile-safe custom-op twin of ``isotrain.autograd.fake_quantize``
and the template for wrapping your own kernel. Quantization-aware training layers are in `_qat`.
"""

from typing import Any

import torch
from torch import Tensor

from isotrain.autograd._ste import Gradient, _check_bits, _check_gradient, _check_range

__all__ = ["fused_fake_quantize"]

# NOTE [custom op template]
# To make your own kernel (CUDA, Triton, a C++ extension, or a fused composite as here)
# differentiable and safe under torch.compile(fullgraph=True), copy this section and replace
# `_fake_quant_kernel`:
# 1. `torch.library.custom_op("ns::name", fn, mutates_args=())` makes `fn` an opaque
#    operator: Dynamo and AOTAutograd never trace inside it, so the kernel may launch Triton
#    or call C++, and the compiled graph holds a single node. Put configuration in
#    int/float/bool arguments; outputs must be new tensors, never views of the inputs.
# 2. `register_fake` returns outputs with the right shape/dtype/device/strides without
#    computing anything: compile and FakeTensor tracing call it. It must not read data.
# 3. `register_autograd(backward, setup_context=...)` attaches the gradient. `backward` must
#    itself be traceable: PyTorch ops, or your backward kernel registered the same way
#    (e.g. "ns::name_backward"). Return one gradient per input, None for non-tensors.
# 4. `register_vmap` (optional) enables torch.func.vmap; an elementwise op keeps the batch dim.
# 5. Test with `torch.library.opcheck(op, sample_args)` (schema, fake tensor, autograd
#    registration, AOT dispatch) and a fullgraph compile: tests/test_autograd.py does both.
# 6. torch.func.grad rejects ops whose autograd comes from register_autograd in torch <= 2.13
#    (pytorch#168393, #170834: the generated Function lacks setup_context). The entry point
#    therefore applies the op through `_FuncBridge`, a setup_context-style autograd.Function
#    that reuses the very same `_setup_context` and `_backward`; drop it once fixed upstream.
# Cost: inductor cannot fuse across an opaque op. Wrap code that already is one fused kernel;
# a composite of PyTorch ops (like this one) runs faster as a traceable autograd.Function
# (benchmarks/results/avx2/autograd.md measures both).
# An operator name can be defined once per process, so `_register` first checks whether it
# exists: re-importing or `importlib.reload` of this module is then harmless.

_NAMESPACE, _NAME = "isotrain", "fake_quant"


def _fake_quant_kernel(x: Tensor, lo: float, hi: float, n_levels: int, clipped: bool) -> Tensor:
    # The "kernel": any implementation with the same contract can go here.
    step = (hi - lo) / (n_levels - 1)
    return torch.round((x.clamp(lo, hi) - lo) / step) * step + lo


def _fake_quant_fake(x: Tensor, lo: float, hi: float, n_levels: int, clipped: bool) -> Tensor:
    return torch.empty_like(x)  # elementwise: same metadata as x


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    x, ctx.lo, ctx.hi, _, ctx.clipped = inputs
    ctx.save_for_backward(x if ctx.clipped else None)


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    if ctx.clipped:  # straight through inside [lo, hi], zero outside
        (x,) = ctx.saved_tensors
        grad = torch.where((x >= ctx.lo) & (x <= ctx.hi), grad, torch.zeros_like(grad))
    return grad, None, None, None, None


def _vmap(info: Any, in_dims: tuple[Any, ...], x: Tensor, *args: Any) -> tuple[Tensor, Any]:
    return torch.ops.isotrain.fake_quant(x, *args), in_dims[0]  # elementwise: same batch dim


def _register() -> None:
    if hasattr(getattr(torch.ops, _NAMESPACE), _NAME):  # defined earlier in this process
        return
    op = torch.library.custom_op(f"{_NAMESPACE}::{_NAME}", _fake_quant_kernel, mutates_args=())
    op.register_fake(_fake_quant_fake)
    op.register_autograd(_backward, setup_context=_setup_context)
    op.register_vmap(_vmap)


_register()


class _FuncBridge(torch.autograd.Function):
    # See NOTE [custom op template], step 6. Same op forward, same registered backward.
    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, lo: float, hi: float, n_levels: int, clipped: bool) -> Tensor:
        return torch.ops.isotrain.fake_quant(x, lo, hi, n_levels, clipped)

    setup_context = staticmethod(_setup_context)
    backward = staticmethod(_backward)


def fused_fake_quantize(
    x: Tensor, *, bits: int, lo: float, hi: float, gradient: Gradient = "clipped"
) -> Tensor:
    """``fake_quantize`` as one opaque ``isotrain::fake_quant`` op (same values, same gradient).

    Bounds are Python floats. Example::

        y = fused_fake_quantize(x, bits=8, lo=-4.0, hi=4.0)
        torch.compile(lambda t: fused_fake_quantize(t, bits=4, lo=0.0, hi=1.0), fullgraph=True)
    """
    clipped = _check_gradient(gradient)
    if isinstance(lo, Tensor) or isinstance(hi, Tensor):
        raise TypeError(
            "fused_fake_quantize takes Python float bounds; for tensor bounds use "
            "isotrain.autograd.fake_quantize."
        )
    _check_range(lo, hi)
    n_levels = 2 ** _check_bits(bits)
    return _FuncBridge.apply(x, float(lo), float(hi), n_levels, clipped)
