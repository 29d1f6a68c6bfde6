"""The layout-aware bf16 linear (exact gradients, bf16 values, saved bytes, conversion, compile)
and quantization-aware training of convolutions and HF Conv1D layers."""

import copy
import platform
import sys

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from tests.op_dtypes import OpDtypes
from torch import Tensor, nn
from torch._dynamo.testing import AotEagerAndRecordGraphs
from torch._dynamo.utils import counters
from torch.utils.flop_counter import FlopCounterMode

from isotrain.autograd import (
    CPU_KIND_ENV,
    Bf16Linear,
    QuantConv2d,
    QuantLinear,
    bf16_linear,
    bf16_linear_layers,
    cpu_flags,
    native_bf16_matmul,
    quantize_layers,
    quantize_linear_layers,
)
from isotrain.autograd._linear import _LayoutLinear


def _inputs(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(12, shape[-1], generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(12, generator=g, dtype=dtype, requires_grad=True)
    return x, w, b


def _bf16(fn, x: Tensor, w: Tensor, b: Tensor | None) -> tuple[Tensor, list[Tensor]]:
    """Output and input gradients of fn(x, w, b) under CPU bf16 autocast."""
    for t in (x, w, b):
        if t is not None:
            t.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fn(x, w, b)
    y.float().pow(2).sum().backward()
    return y, [t.grad for t in (x, w, b) if t is not None]


@pytest.mark.parametrize("shape", [(5, 8), (3, 4, 8), (8,)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layout_products_have_exact_gradients(shape: tuple[int, ...], with_bias: bool) -> None:
    # In float64 the layout Function is exact arithmetic, so gradcheck checks every transpose.
    x, w, b = _inputs(*shape, dtype=torch.float64)
    fn = lambda x, w, b: _LayoutLinear.apply(x, w, b, torch.float64)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w, b if with_bias else None))
    assert torch.allclose(fn(x, w, b), F.linear(x, w, b), rtol=1e-12, atol=1e-12)


def test_bf16_values_and_gradients_match_autocast_linear() -> None:
    x, w, b = _inputs(4, 16, 64)
    ref_y, ref_g = _bf16(F.linear, x, w, b)
    y, grads = _bf16(bf16_linear, x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == ref_y.shape
    exact = F.linear(*(t.detach().bfloat16().double() for t in (x, w, b)))
    # Both multiply the bf16-rounded inputs with fp32 accumulation and round once to bf16.
    for out in (y, ref_y):
        assert torch.allclose(out.double(), exact, rtol=2**-8, atol=1e-6)
    for got, ref, param in zip(grads, ref_g, (x, w, b)):
        assert got.dtype == param.dtype == torch.float32  # gradients keep the parameter dtype
        assert torch.allclose(got, ref, rtol=0.02, atol=0.02 * ref.abs().max().item())


def test_outside_bf16_it_is_f_linear_bit_for_bit() -> None:
    x, w, b = _inputs(3, 5, 8)
    assert torch.equal(bf16_linear(x, w, b), F.linear(x, w, b))
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.equal(bf16_linear(x, w, b), F.linear(x, w, b))
    xb, wb = x.detach().bfloat16(), w.detach().bfloat16()
    # A bf16 model without autocast takes the layout path too, with the same values.
    assert torch.allclose(bf16_linear(xb, wb).float(), F.linear(xb, wb).float(), rtol=2**-7)


def test_saves_only_the_bf16_input_besides_the_parameter() -> None:
    x, w, b = _inputs(6, 32)
    params = {w.data_ptr(), b.data_ptr()}
    saved: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(t)
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
        bf16_linear(x, w, b)
    extra = [t for t in saved if t.data_ptr() not in params]
    assert sum(t.numel() * t.element_size() for t in extra) == 6 * 32 * 2  # x in bf16, once


def test_conversion_keeps_keys_ties_and_quantized_layers() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 8))
    model[3].weight = model[2].weight  # tied
    quantize_linear_layers(model, bits=8, exclude=["0", "2"])
    keys = list(model.state_dict())
    bf16_linear_layers(model, force=True)
    assert [type(m) for m in model] == [Bf16Linear, nn.ReLU, Bf16Linear, QuantLinear]
    assert list(model.state_dict()) == keys
    assert model[3].weight is model[2].weight


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return next((set(ln.split(":", 1)[1].split()) for ln in f if ln.startswith("flags")), set())


def _converts() -> bool:
    return type(bf16_linear_layers(nn.Sequential(nn.Linear(4, 4)))[0]) is Bf16Linear


@pytest.mark.skipif(sys.platform != "linux", reason="reads the CPU flags from /proc/cpuinfo")
def test_native_bf16_detection_matches_this_cpu(own_cpu_kind: None) -> None:
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    flags = _cpu_flags()
    if not x86:
        expected = True  # Arm and others: no slow-layout bf16 kernel to avoid
    elif flags & {"avx512_bf16", "amx_bf16"}:
        expected = True  # oneDNN bf16 kernels, fast in every layout
    elif "avx512f" not in flags:
        expected = False  # AVX2 only: the portable kernel with its slow layouts
    else:
        expected = {"avx512bw", "avx512vl", "avx512dq"} <= flags  # AVX512 without bf16
    assert native_bf16_matmul() is expected, (platform.machine(), sorted(flags))
    assert cpu_flags() == flags
    assert _converts() is not expected  # converts exactly where bf16 is not native
    assert type(bf16_linear_layers(nn.Sequential(nn.Linear(4, 4)), force=True)[0]) is Bf16Linear


@pytest.mark.parametrize(("capability", "native"), [("AVX2", False), ("AVX512", True)])
def test_conversion_follows_the_cpu_capability(
    capability: str, native: bool, monkeypatch: pytest.MonkeyPatch, own_cpu_kind: None
) -> None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        native = True  # the capability only matters on x86
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert native_bf16_matmul() is native and _converts() is not native


def test_a_forced_cpu_kind_decides_the_conversion_and_the_flags(
    cpu_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The forced answer, whatever torch's capability says (here: the opposite of the kind's).
    other = "AVX512" if cpu_kind == "avx2" else "AVX2"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: other)
    assert native_bf16_matmul() is (cpu_kind != "avx2") and _converts() is (cpu_kind == "avx2")
    flags = cpu_flags()
    assert ("avx512_bf16" in flags) is (cpu_kind != "avx2")
    assert ("amx_tile" in flags) is (cpu_kind == "amx")


