"""Straight-through estimators, Gumbel-softmax sampling and learned step-size quantization.

Every function here is a ``torch.autograd.Function`` in the ``setup_context`` style, so it
works in eager mode, under ``torch.compile(fullgraph=True)`` and under ``torch.func``
(``grad``, ``vmap``). The fused custom-op variant and the QAT layers live in
``_ops``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor, nn

__all__ = [
    "LSQQuantizer",
    "StraightThroughEstimator",
    "fake_quantize",
    "gumbel_softmax_st",
    "lsq_quantize",
    "quantize",
    "round_ste",
    "sign_ste",
]

Gradient = Literal["clipped", "identity"]
_MAX_BITS = 16

# NOTE [straight-through estimators]
# Rounding, sign and argmax have zero gradient almost everywhere, so a network that uses them
# in the forward pass cannot learn through them. A straight-through estimator (STE, Bengio et
# al. 2013) keeps the discrete forward value and substitutes a surrogate gradient backward:
# the identity (``quantize``, ``round_ste``), the identity clipped to the representable range
# (``fake_quantize(gradient="clipped")``, LSQ), the hardtanh derivative (``sign_ste``) or the
# gradient of a soft relaxation (``gumbel_softmax_st``). Writing them as Functions rather than
# ``x + (q - x).detach()`` saves one full-size temporary per call and states the surrogate in
# one readable ``backward``. All validation reads Python numbers only, never tensor values, so
# it costs no host-device sync and traces cleanly under torch.compile.


def _check_int(value: object, name: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a Python int, got {type(value).__name__} {value!r}.")
    if value < low or (high is not None and value > high):
        span = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ValueError(f"{name} must be {span}, got {value}; pick a value in that range.")
    return value


def _check_bits(bits: object) -> int:
    return _check_int(bits, "bits", 1, _MAX_BITS)


def _check_gradient(gradient: str) -> bool:
    """Return True for the clipped STE, False for the identity STE."""
    if gradient not in ("clipped", "identity"):
        raise ValueError(f"gradient must be 'clipped' or 'identity', got {gradient!r}.")
    return gradient == "clipped"


def _check_range(lo: float | Tensor, hi: float | Tensor) -> None:
    # Tensor bounds are never read (that would be a host sync); Python numbers are checked.
    if isinstance(lo, Tensor) or isinstance(hi, Tensor):
        return
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo >= hi:
        raise ValueError(
            f"fake-quantization range must satisfy lo < hi with finite bounds, got lo={lo}, "
            f"hi={hi}; swap or widen the bounds."
        )


class StraightThroughEstimator(torch.autograd.Function):
    """Round ``x`` to ``n_levels`` evenly spaced levels of [0, 1]; pass the gradient unchanged.

    Values outside [0, 1] are rounded on the same grid, not clamped (use ``fake_quantize``
    to clamp). Example::

        y = quantize(torch.rand(4, 16, requires_grad=True))      # 256 levels
        y4 = quantize(x, 4)                                       # {0, 1/3, 2/3, 1}
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, n_levels: int = 256) -> Tensor:
        scale = _check_int(n_levels, "n_levels", 2) - 1
        return torch.round(x * scale) / scale

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        pass  # the identity surrogate needs nothing saved

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None  # None for the int n_levels


quantize = StraightThroughEstimator.apply


