"""Tests for isotrain.contexts: every context restores exactly, on exit, on error, when nested."""

from __future__ import annotations

import itertools
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from isotrain._torch_private import DispatchMode, tree_leaves
from isotrain.contexts import (
    AutocastInfo,
    autocast_if_available,
    eval_mode,
    frozen,
    resolve_autocast,
    rng_isolated,
    train_mode,
)
from isotrain.guard import safe_backward


class Net(nn.Module):
    """Tiny classifier whose forward returns the loss, like the seed's ``model(x, y)``."""

    def __init__(self, p_drop: float = 0.0) -> None:
        super().__init__()
        self.encoder = nn.Sequential()
        self.encoder.add_module("fc", nn.Linear(8, 16))
        self.encoder.add_module("bn", nn.BatchNorm1d(16))
        self.encoder.add_module("drop", nn.Dropout(p_drop))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(torch.relu(self.encoder(x))), y)


def mixed_model() -> Net:
    """Parent trains, BatchNorm frozen in eval, one parameter frozen: the state to preserve."""
    model = Net()
    model.train()
    model.encoder.bn.eval()
    model.head.bias.requires_grad_(False)
    return model


def snapshot(*modules: nn.Module) -> tuple:
    """Independent reference reading of everything the contexts may touch."""
    return (
        [(n, m.training) for mod in modules for n, m in mod.named_modules()],
        [(n, p.requires_grad) for mod in modules for n, p in mod.named_parameters()],
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
    )


class Boom(Exception):
    pass


def run(ctx: AbstractContextManager, *, fail: bool) -> None:
    if not fail:
        with ctx:
            pass
        return
    with pytest.raises(Boom), ctx:
        raise Boom


# ------------------------------------------------------------------------------ eval / train


@pytest.mark.parametrize("fail", [False, True], ids=["normal", "exception"])
@pytest.mark.parametrize(
    "make",
    [
        lambda m: eval_mode(m),
        lambda m: eval_mode(m, inference=True),
        lambda m: eval_mode(m, no_grad=False),
        lambda m: train_mode(m),
        lambda m: frozen(m),
        lambda m: frozen(m.encoder, m.head),
    ],
    ids=["eval", "eval-inference", "eval-grad", "train", "frozen", "frozen-parts"],
)
@pytest.mark.parametrize("outer_grad", [True, False], ids=["grad", "no_grad"])
def test_context_restores_everything(make, fail: bool, outer_grad: bool) -> None:
    model = mixed_model()
    with torch.set_grad_enabled(outer_grad):
        before = snapshot(model)
        run(make(model), fail=fail)
        assert snapshot(model) == before


def test_eval_mode_inside_the_block() -> None:
    model = mixed_model()
    with eval_mode(model) as m:
        assert m is model
        assert not any(sub.training for sub in model.modules())
        assert not torch.is_grad_enabled()
        assert not torch.is_inference_mode_enabled()
    with eval_mode(model, inference=True):
        assert torch.is_inference_mode_enabled()
    with eval_mode(model, no_grad=False):
        assert torch.is_grad_enabled()


def test_eval_mode_several_modules() -> None:
    a, b = mixed_model(), Net()
    before = snapshot(a, b)
    with eval_mode(a, b) as (ea, eb):
        assert (ea, eb) == (a, b)
        assert not any(sub.training for sub in [*a.modules(), *b.modules()])
    assert snapshot(a, b) == before


def test_train_mode_inside_the_block() -> None:
    model = mixed_model()
    model.eval()
    with torch.inference_mode(), train_mode(model) as m:
        assert m is model and all(sub.training for sub in model.modules())
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        assert model(torch.randn(4, 8), torch.tensor([0, 1, 2, 0])).requires_grad
    assert not any(sub.training for sub in model.modules())


def test_frozen_restores_each_flag_and_shared_params() -> None:
    model = mixed_model()
    other = nn.Linear(8, 16)
    other.weight = model.encoder.fc.weight  # tied across modules: captured once
    with frozen(model, other):
        assert not any(p.requires_grad for p in [*model.parameters(), *other.parameters()])
        loss = model(torch.randn(4, 8), torch.tensor([0, 1, 2, 0]))
        assert not loss.requires_grad
    assert model.encoder.fc.weight.requires_grad and not model.head.bias.requires_grad


@pytest.mark.parametrize(
    "args",
    [(), ("model",), (nn.Linear(2, 2), 3)],
    ids=["none", "str", "int"],
)
@pytest.mark.parametrize("ctx", [eval_mode, train_mode, frozen])
def test_contexts_reject_non_modules(ctx, args) -> None:
    match = rf"{ctx.__name__}\(\) (needs at least one|takes)"
    with pytest.raises(TypeError, match=match), ctx(*args):
        pass


