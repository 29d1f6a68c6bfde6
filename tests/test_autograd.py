"""Straight-through estimators, LSQ, Gumbel-softmax, the fused custom op and QAT layers."""

import math
from collections.abc import Callable

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import Tensor, nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from isotrain.autograd import (
    LSQQuantizer,
    QuantLinear,
    StraightThroughEstimator,
    fake_quantize,
    fused_fake_quantize,
    gumbel_softmax_st,
    lsq_quantize,
    quantize,
    quantize_linear_layers,
    round_ste,
    sign_ste,
)
from isotrain.autograd import _ops as autograd_ops
from isotrain.autograd import _qat as autograd_qat


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _compile_fullgraph(fn: Callable) -> tuple[Callable, CompileCounterWithBackend]:
    """Compile with aot_eager, fullgraph; the counter proves one frame and no graph break."""
    torch._dynamo.reset()
    counters.clear()
    cnt = CompileCounterWithBackend("aot_eager")
    return torch.compile(fn, backend=cnt, fullgraph=True), cnt


def _assert_one_graph(cnt: CompileCounterWithBackend) -> None:
    assert cnt.frame_count == 1
    assert not counters["graph_break"], dict(counters["graph_break"])


def _nearest_level(x: Tensor, lo: float, hi: float, n: int) -> Tensor:
    # Independent reference: pick the closest of the n explicit levels to clamp(x).
    levels = torch.linspace(lo, hi, n, dtype=x.dtype)
    idx = (x.clamp(lo, hi).unsqueeze(-1) - levels).abs().argmin(-1)
    return levels[idx]


# Elementwise cases: fn, forward reference, mask where the upstream gradient passes.
LO, HI, COLS = -1.0, 1.5, 6
_LO_T = torch.linspace(-1.0, -0.5, COLS, dtype=torch.float64)  # per-column tensor bounds
_HI_T = torch.linspace(0.5, 1.0, COLS, dtype=torch.float64)
_ALL = lambda x: torch.ones_like(x, dtype=torch.bool)  # noqa: E731
_IN = lambda x: (x >= LO) & (x <= HI)  # noqa: E731
CASES: dict[str, tuple[Callable, Callable, Callable]] = {
    "quantize": (quantize, lambda x: torch.round(x * 255) / 255, _ALL),
    "quantize_4": (lambda x: quantize(x, 4), lambda x: torch.round(x * 3) / 3, _ALL),
    "round_ste": (round_ste, torch.round, _ALL),
    "sign_ste": (
        sign_ste,
        lambda x: torch.where(x < 0, -1.0, 1.0).double(),
        lambda x: x.abs() <= 1,
    ),
    "fake_clipped": (
        lambda x: fake_quantize(x, bits=3, lo=LO, hi=HI),
        lambda x: _nearest_level(x, LO, HI, 8),
        _IN,
    ),
    "fake_identity": (
        lambda x: fake_quantize(x, bits=3, lo=LO, hi=HI, gradient="identity"),
        lambda x: _nearest_level(x, LO, HI, 8),
        _ALL,
    ),
    "fake_tensor_bounds": (
        lambda x: fake_quantize(x, bits=2, lo=_LO_T, hi=_HI_T),
        lambda x: torch.stack(
            [
                _nearest_level(c, lo, hi, 4)
                for c, lo, hi in zip(x.unbind(-1), _LO_T.tolist(), _HI_T.tolist(), strict=True)
            ],
            -1,
        ),
        lambda x: (x >= _LO_T) & (x <= _HI_T),
    ),
    "fused_clipped": (
        lambda x: fused_fake_quantize(x, bits=3, lo=LO, hi=HI),
        lambda x: _nearest_level(x, LO, HI, 8),
        _IN,
    ),
    "fused_identity": (
        lambda x: fused_fake_quantize(x, bits=3, lo=LO, hi=HI, gradient="identity"),
        lambda x: _nearest_level(x, LO, HI, 8),
        _ALL,
    ),
    "lsq_x": (
        lambda x: lsq_quantize(x, torch.tensor(0.25, dtype=torch.float64), bits=3),
        lambda x: _nearest_level(x, -1.0, 0.75, 8),  # levels {-4..3} * 0.25
        lambda x: (x >= -1.0) & (x <= 0.75),
    ),
}


def _inputs() -> tuple[Tensor, Tensor]:
    g = _gen()
    x = torch.randn(4, COLS, dtype=torch.float64, generator=g) * 1.5
    x[0, :2] = torch.tensor([LO, HI])  # bounds are inside (inclusive mask)
    return x, torch.randn(4, COLS, dtype=torch.float64, generator=g)