class _RoundSTE(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return torch.round(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


def round_ste(x: Tensor) -> Tensor:
    """Round to the nearest integer (ties to even); the gradient passes through unchanged.

    Example: ``codes = round_ste(x * 127)`` keeps ``x`` trainable through integer codes.
    """
    return _RoundSTE.apply(x)


class _SignSTE(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return torch.where(x < 0, -torch.ones_like(x), torch.ones_like(x))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return torch.where(x.abs() <= 1, grad, torch.zeros_like(grad))  # hardtanh'


def sign_ste(x: Tensor) -> Tensor:
    """Binarize to {-1, +1} (zero maps to +1) with the hardtanh gradient: 1 where |x| <= 1.

    Example (BinaryConnect-style weights): ``F.linear(x, sign_ste(layer.weight))``.
    """
    return _SignSTE.apply(x)


class _FakeQuant(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(
        x: Tensor, lo: float | Tensor, hi: float | Tensor, n_levels: int, clipped: bool
    ) -> Tensor:
        step = (hi - lo) / (n_levels - 1)
        return torch.round((x.clamp(lo, hi) - lo) / step) * step + lo  # type: ignore[arg-type]

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        x, lo, hi, _, clipped = inputs
        ctx.clipped = clipped
        if clipped:  # tensor bounds are saved, Python bounds kept on ctx
            ctx.bounds = [None if isinstance(b, Tensor) else b for b in (lo, hi)]
            ctx.save_for_backward(x, *(b if isinstance(b, Tensor) else None for b in (lo, hi)))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        if not ctx.clipped:
            return grad, None, None, None, None
        x, lo_t, hi_t = ctx.saved_tensors
        lo = lo_t if lo_t is not None else ctx.bounds[0]
        hi = hi_t if hi_t is not None else ctx.bounds[1]
        inside = (x >= lo) & (x <= hi)
        grad_x = torch.where(inside, grad, torch.zeros_like(grad)).sum_to_size(x.shape)
        return grad_x, None, None, None, None


def fake_quantize(
    x: Tensor,
    *,
    bits: int,
    lo: float | Tensor,
    hi: float | Tensor,
    gradient: Gradient = "clipped",
) -> Tensor:
    """Quantize-dequantize ``x`` to ``2**bits`` evenly spaced levels of [lo, hi] (both included).

    Straight-through backward: ``gradient="clipped"`` zeroes the gradient where ``x`` lies
    outside [lo, hi]; ``"identity"`` passes it everywhere. Tensor bounds (e.g. per channel)
    broadcast against ``x`` and are treated as constants. Example::

        y = fake_quantize(x, bits=4, lo=-1.0, hi=1.0)   # 16 levels, grad 0 where |x| > 1
    """
    clipped = _check_gradient(gradient)
    _check_range(lo, hi)
    if isinstance(lo, Tensor) != isinstance(hi, Tensor):  # clamp wants both or neither
        ref = lo if isinstance(lo, Tensor) else hi
        assert isinstance(ref, Tensor)  # one of the two is a tensor here
        lo, hi = (torch.as_tensor(b, dtype=ref.dtype, device=ref.device) for b in (lo, hi))
    return _FakeQuant.apply(x, lo, hi, 2 ** _check_bits(bits), clipped)


class _OneHotST(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(soft: Tensor, dim: int) -> Tensor:
        index = soft.argmax(dim, keepdim=True)
        return torch.zeros_like(soft).scatter_(dim, index, 1.0)  # exact one-hot

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None  # the soft sample's gradient


def gumbel_softmax_st(
    logits: Tensor,
    *,
    tau: float = 1.0,
    hard: bool = True,
    dim: int = -1,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Sample from softmax(logits) with Gumbel noise; one-hot forward, soft gradient backward.

    ``generator`` seeds the noise (eager only: Dynamo cannot trace a ``torch.Generator``);
    without it the global RNG is used, which compiles. ``hard=False`` returns the relaxed
    sample. Example::

        g = torch.Generator().manual_seed(0)
        onehot = gumbel_softmax_st(logits, tau=0.5, generator=g)   # (B, K), rows one-hot
    """
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0:
        raise ValueError(f"tau must be a positive temperature, got {tau!r}; try tau=1.0.")
    # Gumbel(0, 1) = -log(Exp(1)); clamp so an exact 0 from the sampler cannot give inf.
    exp = torch.empty_like(logits).exponential_(generator=generator)
    gumbels = -exp.clamp_min(torch.finfo(exp.dtype).tiny).log()
    soft = ((logits + gumbels) / tau).softmax(dim)
    return _OneHotST.apply(soft, dim) if hard else soft


class _LSQ(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(
        x: Tensor, scale: Tensor, qn: int, qp: int, grad_scale: float, clipped: bool
    ) -> Tensor:
        return torch.round((x / scale).clamp(-qn, qp)) * scale

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        x, scale, ctx.qn, ctx.qp, ctx.grad_scale, ctx.clipped = inputs
        ctx.save_for_backward(x, scale)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, scale = ctx.saved_tensors
        v = x / scale
        inside = (v >= -ctx.qn) & (v <= ctx.qp)
        zero = torch.zeros_like(grad)
        grad_x = grad_s = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.where(inside, grad, zero) if ctx.clipped else grad
            grad_x = grad_x.sum_to_size(x.shape)
        if ctx.needs_input_grad[1]:
            # Esser et al. 2020, eq. 3: d v_hat / d s
            outside = torch.where(v < 0, -ctx.qn, ctx.qp).to(v.dtype)
            dv_ds = torch.where(inside, torch.round(v) - v, outside)
            grad_s = (grad * dv_ds * ctx.grad_scale).sum_to_size(scale.shape)
        return grad_x, grad_s, None, None, None, None


def _lsq_bounds(bits: int, signed: bool) -> tuple[int, int]:
    bits = _check_bits(bits)
    if signed and bits < 2:
        raise ValueError("signed LSQ needs bits >= 2 (1 bit has no positive level); use bits=2.")
    return (2 ** (bits - 1), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)


def lsq_quantize(
    x: Tensor, scale: Tensor, *, bits: int, signed: bool = True, grad_scale: float = 1.0
) -> Tensor:
    """Learned step-size quantization (LSQ, Esser et al. 2020): ``round(clamp(x/s)) * s``.

    ``x`` gets the clipped straight-through gradient; ``scale`` (positive, broadcastable to
    ``x``) gets the paper's gradient times ``grad_scale``. Example::

        s = torch.tensor(0.05, requires_grad=True)
        y = lsq_quantize(w, s, bits=4)     # 16 signed levels {-8..7} * s
    """
    qn, qp = _lsq_bounds(bits, signed)
    return _LSQ.apply(x, scale, qn, qp, float(grad_scale), True)


class LSQQuantizer(nn.Module):
    """LSQ fake-quantizer with a learned step size and the paper's gradient scaling.

    ``shape`` is the step's shape, broadcastable to the input: ``()`` per tensor,
    ``(out_features, 1)`` per output channel of a weight. Example::

        q = LSQQuantizer(bits=4, shape=(64, 1))
        q.init_scale_(layer.weight)          # s = 2 mean|x| / sqrt(Q_P), from the paper
        w_q = q(layer.weight)
    """

    def __init__(
        self, *, bits: int, signed: bool = True, shape: tuple[int, ...] = (), init: float = 1.0
    ) -> None:
        super().__init__()
        self.qn, self.qp = _lsq_bounds(bits, signed)
        self.bits, self.signed = bits, signed
        self.scale = nn.Parameter(torch.full(shape, float(init)))

    @torch.no_grad()
    def init_scale_(self, x: Tensor) -> None:
        """Set the step to ``2 * mean(|x|) / sqrt(Q_P)`` per scale element (LSQ's init)."""
        per_scale = x.numel() // self.scale.numel()
        mean_abs = x.detach().abs().sum_to_size(self.scale.shape) / per_scale
        self.scale.copy_(2 * mean_abs / math.sqrt(self.qp))

    def forward(self, x: Tensor) -> Tensor:
        # g = 1 / sqrt(N * Q_P), N = elements sharing one step: keeps step updates in scale.
        grad_scale = 1.0 / math.sqrt(x.numel() / self.scale.numel() * self.qp)
        return _LSQ.apply(x, self.scale, self.qn, self.qp, grad_scale, True)

    def extra_repr(self) -> str:
        return f"bits={self.bits}, signed={self.signed}, shape={tuple(self.scale.shape)}"
