"""Fake-quantizing layers: ``QuantLinear``, ``QuantConv1d/2d/3d``, HF ``Conv1D``'s twin, and
quantized reads of their weights wherever the converted model reads them.

Weights are symmetric per output channel, optionally inputs too; ``_qat_convert`` converts a
model's layers in place and reports what it did.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize

from isotrain._torch_private import conv_forward, in_backward
from isotrain.autograd._ste import _LSQ, Gradient, _check_bits, _check_gradient

__all__ = [
    "QuantConv1d",
    "QuantConv2d",
    "QuantConv3d",
    "QuantLinear",
    "install_reads",
    "made_class",
    "stored_tensors",
]


def _absmax_fake_quant(t: Tensor, dims: int | tuple[int, ...], qmax: int) -> Tensor:
    # Symmetric levels {-qmax..qmax} * s, s = absmax / qmax over `dims`: a detached statistic,
    # so no gradient flows into the scale, and zero is exact. The range holds every value, so
    # the STE is the identity (a float test of |t / s| <= qmax would wrongly clip the maximum).
    amax = t.detach().abs().amax(dim=dims, keepdim=True)
    scale = (amax / qmax).clamp_min(torch.finfo(t.dtype).tiny)  # all-zero rows stay zero
    return _LSQ.apply(t, scale, qmax, qmax, 0.0, False)


def _check_qat(bits: int, gradient: str) -> None:
    _check_gradient(gradient)
    if _check_bits(bits) < 2:
        raise ValueError(
            "QuantLinear needs bits >= 2 (symmetric levels need a positive one); "
            "for binary weights use isotrain.autograd.sign_ste."
        )


# NOTE [quantized reads]
# A converted layer is quantized when called as `layer(x)`, but models also read weights
# themselves: a functional call on `layer.weight`, nn.MultiheadAttention handing
# `out_proj.weight` and `in_proj_weight` to its kernel, nn.TransformerEncoderLayer's fused
# eval/no_grad fast path reading every weight of the layer at once. So each quantized class
# turns its weights into properties: inside a forward of the converted model (the module given
# to quantize_layers), and in backward (a checkpointed block's recompute), `layer.weight` is the
# fake-quantized weight; elsewhere it is the Parameter itself, so initialisation, `.grad`,
# weight tying (`head.weight is emb.weight`), optimizers and state-dict keys see what they
# always did. A pair of hooks on that module (`install_reads`) counts into `_READING`; only
# there, never inside blocks: compiled checkpointed blocks must not mutate Python state. The
# count is process-wide: while such a forward runs, reads from other threads are quantized too.
_READING = [0]  # > 0 while a forward marked by install_reads runs


class _Enter:
    """Forward pre-hook: quantized reads on (NOTE [quantized reads])."""

    def __call__(self, module: nn.Module, args: Any) -> None:
        _READING[0] += 1


class _Exit:
    """Forward hook, called on errors too: quantized reads off again once no forward runs."""

    def __call__(self, module: nn.Module, args: Any, out: Any) -> None:
        _READING[0] = max(_READING[0] - 1, 0)


def install_reads(module: nn.Module) -> None:
    """Mark `module`'s forwards as ones that read converted weights quantized (once)."""
    if not any(isinstance(h, _Enter) for h in module._forward_pre_hooks.values()):
        module.register_forward_pre_hook(_Enter())
        module.register_forward_hook(_Exit(), always_call=True)


# NOTE [parametrized layers]
# torch.nn.utils.parametrize moves a layer's weight to `parametrizations.weight.original*` and
# gives the layer's class a property that composes it (weight_norm's g and v, orthogonal,
# spectral_norm, a LoRA delta). A converted parametrized layer quantizes that composed weight
# where the forward reads it, once per read as the plain layer composes it once per read (the
# parametrization's buffers advance as they would unconverted; `parametrize.cached()` holds);
# outside forwards `layer.weight` is the composed weight, and assigning to it goes to the
# parametrization's right_inverse, as before conversion. The report counts the originals
# (and any parameters of the parametrizations) as the layer's: they are what it reads.
_OWN_READS: set[int] = set()  # ids of the properties `_quantized_read` made


def _composed(module: nn.Module, name: str) -> property | None:
    """The property torch.nn.utils.parametrize put on `module`'s class for `name`, or None."""
    for cls in type(module).__mro__:
        prop = cls.__dict__.get(name)
        if isinstance(prop, property) and id(prop) not in _OWN_READS:
            return prop
    return None