@pytest.mark.parametrize("value", ["avx512", "AVX2", "avx512_bf16"])
def test_an_unknown_cpu_kind_is_a_one_line_error_naming_the_kinds(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CPU_KIND_ENV, value)
    with pytest.raises(ValueError) as info:
        native_bf16_matmul()
    assert str(info.value) == (
        f"ISOTRAIN_CPU_KIND={value!r} is not a CPU kind: use one of avx2, avx512-bf16, amx, "
        "or unset it to read this CPU's flags"
    )


@pytest.mark.filterwarnings("ignore:Your compiler for AOTAutograd:UserWarning")  # the recorder
def test_bf16_linear_compiles_to_one_graph_that_keeps_the_layout_op() -> None:
    torch._dynamo.reset()
    counters.clear()
    layer = Bf16Linear(16, 12)
    x = torch.randn(2, 3, 16, requires_grad=True)

    def step(x: Tensor) -> Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return layer(x)

    backend = AotEagerAndRecordGraphs()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    y = compiled(x)
    y.float().sum().backward()
    grad = layer.weight.grad.clone()
    layer.weight.grad = None
    step(x).float().sum().backward()
    assert len(backend.graphs) == 1 and not counters["graph_break"]
    assert torch.equal(y, step(x)) and torch.equal(grad, layer.weight.grad)
    # Opaque to the compiler: inductor cannot re-lay the operands out (one product forward,
    # two backward).
    fw, bw = backend.fw_graphs[0].code, backend.bw_graphs[0].code
    assert fw.count("isotrain.layout_mm") == 1 and bw.count("isotrain.layout_mm") == 2