@pytest.mark.parametrize("mode", ["eager", "compile", "func_grad", "vmap"])
@pytest.mark.parametrize("case", list(CASES))
def test_straight_through_contract(case: str, mode: str) -> None:
    fn, ref, mask = CASES[case]
    x, up = _inputs()
    want_grad = torch.where(mask(x), up, torch.zeros_like(up))
    if mode in ("eager", "compile"):
        f, cnt = _compile_fullgraph(fn) if mode == "compile" else (fn, None)
        xr = x.clone().requires_grad_()
        y = f(xr)
        y.backward(up)
        torch.testing.assert_close(y.detach(), ref(x), rtol=0, atol=1e-12)
        torch.testing.assert_close(xr.grad, want_grad, rtol=0, atol=0)
        if cnt is not None:
            _assert_one_graph(cnt)
    elif mode == "func_grad":
        grad = torch.func.grad(lambda t: (fn(t) * up).sum())(x)
        torch.testing.assert_close(grad, want_grad, rtol=0, atol=0)
    else:  # per-row forward and per-row gradients through vmap
        torch.testing.assert_close(torch.func.vmap(fn)(x), ref(x), rtol=0, atol=1e-12)
        per_row = torch.func.vmap(torch.func.grad(lambda t, u: (fn(t) * u).sum()))(x, up)
        torch.testing.assert_close(per_row, want_grad, rtol=0, atol=0)


def test_seed_api_quantize_levels_and_grad() -> None:
    assert quantize == StraightThroughEstimator.apply  # a bound classmethod
    x = torch.rand(4, 16, generator=_gen(), requires_grad=True)
    y = quantize(x)
    codes = y.detach() * 255
    torch.testing.assert_close(codes, codes.round(), rtol=0, atol=1e-4)  # on the 256-level grid
    assert (y - x).abs().max() <= 0.5 / 255 + 1e-7
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones_like(x))
    levels = torch.tensor([0.0, 1 / 3, 2 / 3, 1.0])
    torch.testing.assert_close(quantize(x, 4).detach().unique(), levels)  # x spans [0, 1]


def test_fused_matches_fake_quantize_bitwise() -> None:
    x = torch.randn(64, generator=_gen()) * 3
    for gradient in ("clipped", "identity"):
        a = fake_quantize(x, bits=4, lo=-2.0, hi=2.5, gradient=gradient)
        b = fused_fake_quantize(x, bits=4, lo=-2.0, hi=2.5, gradient=gradient)
        assert torch.equal(a, b)


@pytest.mark.parametrize("clipped", [True, False])
def test_custom_op_opcheck(clipped: bool) -> None:
    x = torch.randn(3, 5, generator=_gen(), requires_grad=True)
    torch.library.opcheck(torch.ops.isotrain.fake_quant.default, (x, -1.0, 1.0, 16, clipped))


def test_custom_op_raw_autograd_vmap_and_single_graph_node() -> None:
    autograd_ops._register()  # a second registration in this process is a no-op
    op = torch.ops.isotrain.fake_quant
    x = torch.linspace(-2, 2, 9, requires_grad=True)
    op(x, -1.0, 1.0, 4, True).sum().backward()  # through register_autograd
    assert x.grad.tolist() == [0, 0, 1, 1, 1, 1, 1, 0, 0]
    xb = torch.randn(3, 4, generator=_gen())
    torch.testing.assert_close(
        torch.func.vmap(lambda t: op(t, -1.0, 1.0, 4, True))(xb), op(xb, -1.0, 1.0, 4, True)
    )  # through register_vmap
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(
        lambda t: fused_fake_quantize(t, bits=2, lo=-1.0, hi=1.0), backend=capture, fullgraph=True
    )(xb)
    assert len(graphs) == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.isotrain.fake_quant]  # opaque: one node, nothing traced inside


@pytest.mark.xfail(
    raises=RuntimeError,
    strict=True,
    reason="pytorch#170834: register_autograd ops reject torch.func.grad; "
    "fused_fake_quantize routes around it (remove the bridge when this passes)",
)
def test_raw_custom_op_under_func_grad_upstream_bug() -> None:
    op = torch.ops.isotrain.fake_quant
    torch.func.grad(lambda t: op(t, -1.0, 1.0, 4, True).sum())(torch.randn(4, generator=_gen()))


