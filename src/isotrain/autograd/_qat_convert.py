"""Quantization-aware training on the layers real models use, converted in place, with a report.

``quantize_layers`` turns ``nn.Linear`` (and subclasses keeping its forward), Hugging Face's
``Conv1D`` (GPT-2's linear layers, weight stored transposed), ``nn.Conv1d/2d/3d`` and
``nn.MultiheadAttention``'s input projections into fake-quantizing twins. Its report names
every floating-point parameter of two or more dimensions: converted, or kept with the reason;
converting nothing is a warning.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import warnings
from collections.abc import Iterable
from typing import Any

from torch import Tensor, nn

from isotrain._shared import outside_stacklevel
from isotrain.autograd._qat import (
    QuantConv1d,
    QuantConv2d,
    QuantConv3d,
    QuantLinear,
    _check_qat,
    _Made,
    install_reads,
    made_class,
    stored_tensors,
)
from isotrain.autograd._ste import Gradient

__all__ = ["QuantReport", "quantize_layers", "quantize_linear_layers"]

log = logging.getLogger(__name__)

_LINEAR: dict[type[nn.Module], type[nn.Module]] = {nn.Linear: QuantLinear}
_CONV: dict[type[nn.Module], type[nn.Module]] = {
    nn.Conv1d: QuantConv1d,
    nn.Conv2d: QuantConv2d,
    nn.Conv3d: QuantConv3d,
}
_PLAIN = {q: p for p, q in (*_LINEAR.items(), *_CONV.items())}
# Reasons a layer is kept that are the user's choice or by design, not a gap in coverage.
_CHOSEN = ("excluded by", "leaves it out", "an embedding")


def _stored_weight(m: nn.Module) -> Tensor | None:
    """`m`'s weight as stored, never composed (composing runs a parametrization's side
    effects): the Parameter, or a one-tensor parametrization's original."""
    stored = stored_tensors(m, "weight")
    return stored[0] if len(stored) == 1 else None


def _is_hf_conv1d(m: nn.Module, cls: type[nn.Module]) -> bool:
    w = _stored_weight(m)
    return (
        cls.__name__ == "Conv1D"
        and isinstance(w, Tensor)
        and w.dim() == 2
        and getattr(m, "nf", None) == w.shape[1]
    )


def _quant_params(m: nn.Module) -> tuple[str, ...]:
    """The weights a converted `m` quantizes."""
    if isinstance(m, nn.MultiheadAttention):
        names = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")
        return tuple(n for n in names if stored_tensors(m, n))
    return ("weight",)


_CONV_FORWARDS = (nn.Conv1d.forward, nn.Conv2d.forward, nn.Conv3d.forward)