def test_layout_op_passes_opcheck() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, 5, generator=g, dtype=torch.bfloat16)
    b = torch.randn(4, 5, generator=g, dtype=torch.bfloat16).t()  # column-major: the op lays out
    bias = torch.randn(4, generator=g, dtype=torch.bfloat16)
    for args in ((a, b, None), (a, b, bias), (a.t().contiguous().t(), b, bias)):
        torch.library.opcheck(torch.ops.isotrain.layout_mm, args)
        ref = F.linear(args[0].float(), b.t().float(), None if args[2] is None else bias.float())
        out = torch.ops.isotrain.layout_mm(*args).float()
        assert torch.allclose(out, ref, rtol=2**-7, atol=0.02)
    with pytest.raises(ValueError, match=r"got torch.bfloat16, torch.float32, torch.bfloat16: "):
        torch.ops.isotrain.layout_mm(a, b.float(), bias)  # a cast inside would hide from checks


def test_the_layout_op_gets_bf16_operands_forward_and_backward() -> None:
    layer = Bf16Linear(8, 12)
    x = torch.randn(3, 8, requires_grad=True)
    with OpDtypes() as seen, torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x).float().sum().backward()
    assert seen.ops["layout_mm"] == {torch.bfloat16}  # 1 forward, 2 backward products
    assert seen.calls["layout_mm"] == 3 and "mm" not in seen.ops and "addmm" not in seen.ops


def test_flop_counter_counts_the_layout_products_as_matmuls() -> None:
    x, w, b = _inputs(4, 6, 16)
    counts = []
    for fn in (F.linear, bf16_linear):
        counter = FlopCounterMode(display=False)
        with counter:
            _bf16(fn, x, w, b)
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] == 3 * 2 * 24 * 16 * 12  # forward, grad_x, grad_w