def stored_tensors(module: nn.Module, name: str) -> list[Tensor]:
    """The Parameters behind `module.<name>`: itself, or a parametrization's originals and
    parameters (NOTE [parametrized layers]); empty when there is none."""
    p = module._parameters.get(name)
    if p is not None:
        return [p]
    if parametrize.is_parametrized(module, name):
        return list(module.parametrizations[name].parameters())  # type: ignore[index, union-attr]
    return []


def _quantized_read(name: str) -> property:
    def read(self: Any) -> Tensor | None:
        p = self.raw(name)
        if p is None or not (_READING[0] or in_backward()):
            return p
        return self.fake_quantized(p)

    def write(self: Any, value: Tensor) -> None:
        prop = _composed(self, name)  # NOTE [parametrized layers]: right_inverse
        if prop is None or prop.fset is None:
            raise AttributeError(f"cannot assign {name!r} of {type(self).__name__}")
        prop.fset(self, value)

    made = property(
        read, write, doc=f"`{name}`, fake-quantized inside forwards: NOTE [quantized reads]"
    )
    _OWN_READS.add(id(made))
    return made


class _QAT:
    """Options shared by the quantized layers (plain attributes: nothing enters the state dict)."""

    bits: int = 8
    activations: bool = False
    gradient: Gradient = "clipped"

    def configure(
        self, *, bits: int, activations: bool = False, gradient: Gradient = "clipped"
    ) -> Any:
        """Set the quantization options; returns the layer."""
        _check_qat(bits, gradient)
        self.bits, self.activations, self.gradient = bits, bool(activations), gradient
        return self

    @property
    def qmax(self) -> int:
        return int(2 ** (self.bits - 1) - 1)

    def _steps_over(self, w: Tensor) -> int | tuple[int, ...]:
        """Dims one step is shared over: all but the output channel (dim 0)."""
        return tuple(range(1, w.dim()))

    def raw(self, name: str) -> Tensor | None:
        """Parameter `name`, or the weight its parametrization composes (NOTE [parametrized
        layers]); AttributeError while it is not registered yet (hasattr in register_parameter)."""
        params: dict[str, Tensor | None] = self._parameters  # type: ignore[attr-defined]
        if name in params:
            return params[name]
        prop = _composed(self, name)  # type: ignore[arg-type]
        if prop is None or prop.fget is None:
            raise AttributeError(name)
        value: Tensor = prop.fget(self)
        return value

    def fake_quantized(self, raw: Tensor) -> Tensor:
        """`raw` fake-quantized per output channel."""
        return _absmax_fake_quant(raw, self._steps_over(raw), self.qmax)

    def quantized(self, name: str) -> Tensor:
        """Weight `name` fake-quantized per output channel (read from the parameter itself, or
        composed by its parametrization)."""
        raw = self.raw(name)
        if raw is None:
            raise AttributeError(f"{type(self).__name__} has no {name!r} to quantize")
        return self.fake_quantized(raw)

    def extra_repr(self) -> str:
        base = super().extra_repr()  # type: ignore[misc]
        return f"{base + ', ' if base else ''}bits={self.bits}, activations={self.activations}"


class QuantLinear(_QAT, nn.Linear):
    """``nn.Linear`` whose forward fake-quantizes its weight and, optionally, its input.

    Weights: symmetric, per output channel, step ``absmax(row) / (2**(bits-1) - 1)``.
    Inputs (``activations=True``): the same, per token (over the last dim). Gradients are
    straight-through; absmax ranges clip nothing, so ``gradient="clipped"`` and ``"identity"``
    coincide (the option mirrors ``fake_quantize``). Same parameters and state-dict keys as
    ``nn.Linear``; ``.weight`` read inside a forward of a converted model is the quantized
    weight too (NOTE [quantized reads]). Example::

        layer = QuantLinear(64, 32, bits=4, activations=True)
    """

    weight = _quantized_read("weight")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bits: int = 8,
        activations: bool = False,
        gradient: Gradient = "clipped",
    ) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self.configure(bits=bits, activations=activations, gradient=gradient)

    def forward(self, x: Tensor) -> Tensor:
        w = self.quantized("weight")  # steps: (out, 1)
        if self.activations:
            x = _absmax_fake_quant(x, -1, self.qmax)  # steps: (..., 1)
        return F.linear(x, w, self.bias)


