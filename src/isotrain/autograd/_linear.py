"""bf16 linear layers at full speed on CPUs without native bf16 (AVX2-only x86).

There, PyTorch multiplies bf16 matrices in a portable kernel whose speed depends on how the
operands lie in memory, and ``nn.Linear`` under CPU autocast hits its slow layouts: the
backward's ``mm`` runs about 17x below the best layout. ``bf16_linear`` is a custom autograd
Function whose forward and backward copy each operand into the fast layout first (a copy is
O(n^2) against the O(n^3) product), so training with ``torch.autocast("cpu", torch.bfloat16)``
gets several times faster (benchmarks/results/avx2/mfu.md). The products are one opaque custom op
(``isotrain::layout_mm``), so the layouts survive ``torch.compile``. Values and gradients stay
those of bf16 matmuls with fp32 accumulation; parameters and their gradients keep their dtype.
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import register_flop_formula

from isotrain.autograd._cpu import native_bf16_matmul

__all__ = ["Bf16Linear", "bf16_linear", "bf16_linear_layers"]

# NOTE [bf16 operand layouts]
# bf16 C = A @ B on an AVX2 AMD EPYC, torch 2.13, one thread (the peak table of
# benchmarks/results/avx2/mfu.md measures every order at square and GPT-layer shapes):
#   A row-major, B row-major   slowest, ~1 GFLOP/s (autograd's mm in nn.Linear's backward)
#   A row-major, B col-major   ~10x that           (F.linear's forward: x @ W.T)
#   A col-major, B row-major   ~15-20x that        (the order used here)
#   A col-major, B col-major   as slow as the first
# Each product below is arranged as (column-major A) @ (row-major B):
#   forward   y  = x @ W.T  -> A = x copied to column-major, B = W.T copied to row-major
#   backward  dx = g @ W    -> A = g copied to column-major, B = W (row-major already)
#             dW = (x.T @ g).T with A = x.T (column-major view of the saved x), B = g
# Every operand reaches the op already in bf16: the casts (W.T cast and laid out in one copy,
# the bias, the gradient) are ops of their own before it, as autocast's are before `mm`, so
# what runs in bf16 shows at op level. The op itself refuses operands of mixed dtypes.
# The saved tensors are the bf16 input (as autocast's linear saves) and the parameter
# itself, so activation memory is the same as nn.Linear under autocast. CPUs that run bf16
# through oneDNN (AVX512 or AMX) are fast in every layout; `native_bf16_matmul()` says so and
# `bf16_linear_layers` then changes nothing. fp16 has a different fast layout and is left to
# PyTorch.


def _column_major(x: Tensor) -> Tensor:
    """`x` (2-D) stored column-major: one copy unless it already is."""
    if x.stride() == (1, x.shape[0]):
        return x
    return x.t().contiguous().t()


def _row_major(x: Tensor, dtype: torch.dtype) -> Tensor:
    """`x` (2-D) cast to `dtype`, stored row-major (no copy when it already is)."""
    return x.to(dtype, memory_format=torch.contiguous_format)


def _one_dtype(a: Tensor, b: Tensor, bias: Tensor | None) -> None:
    """Refuse mixed dtypes: a cast inside the op would hide from op-level dtype checks."""
    dtypes = {a.dtype, b.dtype} | ({bias.dtype} if bias is not None else set())
    if len(dtypes) > 1:
        got = ", ".join(str(t.dtype) for t in (a, b, bias) if t is not None)
        raise ValueError(
            f"isotrain::layout_mm takes a, b and bias in one dtype, got {got}: cast them "
            "before the op (NOTE [bf16 operand layouts])"
        )


def _layout_mm_kernel(a: Tensor, b: Tensor, bias: Tensor | None) -> Tensor:
    # (bias +) a @ b, with a column-major and b row-major: NOTE [bf16 operand layouts]
    _one_dtype(a, b, bias)
    a, b = _column_major(a), b.contiguous()
    return torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)


def _layout_mm_fake(a: Tensor, b: Tensor, bias: Tensor | None) -> Tensor:
    _one_dtype(a, b, bias)
    return a.new_empty((a.shape[0], b.shape[1]))


def _layout_mm_flops(a_shape: Any, b_shape: Any, *args: Any, **kwargs: Any) -> int:
    # FlopCounterMode counts the op as the mm it is (MFU figures stay right).
    (m, k), (_, n) = a_shape, b_shape
    return 2 * m * k * n


def _raw_layout_mm(a: Tensor, b: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.isotrain.layout_mm(a, b, bias)


# NOTE [layout_mm under vmap]
# `_LayoutLinear` lets torch.func.vmap derive its batching rule (generate_vmap_rule) by running
# forward and backward on batched tensors, so the custom op needs a batching rule of its own.
# When only `a` is batched (a batch of inputs through one layer, and grad_x), the samples'
# rows stack into one product: (B, m, k) -> (B*m, k) @ (k, n), still in the fast layouts.
# When `b` or the bias is per sample (per-sample weight gradients: x.T @ g), the rule runs
# one product per sample.
def _layout_mm_vmap(
    info: Any, in_dims: tuple[int | None, ...], a: Tensor, b: Tensor, bias: Tensor | None
) -> tuple[Tensor, int]:
    a_dim, b_dim, bias_dim = in_dims
    if a_dim is not None and b_dim is None and bias_dim is None:
        a = a.movedim(a_dim, 0)  # (B, m, k)
        return _raw_layout_mm(a.flatten(0, 1), b, bias).unflatten(0, a.shape[:2]), 0  # (B, m, n)

    def pick(t: Tensor, dim: int | None, i: int) -> Tensor:
        return t if dim is None else t.select(dim, i)

    outs = [
        _raw_layout_mm(
            pick(a, a_dim, i),
            pick(b, b_dim, i),
            None if bias is None else pick(bias, bias_dim, i),
        )
        for i in range(info.batch_size)
    ]
    return torch.stack(outs), 0  # (B, m, n)


# The products are one opaque custom op (the `NOTE [custom op template]` pattern in
# autograd_ops): under torch.compile, inductor would otherwise fold the layout copies away and
# pick its own operand order, losing the speed-up. Defined once per process, like
# isotrain::fake_quant.
if not hasattr(torch.ops.isotrain, "layout_mm"):
    _op = torch.library.custom_op("isotrain::layout_mm", _layout_mm_kernel, mutates_args=())
    _op.register_fake(_layout_mm_fake)
    _op.register_vmap(_layout_mm_vmap)
    register_flop_formula(torch.ops.isotrain.layout_mm)(_layout_mm_flops)


class _LayoutMM(torch.autograd.Function):
    """isotrain::layout_mm with its gradient, usable under torch.func (`grad` of `grad` too).

    The op has no registered autograd: an op's register_autograd fails under torch.func.grad
    in torch <= 2.13 (NOTE [custom op template], step 6), and `_LayoutLinear.backward` calls
    the op on tensors that require grad there. Its products are layout_mm again.
    """

    generate_vmap_rule = True  # NOTE [layout_mm under vmap]

    @staticmethod
    def forward(a: Tensor, b: Tensor, bias: Tensor | None) -> Tensor:
        return _raw_layout_mm(a, b, bias)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        a, b, bias = inputs
        ctx.save_for_backward(a, b)
        ctx.bias_dtype = None if bias is None else bias.dtype

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        a, b = ctx.saved_tensors  # (m, k), (k, n); grad (m, n) in a's dtype
        grad_a = grad_b = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_a = _layout_mm(grad, b.t())
        if ctx.needs_input_grad[1]:
            grad_b = _layout_mm(a.t(), grad).to(b.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            acc = torch.promote_types(grad.dtype, torch.float32)  # fp32 or wider
            grad_bias = grad.sum(0, dtype=acc).to(ctx.bias_dtype)
        return grad_a, grad_b, grad_bias


def _layout_mm(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    """(bias +) a @ b in a's dtype, operands in the fast layouts: NOTE [bf16 operand layouts]."""
    return _LayoutMM.apply(a, b, bias)