# ------------------------------------------------------------------------------------ nesting


def nest(ctxs: list, model: nn.Module, *, fail: bool) -> None:
    """Enter ctxs outermost first; check each level restores exactly what it found."""
    if not ctxs:
        if fail:
            raise Boom
        return
    before = snapshot(model)
    try:
        with ctxs[0]():
            nest(ctxs[1:], model, fail=fail)
    finally:
        assert snapshot(model) == before


@pytest.mark.parametrize("fail", [False, True], ids=["normal", "exception"])
@pytest.mark.parametrize("targets", ["same", "parts"])
@pytest.mark.parametrize("order", list(itertools.permutations(["eval", "train", "frozen"])))
def test_nested_contexts_restore_in_any_order(order, targets: str, fail: bool) -> None:
    model = mixed_model()
    parts = targets == "parts"
    factories = {
        "eval": lambda: eval_mode(model),
        "train": lambda: train_mode(model.encoder if parts else model),
        "frozen": lambda: frozen(model.head if parts else model),
    }
    before = snapshot(model)
    with pytest.raises(Boom) if fail else nullcontext():
        nest([factories[name] for name in order], model, fail=fail)
    assert snapshot(model) == before


def test_innermost_context_wins() -> None:
    model = mixed_model()
    with frozen(model), train_mode(model), eval_mode(model):
        assert not torch.is_grad_enabled() and not any(m.training for m in model.modules())
    with frozen(model), eval_mode(model), train_mode(model):
        assert torch.is_grad_enabled() and all(m.training for m in model.modules())
        assert not any(p.requires_grad for p in model.parameters())


# ---------------------------------------------------------------------- the seed's eval bug


@contextmanager
def seed_style_eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Negative control: the common recipe that restores only the top-level flag."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        model.train(was_training)


@pytest.mark.parametrize(("ctx", "bn_survives"), [(eval_mode, True), (seed_style_eval_mode, False)])
def test_frozen_batchnorm_survives_evaluation(ctx, bn_survives: bool) -> None:
    model = mixed_model()
    x, y = torch.randn(8, 8), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    stats = model.encoder.bn.running_mean.clone()
    with ctx(model) as m:
        m(x, y)
    model(x, y)  # a training step's forward after the evaluation
    assert (model.encoder.bn.training is False) is bn_survives
    assert torch.equal(model.encoder.bn.running_mean, stats) is bn_survives


# -------------------------------------------------------------------------------------- RNG


def train_losses(*, eval_at: int | None, isolate: bool) -> tuple[torch.Tensor, list]:
    """Tiny dropout model, 4 SGD steps; optionally a random-drawing evaluation mid-run."""
    torch.manual_seed(0)
    model = Net(p_drop=0.5)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    losses = []
    for step in range(4):
        if step == eval_at:
            with eval_mode(model) as m, rng_isolated(seed=123) if isolate else nullcontext():
                m(torch.randn(8, 8), y)  # draws from the global torch RNG
                random.random()
                np.random.rand()
        loss = model(x, y)
        loss.backward()
        with torch.no_grad():  # plain SGD by hand: torch.optim's first step imports dynamo
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
        losses.append(loss.detach())
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


def test_evaluation_inside_training_is_bit_identical() -> None:
    ref_losses, ref_params = train_losses(eval_at=None, isolate=True)
    losses, params = train_losses(eval_at=2, isolate=True)
    assert torch.equal(losses, ref_losses)
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params, strict=True))
    # negative control: the same evaluation without rng_isolated changes the dropout masks
    leaky_losses, _ = train_losses(eval_at=2, isolate=False)
    assert torch.equal(leaky_losses[:2], ref_losses[:2])
    assert not torch.equal(leaky_losses[2:], ref_losses[2:])


def rng_draws() -> tuple:
    return random.random(), torch.rand(3), np.random.rand(3)


@pytest.mark.parametrize("fail", [False, True], ids=["normal", "exception"])
def test_rng_isolated_restores_all_generators(fail: bool) -> None:
    random.seed(5)
    torch.manual_seed(5)
    np.random.seed(5)
    expected = rng_draws()
    random.seed(5)
    torch.manual_seed(5)
    np.random.seed(5)
    with rng_isolated(seed=1) as _, pytest.raises(Boom) if fail else nullcontext():
        rng_draws()
        if fail:
            raise Boom
    got = rng_draws()
    assert got[0] == expected[0]
    assert torch.equal(got[1], expected[1])
    assert np.array_equal(got[2], expected[2])


