"""QAT coverage: every weight matrix is in the report, weights read directly (functional calls,
fused attention, TransformerEncoderLayer's eval fast path) are quantized, nothing silent."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations, parametrize

from isotrain.autograd import QuantLinear, quantize_layers, quantize_linear_layers
from isotrain.autograd._qat import _absmax_fake_quant
from isotrain.checkpointing import apply_activation_checkpointing
from isotrain.compile import compile_model


class MoE(nn.Module):
    """Experts stored as one 3-D parameter, as mixture-of-experts layers often do."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 2)
        self.experts = nn.Parameter(torch.randn(2, 8, 8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.router(x).softmax(-1)  # (B, T, E)
        return torch.einsum("bte,eio,bti->bto", gate, self.experts, x)


class Zoo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.moe = MoE()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x, x, x, need_weights=False)[0]
        x = self.lstm(x)[0]
        return self.fc(self.moe(x))


def test_the_report_names_every_weight_matrix() -> None:
    model = Zoo()
    report = quantize_layers(model, bits=8)
    assert report.converted == ("attn", "attn.out_proj", "moe.router", "fc")
    kept = {name: why for name, _, why in report.skipped}
    assert set(kept) == {"lstm.weight_ih_l0", "lstm.weight_hh_l0", "moe.experts"}
    assert kept["lstm.weight_ih_l0"].startswith("a recurrent weight: the fused RNN kernel")
    assert kept["moe.experts"].startswith("a 3-D parameter of MoE (an expert or custom weight)")
    # Every floating-point parameter of 2+ dims is accounted for, by its module or by name.
    quantized = {"attn.in_proj_weight", *(f"{n}.weight" for n in report.converted[1:])}
    matrices = {n for n, p in model.named_parameters() if p.is_floating_point() and p.dim() >= 2}
    assert matrices == quantized | set(kept)


def test_attention_reads_its_projections_quantized_and_state_survives(tmp_path) -> None:
    torch.manual_seed(0)
    model, x = Zoo(), torch.randn(2, 5, 8)
    plain, keys = model(x), list(model.state_dict())
    quantize_layers(model, bits=3)
    attn = model.attn
    assert type(attn).__name__ == "QuantMultiheadAttention"
    assert attn.in_proj_weight is attn._parameters["in_proj_weight"]  # outside forward: as-is
    out = model(x)
    assert not torch.allclose(out, plain, atol=1e-3) and list(model.state_dict()) == keys
    out.sum().backward()
    assert attn.in_proj_weight.grad is not None and attn.out_proj.weight.grad is not None
    torch.save(model, tmp_path / "q.pt")
    for twin in (torch.load(tmp_path / "q.pt", weights_only=False), copy.deepcopy(model)):
        assert type(twin.attn) is type(attn) and torch.equal(twin(x), out)
    quantize_layers(model, bits=3, exclude=["attn*"])
    assert type(model.attn) is nn.MultiheadAttention
    assert type(model.attn.out_proj).__name__ == "NonDynamicallyQuantizableLinear"


def test_encoder_fast_path_runs_the_quantized_weights() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True).eval()
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        fp32 = layer(x)  # the fused fast path: weights read directly
    quantize_layers(layer, bits=4)
    with torch.no_grad():
        fast = layer(x)
    slow = layer(x)  # parameters need grad: the module-by-module path
    assert not torch.equal(fast, fp32)
    assert (fast - fp32).abs().max() > 1e-3  # 4-bit weights move the output visibly
    torch.testing.assert_close(fast, slow.detach(), atol=1e-5, rtol=1e-5)