def _lsq_references(x: Tensor, s: Tensor, up: Tensor, qn: int, qp: int, gs: float):
    """LSQ scale gradient three ways: the paper's formula, the detach trick, finite diffs."""
    v = x / s
    paper = torch.where(v <= -qn, -float(qn), torch.where(v >= qp, float(qp), v.round() - v))
    paper = (up * paper * gs).sum_to_size(s.shape)
    sr = s.clone().requires_grad_()
    s_g = (sr - sr * gs).detach() + sr * gs  # the paper's grad_scale()
    u = (x / s_g).clamp(-qn, qp)
    ((((u.round() - u).detach() + u) * s_g) * up).sum().backward()  # round_pass()
    c = (x / s).clamp(-qn, qp).round() - (x / s).clamp(-qn, qp)  # rounding offset, frozen

    def surrogate(scale: Tensor) -> Tensor:
        return (up * scale * ((x / scale).clamp(-qn, qp) + c)).sum()

    fd, h = torch.zeros_like(s), 1e-6
    for i in range(s.numel()):
        e = torch.zeros_like(s).view(-1)
        e[i] = h
        e = e.view_as(s)
        fd.view(-1)[i] = (surrogate(s + e) - surrogate(s - e)) / (2 * h) * gs
    return paper, sr.grad, fd


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("shape", [(), (4, 1)])
@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
def test_lsq_scale_gradient(shape: tuple, signed: bool, grad_scale: float) -> None:
    g = _gen(1)
    x = torch.randn(4, 5, dtype=torch.float64, generator=g) * 2
    up = torch.randn(4, 5, dtype=torch.float64, generator=g)
    s = (0.1 + torch.rand(shape, dtype=torch.float64, generator=g) * 0.4).requires_grad_()
    xr = x.clone().requires_grad_()
    qn, qp = (4, 3) if signed else (0, 7)
    lsq_quantize(xr, s, bits=3, signed=signed, grad_scale=grad_scale).backward(up)
    paper, detach_trick, fd = _lsq_references(x, s.detach(), up, qn, qp, grad_scale)
    for ref in (paper, detach_trick, fd):
        torch.testing.assert_close(s.grad, ref, rtol=1e-6, atol=1e-8)
    inside = (x / s.detach() >= -qn) & (x / s.detach() <= qp)
    torch.testing.assert_close(xr.grad, torch.where(inside, up, 0.0))

    def loss(scale: Tensor) -> Tensor:
        return (lsq_quantize(x, scale, bits=3, signed=signed, grad_scale=grad_scale) * up).sum()

    torch.testing.assert_close(torch.func.grad(loss)(s.detach()), s.grad, rtol=0, atol=0)


def test_lsq_quantizer_compiles_with_scale_gradient() -> None:
    q = LSQQuantizer(bits=4, shape=(3, 1), init=0.2)
    x = torch.randn(3, 7, generator=_gen())
    q(x).pow(2).sum().backward()
    eager_grad, q.scale.grad = q.scale.grad, None
    compiled, cnt = _compile_fullgraph(q)
    compiled(x).pow(2).sum().backward()
    _assert_one_graph(cnt)
    torch.testing.assert_close(q.scale.grad, eager_grad)


def test_lsq_quantizer_init_gradscale_and_learning() -> None:
    x = torch.randn(8, 16, generator=_gen())
    q = LSQQuantizer(bits=4, shape=(8, 1))
    q.init_scale_(x)
    torch.testing.assert_close(q.scale, 2 * x.abs().mean(1, keepdim=True) / math.sqrt(7))
    q.scale.data.fill_(1.0)  # a poor step: 4-bit levels of width 1 for unit-variance data
    opt = torch.optim.Adam(q.parameters(), lr=0.05)
    errors = []
    for _ in range(30):
        err = (q(x) - x).pow(2).mean()
        opt.zero_grad()
        err.backward()
        opt.step()
        errors.append(err.item())
    assert errors[-1] < 0.5 * errors[0]
    s = q.scale.detach().clone().requires_grad_()
    lsq_quantize(x, s, bits=4, grad_scale=1 / math.sqrt(16 * 7)).sum().backward()
    q.scale.grad = None
    q(x).sum().backward()
    torch.testing.assert_close(q.scale.grad, s.grad)  # module applies g = 1/sqrt(N * Q_P)