class _QuantConv(_QAT):
    """A convolution whose weight is fake-quantized per output channel (and input per sample)."""

    weight = _quantized_read("weight")

    def __init__(
        self,
        *args: Any,
        bits: int = 8,
        activations: bool = False,
        gradient: Gradient = "clipped",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.configure(bits=bits, activations=activations, gradient=gradient)

    def forward(self, x: Tensor) -> Tensor:
        w = self.quantized("weight")  # (out, 1, ...)
        if self.activations:
            x = _absmax_fake_quant(x, tuple(range(1, x.dim())), self.qmax)  # per sample
        return conv_forward(self, x, w)  # type: ignore[arg-type]


class QuantConv1d(_QuantConv, nn.Conv1d):
    """``nn.Conv1d`` fake-quantizing its weight per output channel.

    Example: ``QuantConv1d(4, 8, 3, bits=4)``
    """


class QuantConv2d(_QuantConv, nn.Conv2d):
    """``nn.Conv2d`` fake-quantizing its weight per output channel.

    Example: ``QuantConv2d(3, 16, 3, bits=8)``
    """


class QuantConv3d(_QuantConv, nn.Conv3d):
    """``nn.Conv3d`` fake-quantizing its weight per output channel.

    Example: ``QuantConv3d(1, 4, 3, bits=8)``
    """


# NOTE [made classes]
# Some layers get a quantized class made at conversion time, a subclass of the model's own
# class: HF's `Conv1D` (isotrain does not import transformers), subclasses of nn.Linear that
# keep its forward (nn.MultiheadAttention's out_proj), nn.MultiheadAttention itself. A made
# class pickles as "this base class, quantized this way" (`__reduce_ex__`), so torch.save /
# torch.load and copy.deepcopy work although it is not importable by name.
class _Made(_QAT):
    """Base of the classes made at conversion time (NOTE [made classes])."""

    _base: type[nn.Module]
    _how: str

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return (_new_made, (self._how, self._base), self.__getstate__())  # type: ignore[attr-defined]


# NOTE [HF Conv1D]
# GPT-2 (and GPT-J-era code) in Hugging Face Transformers use `Conv1D`: a linear layer with its
# weight stored transposed, (in, out), computing addmm(bias, x, weight). It is recognised by
# shape (a class named Conv1D whose weight is (in, nf)); its output channels are the columns.
class _QuantConv1DBase(_Made):
    """Forward of a quantized HF ``Conv1D`` (``y = x @ W + b`` with ``W`` of shape (in, out))."""

    weight = _quantized_read("weight")

    def _steps_over(self, w: Tensor) -> int | tuple[int, ...]:
        return 0  # steps: (1, out)

    def forward(self, x: Tensor) -> Tensor:
        w = self.quantized("weight")
        if self.activations:
            x = _absmax_fake_quant(x, -1, self.qmax)
        flat = x.reshape(-1, x.shape[-1])  # (tokens, in)
        bias: Tensor | None = self.bias  # type: ignore[attr-defined]
        out = flat @ w if bias is None else torch.addmm(bias, flat, w)
        return out.view(*x.shape[:-1], w.shape[1])


class _QuantLinearSub(_Made, QuantLinear):
    """A subclass of nn.Linear that keeps its forward (MultiheadAttention's out_proj, torch's
    ParametrizedLinear)."""


class _QuantConvSub(_Made, _QuantConv):
    """A subclass of nn.Conv1d/2d/3d that keeps its forward (torch's ParametrizedConv2d)."""


class _QuantAttention(_Made):
    """nn.MultiheadAttention with its input projections quantized where its forward (or the
    fused fast path of a TransformerEncoderLayer) reads them: NOTE [quantized reads]."""

    in_proj_weight = _quantized_read("in_proj_weight")
    q_proj_weight = _quantized_read("q_proj_weight")
    k_proj_weight = _quantized_read("k_proj_weight")
    v_proj_weight = _quantized_read("v_proj_weight")


_MIXINS: dict[str, type[_Made]] = {
    "conv1d": _QuantConv1DBase,
    "linear": _QuantLinearSub,
    "conv": _QuantConvSub,
    "attention": _QuantAttention,
}
_MADE: dict[tuple[str, type[nn.Module]], type[nn.Module]] = {}


def made_class(how: str, base: type[nn.Module]) -> type[nn.Module]:
    """The quantized subclass of `base` made the `how` way (one per pair, reused)."""
    made = _MADE.get((how, base))
    if made is None:
        attrs = {"_base": base, "_how": how}
        made = type(f"Quant{base.__name__}", (_MIXINS[how], base), attrs)
        _MADE[(how, base)] = made
    return made


def _new_made(how: str, base: type[nn.Module]) -> nn.Module:
    cls = made_class(how, base)
    return cls.__new__(cls)