class Functional(nn.Module):
    """Reads its linear layer's weight itself, as F.linear(x, layer.weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.fc.weight, self.fc.bias).tanh()


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Functional() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_functional_reads_are_quantized_eager_and_compiled() -> None:
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(3, 8)
    plain = model(x)
    quantize_layers(model, bits=3)
    want = x
    for block in model.blocks:  # per output row, 3 bits: qmax 3
        want = F.linear(want, _absmax_fake_quant(block.fc.weight, 1, 3), block.fc.bias).tanh()
    out = model(x)
    fc = model.blocks[0].fc
    assert torch.equal(out, want) and not torch.allclose(out, plain, atol=1e-3)
    assert fc.weight is fc._parameters["weight"]  # tying, init and .grad see the Parameter
    out.square().sum().backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    apply_activation_checkpointing(model, policy="full")  # backward recomputes: reads again
    model(x).square().sum().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want_grads, strict=True))
    torch._dynamo.reset()
    try:
        compile_model(model, backend="eager")
        torch.testing.assert_close(model(x), want)
    finally:
        torch._dynamo.reset()


class OwnLinear(nn.Module):
    """A linear layer that is not an nn.Linear (an adapter library's, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


def test_quantize_linear_layers_names_the_layers_it_cannot_convert() -> None:
    model = nn.Sequential(OwnLinear(), OwnLinear(), nn.Linear(8, 2))
    said = r"converted 1 layer\(s\) of Sequential but left 2 weight\(s\) .* 0 \(OwnLinear\)"
    with pytest.warns(UserWarning, match=said):
        quantize_linear_layers(model, bits=8)
    assert type(model[2]) is QuantLinear
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # excluded and embedding layers are choices: no warning
        quantize_linear_layers(nn.Sequential(nn.Embedding(4, 8), nn.Linear(8, 2)), bits=8)


# --------------------------------------------------------------------- parametrized layers
class Symmetric(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return (w + w.T) / 2

    def right_inverse(self, w: torch.Tensor) -> torch.Tensor:
        return w  # exact for a symmetric w


class LowRankDelta(nn.Module):
    """A LoRA-style parametrization: the weight plus a learned low-rank product."""

    def __init__(self, out: int, inp: int) -> None:
        super().__init__()
        self.a, self.b = nn.Parameter(torch.randn(2, inp)), nn.Parameter(torch.randn(out, 2))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + self.b @ self.a


def _parametrized() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.Flatten(), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 8)
    )
    parametrizations.weight_norm(model[0])
    parametrize.register_parametrization(model[2], "weight", Symmetric())
    parametrizations.spectral_norm(model[3])  # power iteration: buffers advance per read
    parametrize.register_parametrization(model[4], "weight", LowRankDelta(8, 16))
    return model


def _by_hand(model: nn.Sequential, x: torch.Tensor, qmax: int) -> torch.Tensor:
    """The converted forward spelled out: each composed weight read once, then quantized."""
    conv = model[0]
    w = _absmax_fake_quant(conv.weight, (1, 2, 3), qmax)
    x = F.conv2d(x, w, conv.bias).flatten(1)
    for layer in model[2:]:
        x = F.linear(x, _absmax_fake_quant(layer.weight, 1, qmax), layer.bias)
    return x


def test_parametrized_layers_quantize_the_composed_weight() -> None:
    model, x = _parametrized(), torch.randn(3, 2, 4, 4)
    twin = copy.deepcopy(model)
    report = quantize_layers(model, bits=4)
    assert report.converted == ("0", "2", "3", "4") and report.skipped == ()
    out = model(x)
    want = _by_hand(twin, x, qmax=7)
    assert torch.equal(out, want)
    out.square().sum().backward()
    want.square().sum().backward()
    grads = [(n, p.grad) for n, p in model.named_parameters()]
    assert len(grads) == 11 and all(g is not None for _, g in grads)  # originals, a, b, biases
    assert all(torch.equal(g, q.grad) for (_, g), q in zip(grads, twin.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), twin.buffers(), strict=True))
    sym = model[2]  # outside forwards: the composed weight; assignment via right_inverse
    assert torch.equal(sym.weight, twin[2].weight)
    sym.weight = torch.eye(16)
    assert torch.equal(sym.parametrizations.weight.original, torch.eye(16))
    quantize_layers(model, bits=4, exclude=["2"])
    assert type(model[2]) is type(twin[2]) and torch.equal(model[2].weight, torch.eye(16))