def test_gumbel_hard_is_one_hot_with_soft_gradient() -> None:
    logits = torch.randn(5, 4, dtype=torch.float64, generator=_gen(1), requires_grad=True)
    up = torch.randn(5, 4, dtype=torch.float64, generator=_gen(2))
    hard = gumbel_softmax_st(logits, tau=0.7, generator=_gen(3))
    (grad_hard,) = torch.autograd.grad((hard * up).sum(), logits)
    soft = gumbel_softmax_st(logits, tau=0.7, hard=False, generator=_gen(3))
    (grad_soft,) = torch.autograd.grad((soft * up).sum(), logits)
    assert torch.equal(hard.sum(-1), torch.ones(5, dtype=torch.float64))
    assert set(hard.unique().tolist()) <= {0.0, 1.0}
    assert torch.equal(hard.argmax(-1), soft.argmax(-1))
    torch.testing.assert_close(grad_hard, grad_soft, rtol=0, atol=0)
    rng = torch.get_rng_state()
    again = gumbel_softmax_st(logits, tau=0.7, generator=_gen(3))
    assert torch.equal(hard, again)  # seeded through the generator...
    assert torch.equal(torch.get_rng_state(), rng)  # ...leaving the global RNG alone
    grad_f = torch.func.grad(
        lambda t: (gumbel_softmax_st(t, tau=0.7, generator=_gen(3)) * up).sum()
    )(logits.detach())
    torch.testing.assert_close(grad_f, grad_soft, rtol=0, atol=0)


def test_gumbel_gradcheck_soft_and_sample_frequencies() -> None:
    logits = torch.randn(2, 3, dtype=torch.float64, generator=_gen(), requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda t: gumbel_softmax_st(t, tau=0.5, hard=False, generator=_gen(7)), (logits,)
    )
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    draws = gumbel_softmax_st(probs.log().expand(4000, 4), generator=_gen(5))
    torch.testing.assert_close(draws.mean(0), probs, rtol=0, atol=0.03)


def test_gumbel_compiles_with_global_rng() -> None:
    logits = torch.randn(3, 5, generator=_gen(), requires_grad=True)
    fn = lambda t: gumbel_softmax_st(t, tau=0.5)  # noqa: E731
    compiled, cnt = _compile_fullgraph(fn)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        eager = fn(logits)
        torch.manual_seed(0)
        out = compiled(logits)
    assert torch.equal(out, eager)  # aot_eager draws the same noise as eager
    _assert_one_graph(cnt)
    (g1,) = torch.autograd.grad(out.sum(), logits)
    assert g1.abs().sum() > 0  # the hard sample still trains the logits