def _classify(m: nn.Module) -> tuple[str, type[nn.Module] | None, type[nn.Module] | None, str]:
    """(kind, plain class, quantized class, why not) for a weight layer; kind "" for others."""
    cls = type(m)
    plain = m._base if isinstance(m, _Made) else _PLAIN.get(cls, cls)
    if plain in _LINEAR:
        return "linear", plain, _LINEAR[plain], ""
    if plain in _CONV:
        return "conv", plain, _CONV[plain], ""
    if _is_hf_conv1d(m, plain):
        return "linear", plain, made_class("conv1d", plain), ""
    if issubclass(plain, nn.Linear):
        if plain.forward is nn.Linear.forward:  # NOTE [quantized reads] covers direct reads
            return "linear", plain, made_class("linear", plain), ""
        return (
            "linear",
            None,
            None,
            f"a subclass of nn.Linear ({cls.__name__}) with its own forward",
        )
    if issubclass(plain, nn.MultiheadAttention) and plain.forward is nn.MultiheadAttention.forward:
        return "linear", plain, made_class("attention", plain), ""
    if issubclass(plain, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        return "conv", None, None, "a transposed convolution: not supported"
    if issubclass(plain, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        if plain.forward in _CONV_FORWARDS:  # torch's ParametrizedConv2d, for one
            return "conv", plain, made_class("conv", plain), ""
        return (
            "conv",
            None,
            None,
            f"a subclass of a convolution ({cls.__name__}) with its own forward",
        )
    if issubclass(plain, (nn.Embedding, nn.EmbeddingBag)):
        return "other", None, None, "an embedding (a lookup, not a product): kept in full precision"
    weight = _stored_weight(m)
    if isinstance(weight, Tensor) and weight.dim() >= 2:
        return "other", None, None, f"{cls.__name__}: no quantized twin for this layer"
    return "", None, None, ""


@dataclasses.dataclass(frozen=True)
class QuantReport:
    """Which layers ``quantize_layers`` converted, and the weights it left, with why: every
    floating-point parameter of two or more dimensions is in one or the other.

    Example: ``report = quantize_layers(model, bits=8); print(report)``
    """

    converted: tuple[str, ...]
    skipped: tuple[tuple[str, str, str], ...]  # (name, layer type, reason)

    @property
    def unsupported(self) -> tuple[tuple[str, str, str], ...]:
        """Kept entries no option converts (not excluded, not an embedding, not a kind left out)."""
        return tuple(s for s in self.skipped if not any(c in s[2] for c in _CHOSEN))

    def __str__(self) -> str:
        lines = [f"quantized {len(self.converted)} layer(s), left {len(self.skipped)}"]
        if self.converted:
            more = len(self.converted) - 8
            lines.append(f"  converted {', '.join(self.converted[:8])}")
            lines[-1] += f" ... (+{more} more)" if more > 0 else ""
        lines += [f"  kept {name} ({kind}): {why}" for name, kind, why in self.skipped]
        return "\n".join(lines)


def _param_reason(module: nn.Module, p: Tensor) -> str:
    if isinstance(module, nn.RNNBase):
        return (
            "a recurrent weight: the fused RNN kernel reads it through _flat_weights, so no "
            "quantized read reaches it; kept in full precision"
        )
    return (
        f"a {p.dim()}-D parameter of {type(module).__name__} (an expert or custom weight) that "
        "no converted layer reads; fake-quantize it where the forward uses it "
        "(isotrain.autograd.fake_quantize)"
    )


def _unwrapped_name(name: str) -> str:
    """`name` without torch.compile's `_orig_mod` level: the model's own names, for `exclude`."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def _uncovered(model: nn.Module, covered: set[int]) -> list[tuple[str, str, str]]:
    """Kept entries for the float parameters (ndim >= 2) no layer entry accounts for."""
    out = []
    for name, module in model.named_modules():
        for pname, p in module._parameters.items():
            if p is None or id(p) in covered or not p.is_floating_point() or p.dim() < 2:
                continue
            covered.add(id(p))  # a tied parameter is reported once
            full = _unwrapped_name(f"{name}.{pname}" if name else pname)
            out.append((full, type(module).__name__, _param_reason(module, p)))
    return out


def _convert(
    model: nn.Module, opts: dict[str, Any], exclude: tuple[str, ...], kinds: tuple[str, ...]
) -> QuantReport:
    converted: list[str] = []
    skipped: list[tuple[str, str, str]] = []
    covered: set[int] = set()
    for wrapped, module in model.named_modules():  # shared modules are visited once
        name = _unwrapped_name(wrapped)
        kind, plain, quant, why = _classify(module)
        if not kind:
            continue
        covered |= {id(t) for n in _quant_params(module) for t in stored_tensors(module, n)}
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
    if converted:
        install_reads(model)  # NOTE [quantized reads]
    skipped += _uncovered(model, covered)
    return QuantReport(tuple(converted), tuple(skipped))


# NOTE [in-place QAT conversion]
# Conversion changes each layer's class (`module.__class__ = QuantLinear`, the mechanism
# torch.nn.utils.parametrize uses) instead of building new modules. The module object stays the
# same, so its Parameters, tied weights (a GPT LM head sharing the token embedding), hooks, an
# optimizer's param groups and state-dict keys all stay valid, and a snapshot loads into the
# unquantized model. A layer whose weights the model reads itself is covered by quantized reads
# (NOTE [quantized reads]). Convert before checkpointing and compile.
def quantize_layers(
    model: nn.Module,
    *,
    bits: int,
    activations: bool = False,
    gradient: Gradient = "clipped",
    exclude: Iterable[str] = (),
    kinds: Iterable[str] = ("linear", "conv"),
) -> QuantReport:
    """Make every ``nn.Linear``, HF ``Conv1D``, ``nn.Conv1d/2d/3d`` and attention input
    projection of ``model`` fake-quantize its weights (per output channel) in place; returns
    what it converted and what it kept, and why.

    ``exclude`` holds fnmatch patterns of module names to keep in full precision; ``kinds``
    picks "linear" (Linear, Conv1D, attention) and/or "conv". A second call reconfigures:
    afterwards exactly the chosen layers are quantized with the new options. Converting
    nothing warns. Inside the model's forwards, ``layer.weight`` reads are quantized too.

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
    """``quantize_layers(..., kinds=("linear",))``: every ``nn.Linear``, HF ``Conv1D`` and
    attention projection; returns ``model``. It warns when it converts nothing, and, since it
    returns no report, when it keeps weights no option converts, naming them.

    Example::

        quantize_linear_layers(gpt, bits=8, exclude=["lm_head"])
    """
    report = quantize_layers(
        model, bits=bits, activations=activations, gradient=gradient, exclude=exclude,
        kinds=("linear",),
    )  # fmt: skip
    left = report.unsupported
    if report.converted and left:
        named = "; ".join(f"{n} ({kind}): {why}" for n, kind, why in left[:4])
        warnings.warn(
            f"quantize_linear_layers converted {len(report.converted)} layer(s) of "
            f"{type(model).__name__} but left {len(left)} weight(s) in full precision that it "
            f"cannot convert: {named}{' ...' if len(left) > 4 else ''}. quantize_layers "
            "returns the whole report",
            UserWarning,
            stacklevel=outside_stacklevel(),
        )
    return model