def _autocast_loss(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return bf16_linear(x, w, b).float().pow(2).sum()


def _f64_loss(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    return _LayoutLinear.apply(x, w, b, torch.float64)[0].pow(2).sum()


@pytest.mark.parametrize(
    ("loss", "dtype"), [(_f64_loss, torch.float64), (_autocast_loss, torch.float32)]
)
def test_torch_func_grad_equals_autograd(loss, dtype: torch.dtype) -> None:
    x, w, b = _inputs(3, 5, 16, dtype=dtype)
    loss(x, w, b).backward()
    grads = torch.func.grad(loss, argnums=(0, 1, 2))(x.detach(), w.detach(), b.detach())
    for got, t in zip(grads, (x, w, b)):
        assert got.dtype == t.dtype and torch.equal(got, t.grad)  # the same products


@pytest.mark.filterwarnings("error:There is a performance drop")  # layout_mm has a vmap rule
def test_torch_func_grad_of_grad_is_exact_in_float64() -> None:
    # The backward's products are differentiable too: jacrev(grad) is the exact Hessian block.
    x, w, b = (t.detach() for t in _inputs(2, 4, dtype=torch.float64))
    ref = lambda x, w, b: F.linear(x, w, b).pow(2).sum()  # noqa: E731
    hessians = [torch.func.jacrev(torch.func.grad(f), argnums=1)(x, w, b) for f in (_f64_loss, ref)]
    assert torch.allclose(*hessians, rtol=1e-12, atol=1e-12)


@pytest.mark.filterwarnings("error:There is a performance drop")  # layout_mm has a vmap rule
def test_torch_func_vmap_equals_a_loop() -> None:
    xs, w, b = (t.detach() for t in _inputs(4, 3, 16))  # 4 samples of (3, 16)

    def layer(x: Tensor) -> Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return bf16_linear(x, w, b)

    ys = torch.func.vmap(layer)(xs)
    assert ys.dtype == torch.bfloat16 and torch.equal(ys, torch.stack([layer(x) for x in xs]))
    ys = torch.func.vmap(layer, in_dims=1, out_dims=1)(xs.transpose(0, 1))  # batch dim not first
    assert torch.equal(ys.transpose(0, 1), torch.stack([layer(x) for x in xs]))
    # Per-sample weight gradients: the backward's products are batched in both operands.
    per_sample = torch.func.grad(_autocast_loss, argnums=(1, 2))
    got = torch.func.vmap(per_sample, in_dims=(0, None, None))(xs, w, b)
    for i, x in enumerate(xs):
        for g, ref in zip(got, per_sample(x, w, b)):
            assert torch.equal(g[i], ref)


# ------------------------------------------------------------------ QAT beyond nn.Linear
class Conv1D(nn.Module):
    """Hugging Face's GPT-2 linear layer, as transformers.pytorch_utils writes it."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf))  # (in, out): transposed
        self.bias = nn.Parameter(torch.randn(nf))

    def forward(self, x: Tensor) -> Tensor:
        size_out = (*x.size()[:-1], self.nf)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


def _rounded(w: Tensor, dims: tuple[int, ...], bits: int) -> Tensor:
    """Reference: symmetric absmax rounding along `dims` (what the layers must compute)."""
    step = w.abs().amax(dim=dims, keepdim=True) / (2 ** (bits - 1) - 1)
    return torch.round(w / step) * step


def test_convolutions_and_hf_conv1d_quantize_each_output_channel(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), Conv1D(5, 2))
    keys, x = list(model.state_dict()), torch.randn(2, 3, 4, 2)
    report = quantize_layers(model, bits=4)
    assert report.converted == ("0", "1") and report.skipped == ()
    assert isinstance(model[0], QuantConv2d) and isinstance(model[1], Conv1D)  # still a Conv1D
    assert type(model[1]).__name__ == "QuantConv1D" and list(model.state_dict()) == keys
    conv, lin = model
    w_conv = _rounded(conv.weight.detach(), (1, 2, 3), 4)  # per output channel: dim 0
    w_lin = _rounded(lin.weight.detach(), (0,), 4)  # per output channel: the columns
    h = F.conv2d(F.pad(x, (1, 1, 1, 1), mode="reflect"), w_conv, conv.bias)
    ref = torch.addmm(lin.bias, h.reshape(-1, 2), w_lin).view(2, 4, 4, 5)  # over the last dim
    torch.testing.assert_close(model(x), ref)
    torch.save(model, tmp_path / "q.pt")  # the made-up QuantConv1D class pickles by its base
    for twin in (torch.load(tmp_path / "q.pt", weights_only=False), copy.deepcopy(model)):
        assert type(twin[1]) is type(model[1]) and torch.equal(twin(x), model(x))
    quantize_layers(model, bits=4, exclude=["1"])
    assert type(model[1]) is Conv1D  # excluded on a second call: back to the base class


def test_the_report_says_what_was_kept_and_why_and_nothing_converted_warns() -> None:
    model = nn.ModuleDict({
        "emb": nn.Embedding(10, 8), "up": nn.ConvTranspose2d(8, 8, 2),
        "conv": nn.Conv2d(8, 8, 1), "head": nn.Linear(8, 10),
    })  # fmt: skip
    said = r"(?s)converted no layer of ModuleDict: .*kept head \(Linear\): excluded by 'head'"
    with pytest.warns(UserWarning, match=said):
        report = quantize_layers(model, bits=8, kinds=("linear",), exclude=["head"])
    assert report.converted == ()
    assert dict((n, why) for n, _, why in report.skipped) == {
        "emb": "an embedding (a lookup, not a product): kept in full precision",
        "up": "a transposed convolution: not supported",
        "conv": "a conv layer; kinds=('linear',) leaves it out",
        "head": "excluded by 'head'",
    }
    with pytest.warns(UserWarning, match=said):
        assert quantize_linear_layers(model, bits=8, exclude=["head"]) is model
    assert quantize_layers(model, bits=8).converted == ("conv", "head")
    with pytest.raises(ValueError, match="kinds must hold 'linear' and/or 'conv'"):
        quantize_layers(model, bits=8, kinds=("attention",))