def test_rng_isolated_seed_makes_draws_repeatable() -> None:
    with rng_isolated(seed=42):
        first = rng_draws()
    torch.rand(5)  # move the outer state on: the seeded block must not care
    with rng_isolated(seed=42):
        second = rng_draws()
    with rng_isolated(seed=43):
        third = rng_draws()
    assert first[0] == second[0] and torch.equal(first[1], second[1])
    assert np.array_equal(first[2], second[2])
    assert not torch.equal(first[1], third[1])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"devices": ["cpu"]}, ValueError, "takes CUDA devices"),
        ({"seed": 1.5}, TypeError, "seed must be an int"),
    ],
)
def test_rng_isolated_bad_input(kwargs, error, match) -> None:
    with pytest.raises(error, match=match), rng_isolated(**kwargs):
        pass


# --------------------------------------------------------------------------------- autocast


def test_autocast_on_cpu_runs_bf16_and_reports_it() -> None:
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with autocast_if_available(device="cpu") as info:
        out = a @ b
    assert out.dtype == torch.bfloat16
    assert info == AutocastInfo(
        True, "cpu", torch.bfloat16, False, "cpu autocast to torch.bfloat16"
    )
    assert not torch.is_autocast_enabled("cpu") and (a @ b).dtype == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="default device is cuda here")
def test_autocast_no_args_defaults_to_cpu_bf16() -> None:
    with autocast_if_available() as info:
        assert (torch.randn(2, 2) @ torch.randn(2, 2)).dtype == torch.bfloat16
    assert info.enabled and info.device_type == "cpu"


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"enabled": False, "device": "cpu"}, "disabled by enabled=False"),
        ({"dtype": torch.float32, "device": "cpu"}, "supports bfloat16/float16, not torch.float32"),
        ({"device": torch.device("meta")}, "does not support device type 'meta'"),
    ],
)
def test_autocast_no_op_cases(kwargs, reason: str) -> None:
    with autocast_if_available(**kwargs) as info:
        out = torch.randn(2, 2) @ torch.randn(2, 2)
    assert not info.enabled and info.dtype is None and info.reason.endswith(reason)
    assert out.dtype == torch.float32


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="mps is available here")
def test_autocast_unavailable_mps_is_a_no_op() -> None:
    info = resolve_autocast(device="mps")
    assert not info.enabled and info.reason == "device 'mps' is not available"


def test_autocast_cuda_without_bf16_falls_back_to_fp16(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    info = resolve_autocast()
    assert info == AutocastInfo(
        True, "cuda", torch.float16, True,
        "bfloat16 unsupported on this cuda device; falling back to float16",
    )  # fmt: skip
    assert resolve_autocast(torch.float16, device="cuda:0").needs_grad_scaler
    with (
        pytest.warns(UserWarning, match=r"GradScaler\('cuda'\)") as record,
        autocast_if_available(device="cuda") as entered,
    ):
        assert torch.is_autocast_enabled("cuda")
        assert torch.get_autocast_dtype("cuda") == torch.float16
    assert entered == info and not torch.is_autocast_enabled("cuda")
    assert record[0].filename == __file__  # the warning points at the caller's `with`


def test_autocast_restores_on_exception() -> None:
    before = snapshot(nn.Linear(1, 1))
    run(autocast_if_available(device="cpu"), fail=True)
    assert snapshot(nn.Linear(1, 1)) == before


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"dtype": "bf16"}, "dtype must be a torch.dtype"), ({"device": 0}, "device must be")],
)
def test_autocast_bad_input(kwargs, match: str) -> None:
    with pytest.raises(TypeError, match=match), autocast_if_available(**kwargs):
        pass


# --------------------------------------------------------------- autocast, attention in fp32


class Attn(nn.Module):
    """qkv projection, causal SDPA, output projection: the ops whose dtypes matter."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (
            t.view(B, T, self.heads, C // self.heads).transpose(1, 2)  # (B, H, T, D)
            for t in self.qkv(x).split(C, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class OpDtypes(DispatchMode):
    """Records (op name, dtypes of its floating-point tensor inputs) for every aten op."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, set[torch.dtype]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        leaves = tree_leaves((args, kwargs or {}))
        dtypes = {t.dtype for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()}
        self.ops.append((func.__name__.split(".")[0], dtypes))
        return func(*args, **(kwargs or {}))

    def dtypes(self, *names: str) -> set[torch.dtype]:
        found = [d for op, d in self.ops if op in names]
        assert found, f"no {names} op ran"
        return set().union(*found)


def _op_dtypes(model: nn.Module, x: torch.Tensor, **kwargs) -> tuple[OpDtypes, torch.Tensor]:
    with OpDtypes() as seen:
        with autocast_if_available(device="cpu", **kwargs):
            y = model(x)
        y.float().square().sum().backward()
    return seen, y


SDPA_OPS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math")
SDPA_BACKWARD = ("_scaled_dot_product_flash_attention_for_cpu_backward",)


