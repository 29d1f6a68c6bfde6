"""QAT coverage: every weight matrix is in the report, weights read directly (functional calls,
fused attention, TransformerEncoderLayer's eval fast path) are quantized, nothing silent."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

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