class _LayoutLinear(torch.autograd.Function):
    """(x @ W.T + b in `dtype`, x as (N, in) in `dtype`): each matmul in the fast layout.

    The second output is the input that backward needs; it is returned only so that
    `setup_context` can save it without casting `x` again (`bf16_linear` drops it).
    """

    generate_vmap_rule = True  # NOTE [layout_mm under vmap]

    @staticmethod
    def forward(
        x: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        x_lp = _row_major(x.reshape(-1, x.shape[-1]), dtype)  # (N, in)
        w_t = _row_major(weight.t(), dtype)  # (in, out): cast and laid out in one copy
        out = _layout_mm(x_lp, w_t, None if bias is None else bias.to(dtype))  # (N, out)
        return out.view(*x.shape[:-1], weight.shape[0]), x_lp

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        x, weight, bias, _ = inputs
        x_lp = output[1]
        ctx.mark_non_differentiable(x_lp)
        ctx.save_for_backward(x_lp, weight)
        ctx.lead, ctx.has_bias = x.shape[:-1], bias is not None

    @staticmethod
    def backward(ctx: Any, grad: Tensor, _grad_x_lp: Tensor | None) -> tuple[Tensor | None, ...]:
        x_lp, weight = ctx.saved_tensors
        g = _row_major(grad.reshape(-1, grad.shape[-1]), x_lp.dtype)  # (N, out)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            w_lp = _row_major(weight, x_lp.dtype)  # (out, in)
            grad_x = _layout_mm(g, w_lp).view(*ctx.lead, weight.shape[1])
        if ctx.needs_input_grad[1]:
            grad_w = _row_major(_layout_mm(x_lp.t(), g).t(), weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0, dtype=torch.float32).to(weight.dtype)
        return grad_x, grad_w, grad_b, None


def _bf16_compute(x: Tensor) -> bool:
    """Whether a linear on `x` would compute in bf16 on the CPU (autocast or bf16 input)."""
    if x.device.type != "cpu":
        return False
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu") == torch.bfloat16
    return x.dtype == torch.bfloat16


def bf16_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` that takes the fast bf16 layouts when it computes in bf16 on the CPU.

    Elsewhere (fp32, fp16, CUDA) it is ``F.linear`` itself. Example::

        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = bf16_linear(x, layer.weight, layer.bias)
    """
    if not _bf16_compute(x):
        return F.linear(x, weight, bias)
    with torch.autocast("cpu", enabled=False):
        return _LayoutLinear.apply(x, weight, bias, torch.bfloat16)[0]


class Bf16Linear(nn.Linear):
    """``nn.Linear`` whose bf16 CPU path is ``bf16_linear``; same parameters, same keys.

    Example::

        layer = Bf16Linear(384, 1536)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
    """

    def forward(self, x: Tensor) -> Tensor:
        return bf16_linear(x, self.weight, self.bias)


def bf16_linear_layers(model: nn.Module, *, force: bool = False) -> nn.Module:
    """Turn every exact ``nn.Linear`` of ``model`` into ``Bf16Linear`` in place; return it.

    Does nothing where ``native_bf16_matmul()`` (unless ``force``). Like
    ``quantize_linear_layers`` it swaps the class, so parameters, tied weights, hooks and
    state-dict keys stay as they were. Example::

        bf16_linear_layers(gpt)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = gpt(x, y)
    """
    if force or not native_bf16_matmul():
        for module in model.modules():
            if type(module) is nn.Linear:
                module.__class__ = Bf16Linear
    return model