def test_fp32_attention_runs_matmuls_in_bf16_and_attention_forward_and_backward_in_fp32():
    torch.manual_seed(0)
    model, x = Attn(), torch.randn(2, 8, 32, requires_grad=True)
    seen, y = _op_dtypes(model, x, attention="fp32")
    assert seen.dtypes("addmm", "mm") == {torch.bfloat16}  # projections, forward and backward
    assert seen.dtypes(*SDPA_OPS) == {torch.float32}
    assert seen.dtypes(*SDPA_BACKWARD) == {torch.float32}
    assert y.dtype == torch.bfloat16  # cast back: the next layer gets what autocast gives it
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    plain, _ = _op_dtypes(model, x)  # the control: plain autocast runs attention in bf16
    assert plain.dtypes(*SDPA_OPS) == {torch.bfloat16}
    assert torch.bfloat16 in plain.dtypes(*SDPA_BACKWARD)  # with its fp32 logsumexp


def test_fp32_attention_reports_itself_and_refuses_an_unknown_mode() -> None:
    info = resolve_autocast(device="cpu", attention="fp32")
    assert info.attention == "fp32"
    assert info.reason == "cpu autocast to torch.bfloat16, attention in fp32"
    assert resolve_autocast(device="cpu").attention == "autocast"
    with pytest.raises(ValueError, match="attention must be 'autocast' .* or 'fp32', got 'bf16'"):
        resolve_autocast(device="cpu", attention="bf16")  # type: ignore[arg-type]


def test_fp32_attention_says_it_cannot_reach_inside_multihead_attention() -> None:
    class MHA(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(32, 4, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.attn(x, x, x, need_weights=False)[0]

    with pytest.warns(
        UserWarning, match="nn.MultiheadAttention's attention runs in the autocast"
    ) as rec:
        seen, _ = _op_dtypes(MHA(), torch.randn(2, 8, 32), attention="fp32")
    assert seen.dtypes(*SDPA_OPS) == {torch.bfloat16} and len(rec) == 1
    assert rec[0].filename == __file__  # the user's line, not torch's


def test_fp32_attention_compiles_to_what_eager_computes() -> None:
    torch.manual_seed(0)
    model, x = Attn(), torch.randn(2, 8, 32)
    results = []
    for fn in (model, torch.compile(model, backend="aot_eager", fullgraph=True)):
        with autocast_if_available(device="cpu", attention="fp32"):
            results.append(fn(x))
    with autocast_if_available(device="cpu"):
        bf16 = model(x)
    torch._dynamo.reset()
    assert torch.equal(results[0], results[1]) and not torch.equal(results[0], bf16)


# ----------------------------------------------------------------- the seed's training loop


def test_seed_training_loop_runs_as_written(capsys) -> None:
    torch.manual_seed(0)
    model = Net(p_drop=0.1)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = None
    train_loader = [(torch.randn(4, 8), torch.randint(0, 3, (4,))) for _ in range(4)]
    val_loader = train_loader[:2]
    start = [p.detach().clone() for p in model.parameters()]

    def compute_val_loss(m: nn.Module, loader: list) -> torch.Tensor:
        return torch.stack([m(x, y) for x, y in loader]).mean()

    for step, (x, y) in enumerate(train_loader):
        with autocast_if_available():
            loss = model(x, y)
        assert safe_backward(loss, optimizer, scaler)
        if step % 2 == 0:
            with eval_mode(model) as m:
                val_loss = compute_val_loss(m, val_loader)
            print(f"step {step}: train={loss:.4f}, val={val_loss:.4f}")  # noqa: T201

    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(
        re.fullmatch(r"step \d: train=\d\.\d{4}, val=\d\.\d{4}", s) for s in lines
    )
    assert model.training and not val_loss.requires_grad
    assert not any(torch.equal(p, q) for p, q in zip(model.parameters(), start, strict=True))


def test_pattern_modules_do_not_load_the_trainer() -> None:
    """DESIGN: the pattern modules import torch and the stdlib only, never isotrain.train."""
    import pkgutil

    import isotrain

    skip = {"train", "__main__"}  # the trainer itself, and the CLI entry that runs it
    modules = [m.name for m in pkgutil.iter_modules(isotrain.__path__) if m.name not in skip]
    assert {"autograd", "checkpointing", "guard", "compile", "contexts"} <= set(modules)
    code = (
        "import importlib, importlib.util, sys\n"
        f"for name in {modules!r}:\n"
        "    if importlib.util.find_spec('isotrain.' + name):\n"
        "        importlib.import_module('isotrain.' + name)\n"
        "bad = [k for k in sys.modules if k.startswith('isotrain.train')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