class _TiedLM(nn.Module):
    def __init__(self, vocab: int = 11, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # weight tying, as in GPT

    def forward(self, idx: Tensor) -> Tensor:
        return self.head(F.gelu(self.fc(self.emb(idx))))


def _manual_fq(t: Tensor, dim: int, bits: int) -> Tensor:
    qmax = 2 ** (bits - 1) - 1
    s = t.abs().amax(dim, keepdim=True) / qmax
    return (t / s).round().clamp(-qmax, qmax) * s


def test_quantize_linear_layers_keys_tying_and_training() -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model, plain = _TiedLM(), _TiedLM()
    keys = list(model.state_dict())
    emb_weight = model.emb.weight
    assert quantize_linear_layers(model, bits=8, activations=True) is model
    assert type(model.fc) is QuantLinear and type(model.head) is QuantLinear
    assert list(model.state_dict()) == keys
    assert model.head.weight is model.emb.weight is emb_weight  # still tied
    plain.load_state_dict(model.state_dict())  # snapshots load into the unquantized model
    idx = torch.randint(0, 11, (4, 6), generator=_gen())
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = []
    for _ in range(5):
        loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert not torch.equal(plain.emb.weight, model.emb.weight)


@pytest.mark.parametrize("activations", [False, True])
def test_quant_linear_matches_manual_fake_quant(activations: bool) -> None:
    layer = QuantLinear(6, 5, bits=4, activations=activations)
    x = torch.randn(2, 3, 6, generator=_gen())
    x_ref = _manual_fq(x, -1, 4) if activations else x
    w_ref = _manual_fq(layer.weight.detach(), 1, 4).requires_grad_()
    y = layer(x)
    assert torch.equal(y, F.linear(x_ref, w_ref, layer.bias))
    up = torch.randn(y.shape, generator=_gen(1))
    y.backward(up)
    F.linear(x_ref, w_ref, layer.bias).backward(up)
    torch.testing.assert_close(layer.weight.grad, w_ref.grad)  # straight through the weight

    def call(w: Tensor) -> Tensor:
        return (torch.func.functional_call(layer, {"weight": w}, (x,)) * up).sum()

    torch.testing.assert_close(torch.func.grad(call)(layer.weight.detach()), w_ref.grad)


def test_quant_linear_gradcheck_input_and_bias() -> None:
    layer = QuantLinear(4, 3, bits=3, dtype=torch.float64)
    x = torch.randn(2, 4, dtype=torch.float64, generator=_gen(), requires_grad=True)
    bias = layer.bias.detach().clone().requires_grad_()

    def run(inp: Tensor, b: Tensor) -> Tensor:  # real gradient: linear in input and bias
        return F.linear(inp, autograd_qat._absmax_fake_quant(layer.weight, 1, 3), b)

    assert torch.autograd.gradcheck(run, (x, bias))
    torch.testing.assert_close(run(x, layer.bias), layer(x))


def test_quant_linear_compiles_and_exclude() -> None:
    model = quantize_linear_layers(_TiedLM(), bits=6, activations=True, exclude=["head"])
    assert type(model.head) is nn.Linear and type(model.fc) is QuantLinear
    idx = torch.randint(0, 11, (2, 3), generator=_gen())
    compiled, cnt = _compile_fullgraph(model)
    torch.testing.assert_close(compiled(idx), model(idx))
    _assert_one_graph(cnt)


def test_quantize_linear_layers_again_changes_the_bit_width() -> None:
    model = quantize_linear_layers(_TiedLM(), bits=8, exclude=["head"])
    x = torch.randint(0, 11, (2, 5), generator=_gen())
    at8 = model(x)
    quantize_linear_layers(model, bits=3, activations=True, exclude=["head"])
    assert (model.fc.bits, model.fc.activations) == (3, True)
    assert type(model.head) is nn.Linear  # still excluded
    assert not torch.equal(model(x), at8)
    assert torch.equal(quantize_linear_layers(model, bits=8, exclude=["head"])(x), at8)
    quantize_linear_layers(model, bits=8, exclude=["fc"])
    assert (type(model.fc), type(model.head)) == (nn.Linear, QuantLinear)


def test_quantize_linear_layers_validates_before_converting() -> None:
    model = _TiedLM()
    with pytest.raises(ValueError, match="QuantLinear needs bits >= 2"):
        quantize_linear_layers(model, bits=1)
    with pytest.raises(ValueError, match="gradient must be 'clipped' or 'identity'"):
        quantize_linear_layers(model, bits=8, gradient="soft")
    assert type(model.fc) is nn.Linear


_X = torch.zeros(3)
BAD_INPUTS = [
    (
        lambda: fake_quantize(_X, bits=0, lo=0.0, hi=1.0),
        ValueError,
        "bits must be between 1 and 16",
    ),
    (lambda: fake_quantize(_X, bits=17, lo=0.0, hi=1.0), ValueError, "bits must be between 1"),
    (lambda: fake_quantize(_X, bits=True, lo=0.0, hi=1.0), TypeError, "bits must be a Python int"),
    (lambda: fake_quantize(_X, bits=4, lo=1.0, hi=1.0), ValueError, "lo < hi"),
    (lambda: fake_quantize(_X, bits=4, lo=0.0, hi=1.0, gradient="x"), ValueError, "gradient"),
    (lambda: fused_fake_quantize(_X, bits=20, lo=0.0, hi=1.0), ValueError, "bits must be"),
    (lambda: fused_fake_quantize(_X, bits=4, lo=2.0, hi=1.0), ValueError, "lo < hi"),
    (lambda: quantize(_X, 1), ValueError, "n_levels must be at least 2"),
    (lambda: quantize(_X, 2.5), TypeError, "n_levels must be a Python int"),
    (lambda: gumbel_softmax_st(_X, tau=0.0), ValueError, "tau must be a positive"),
    (lambda: gumbel_softmax_st(_X, tau=-1.0), ValueError, "tau must be a positive"),
    (lambda: lsq_quantize(_X, _X + 1, bits=0), ValueError, "bits must be between 1 and 16"),
    (lambda: lsq_quantize(_X, _X + 1, bits=1), ValueError, "signed LSQ needs bits >= 2"),
    (lambda: LSQQuantizer(bits=17), ValueError, "bits must be between 1 and 16"),
]


@pytest.mark.parametrize(("call", "exc", "match"), BAD_INPUTS)
def test_invalid_inputs_raise(call: Callable, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        call()
