"""Quantization-aware training on the layers real models use, converted in place, with a report.

``quantize_layers`` turns ``nn.Linear``, Hugging Face's ``Conv1D`` (GPT-2's linear layers, weight
stored transposed) and ``nn.Conv1d/2d/3d`` into fake-quantizing twins: weights symmetric per
output channel, optionally inputs too. It returns which layers it converted and which weight
layers it left alone, and why; converting nothing is a warning.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from isotrain._shared import outside_stacklevel
from isotrain._torch_private import conv_forward
from isotrain.autograd._ste import _LSQ, Gradient, _check_bits, _check_gradient

__all__ = [
    "QuantConv1d",
    "QuantConv2d",
    "QuantConv3d",
    "QuantLinear",
    "QuantReport",
    "quantize_layers",
    "quantize_linear_layers",
]

log = logging.getLogger(__name__)


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

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bits={self.bits}, activations={self.activations}"  # type: ignore[misc]


class QuantLinear(_QAT, nn.Linear):
    """``nn.Linear`` whose forward fake-quantizes its weight and, optionally, its input.

    Weights: symmetric, per output channel, step ``absmax(row) / (2**(bits-1) - 1)``.
    Inputs (``activations=True``): the same, per token (over the last dim). Gradients are
    straight-through; absmax ranges clip nothing, so ``gradient="clipped"`` and ``"identity"``
    coincide (the option mirrors ``fake_quantize``). Same parameters and state-dict keys as
    ``nn.Linear``. Example::

        layer = QuantLinear(64, 32, bits=4, activations=True)
    """

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
        w = _absmax_fake_quant(self.weight, 1, self.qmax)  # steps: (out, 1)
        if self.activations:
            x = _absmax_fake_quant(x, -1, self.qmax)  # steps: (..., 1)
        return F.linear(x, w, self.bias)


class _QuantConv(_QAT):
    """A convolution whose weight is fake-quantized per output channel (and input per sample)."""

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
        weight: Tensor = self.weight  # type: ignore[attr-defined]
        w = _absmax_fake_quant(weight, tuple(range(1, weight.dim())), self.qmax)  # (out, 1, ...)
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


# NOTE [HF Conv1D]
# GPT-2 (and GPT-J-era code) in Hugging Face Transformers use `Conv1D`: a linear layer with its
# weight stored transposed, (in, out), computing addmm(bias, x, weight). isotrain does not import
# transformers, so the layer is recognised by shape (a class named Conv1D whose weight is
# (in, nf)) and gets a subclass made at conversion time; its output channels are the weight's
# columns. The subclass pickles as "this base class, quantized" (`__reduce_ex__`), so
# torch.save(model) / torch.load and copy.deepcopy work although it is not importable by name.
class _QuantConv1DBase(_QAT):
    """Forward of a quantized HF ``Conv1D`` (``y = x @ W + b`` with ``W`` of shape (in, out))."""

    _base: type[nn.Module]

    def forward(self, x: Tensor) -> Tensor:
        weight: Tensor = self.weight  # type: ignore[attr-defined]
        w = _absmax_fake_quant(weight, 0, self.qmax)  # steps: (1, out)
        if self.activations:
            x = _absmax_fake_quant(x, -1, self.qmax)
        flat = x.reshape(-1, x.shape[-1])  # (tokens, in)
        bias: Tensor | None = self.bias  # type: ignore[attr-defined]
        out = flat @ w if bias is None else torch.addmm(bias, flat, w)
        return out.view(*x.shape[:-1], w.shape[1])

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return (_new_quant_conv1d, (self._base,), self.__getstate__())  # type: ignore[attr-defined]


_CONV1D: dict[type[nn.Module], type[nn.Module]] = {}


def _quant_conv1d_class(base: type[nn.Module]) -> type[nn.Module]:
    made = _CONV1D.get(base)
    if made is None:
        made = type(f"Quant{base.__name__}", (_QuantConv1DBase, base), {"_base": base})
        _CONV1D[base] = made
    return made


def _new_quant_conv1d(base: type[nn.Module]) -> nn.Module:
    cls = _quant_conv1d_class(base)
    return cls.__new__(cls)


def _is_hf_conv1d(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return (
        type(m).__name__ == "Conv1D"
        and isinstance(w, Tensor)
        and w.dim() == 2
        and getattr(m, "nf", None) == w.shape[1]
    )


_LINEAR: dict[type[nn.Module], type[nn.Module]] = {nn.Linear: QuantLinear}
_CONV: dict[type[nn.Module], type[nn.Module]] = {
    nn.Conv1d: QuantConv1d,
    nn.Conv2d: QuantConv2d,
    nn.Conv3d: QuantConv3d,
}
_PLAIN = {q: p for p, q in (*_LINEAR.items(), *_CONV.items())}


def _classify(m: nn.Module) -> tuple[str, type[nn.Module] | None, type[nn.Module] | None, str]:
    """(kind, plain class, quantized class, why not) for a weight layer; kind "" for others."""
    cls = type(m)
    plain = _PLAIN.get(cls, cls)
    if plain in _LINEAR:
        return "linear", plain, _LINEAR[plain], ""
    if plain in _CONV:
        return "conv", plain, _CONV[plain], ""
    if isinstance(m, _QuantConv1DBase):
        return "linear", m._base, cls, ""
    if _is_hf_conv1d(m):
        return "linear", cls, _quant_conv1d_class(cls), ""
    if isinstance(m, nn.Linear):
        why = f"a subclass of nn.Linear ({cls.__name__}) whose forward may be bypassed"
        return "linear", None, None, why + " (nn.MultiheadAttention reads out_proj.weight)"
    if isinstance(m, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        return "conv", None, None, "a transposed convolution: not supported"
    if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return (
            "conv",
            None,
            None,
            f"a subclass of a convolution ({cls.__name__}) with its own forward",
        )
    if isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
        return "other", None, None, "an embedding (a lookup, not a product): kept in full precision"
    weight = m._parameters.get("weight") if hasattr(m, "_parameters") else None
    if isinstance(weight, Tensor) and weight.dim() >= 2:
        return "other", None, None, f"{cls.__name__}: no quantized twin for this layer"
    return "", None, None, ""


@dataclasses.dataclass(frozen=True)
class QuantReport:
    """Which layers ``quantize_layers`` converted, and the weight layers it left, with why.

    Example: ``report = quantize_layers(model, bits=8); print(report)``
    """

    converted: tuple[str, ...]
    skipped: tuple[tuple[str, str, str], ...]  # (name, layer type, reason)

    def __str__(self) -> str:
        lines = [f"quantized {len(self.converted)} layer(s), left {len(self.skipped)}"]
        lines += [f"  kept {name} ({kind}): {why}" for name, kind, why in self.skipped]
        return "\n".join(lines)


def _convert(
    model: nn.Module, opts: dict[str, Any], exclude: tuple[str, ...], kinds: tuple[str, ...]
) -> QuantReport:
    converted: list[str] = []
    skipped: list[tuple[str, str, str]] = []
    for name, module in model.named_modules():  # shared modules are visited once
        kind, plain, quant, why = _classify(module)
        if not kind:
            continue
        label = type(module).__name__ if plain is None else plain.__name__
        hit = next((p for p in exclude if fnmatch.fnmatchcase(name, p)), None)
        if quant is None or plain is None:
            skipped.append((name, label, why))
        elif hit is not None:
            module.__class__ = plain  # excluded now: back to full precision
            skipped.append((name, label, f"excluded by {hit!r}"))
        elif kind not in kinds:
            module.__class__ = plain
            skipped.append((name, label, f"a {kind} layer; kinds={kinds} leaves it out"))
        else:
            module.__class__ = quant
            module.configure(**opts)
            converted.append(name)
    return QuantReport(tuple(converted), tuple(skipped))


# NOTE [in-place QAT conversion]
# Conversion changes each layer's class (`module.__class__ = QuantLinear`, the mechanism
# torch.nn.utils.parametrize uses) instead of building new modules. The module object stays the
# same, so its Parameters, tied weights (a GPT LM head sharing the token embedding), hooks, an
# optimizer's param groups and state-dict keys all stay valid, and a snapshot loads into the
# unquantized model. Only layers whose forward isotrain knows change: subclasses may not use
# `forward` (nn.MultiheadAttention's out_proj does not). Convert before checkpointing and compile.
def quantize_layers(
    model: nn.Module,
    *,
    bits: int,
    activations: bool = False,
    gradient: Gradient = "clipped",
    exclude: Iterable[str] = (),
    kinds: Iterable[str] = ("linear", "conv"),
) -> QuantReport:
    """Make every ``nn.Linear``, HF ``Conv1D`` and ``nn.Conv1d/2d/3d`` of ``model`` fake-quantize
    its weights (per output channel) in place; returns what it converted and kept, and why.

    ``exclude`` holds fnmatch patterns of module names to keep in full precision; ``kinds``
    picks "linear" (Linear, Conv1D) and/or "conv". A second call reconfigures: afterwards
    exactly the chosen layers are quantized with the new options. Converting nothing warns.

    Example::

        report = quantize_layers(resnet, bits=4, exclude=["fc"])
        print(report)  # quantized 20 layer(s), left 1 / kept fc (Linear): excluded by 'fc'
    """
    _check_qat(bits, gradient)  # validate before touching any layer
    kinds = tuple(kinds)
    if not kinds or set(kinds) - {"linear", "conv"}:
        raise ValueError(f"kinds must hold 'linear' and/or 'conv', got {kinds!r}")
    patterns = (exclude,) if isinstance(exclude, str) else tuple(exclude)
    opts = {"bits": bits, "activations": activations, "gradient": gradient}
    report = _convert(model, opts, patterns, kinds)
    log.info("%s", report)
    if not report.converted:
        warnings.warn(
            f"quantization converted no layer of {type(model).__name__}: {report}",
            UserWarning,
            stacklevel=outside_stacklevel(),
        )
    return report


def quantize_linear_layers(
    model: nn.Module,
    *,
    bits: int,
    activations: bool = False,
    gradient: Gradient = "clipped",
    exclude: Iterable[str] = (),
) -> nn.Module:
    """``quantize_layers(..., kinds=("linear",))``: every ``nn.Linear`` and HF ``Conv1D``;
    returns ``model``. Converting nothing warns, with the reason for each layer kept.

    Example::

        quantize_linear_layers(gpt, bits=8, exclude=["lm_head"])
    """
    quantize_layers(
        model, bits=bits, activations=activations, gradient=gradient, exclude=exclude,
        kinds=("linear",),
    )  # fmt: skip
    return model
