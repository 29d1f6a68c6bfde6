"""Tests for isotrain.compile: in-place per-block compile with eager fallback, recompile
accounting, warm-up per bucket, no recompiles afterwards, and composition with checkpointing,
selection updates and autocast. All but one test use the fast "eager"/"aot_eager" backends."""

from __future__ import annotations

import copy
import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from isotrain.compile import (
    CompileStats,
    compile_available,
    compile_counters,
    compile_model,
    default_buckets,
    no_recompiles,
    pad_to_bucket,
    track_compiles,
    warmup,
)
from isotrain.guard import SkipReason, StepGuard

VOCAB, D, BLOCK = 64, 32, 32


class Block(nn.Module):
    """Pre-LN transformer block with causal attention; optional activation checkpointing."""

    def __init__(self, d: int = D, n_head: int = 4, dropout: float = 0.0, ckpt: bool = False):
        super().__init__()
        self.n_head, self.ckpt = n_head, ckpt
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, C/H)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))
        return x + self.mlp(self.ln2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ckpt:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class TinyGPT(nn.Module):
    def __init__(self, n_layer: int = 2, **block_kw):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, D), nn.Embedding(BLOCK, D)
        self.blocks = nn.ModuleList(Block(**block_kw) for _ in range(n_layer))
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, VOCAB)


@pytest.fixture(autouse=True)
def _fresh_dynamo_and_rng():
    """Compiled graphs live on code objects: drop them around each test; isolate the RNG."""
    torch._dynamo.reset()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        yield
    torch._dynamo.reset()


def _tokens(*shape: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape)


def _compiled(m: nn.Module) -> bool:
    return m._compiled_call_impl is not None


def _loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), ignore_index=-100)


# ------------------------------------------------------------------ compile_model


@pytest.mark.parametrize("regional", [True, False])
def test_compile_in_place_keeps_keys_and_outputs(regional):
    ref = TinyGPT()
    model = copy.deepcopy(ref)
    assert compile_model(model, backend="eager", regional=regional) is model
    assert list(model.state_dict()) == list(ref.state_dict())
    ref.load_state_dict(model.state_dict(), strict=True)
    assert all(_compiled(b) for b in model.blocks) is regional
    assert _compiled(model) is not regional
    x = _tokens(2, 8)
    with track_compiles() as stats:
        out = model(x)
    assert stats.compilations >= 1
    torch.testing.assert_close(out, ref(x), rtol=0, atol=0)


def test_module_selection_by_type_predicate_and_outermost_only():
    model = compile_model(TinyGPT(), backend="eager", modules=(Block, nn.LayerNorm))
    assert all(_compiled(b) for b in model.blocks)
    assert not _compiled(model.blocks[0].ln1)  # nested in a compiled block: left alone
    assert _compiled(model.ln_f)  # a LayerNorm outside the blocks
    model = compile_model(TinyGPT(), backend="eager", modules=lambda n, m: isinstance(m, nn.GELU))
    assert _compiled(model.blocks[1].mlp[1]) and not _compiled(model.blocks[1])


def test_compile_model_rejects_bad_input():
    with pytest.raises(
        ValueError, match="found no blocks to compile in Linear: looked for the child"
    ):
        compile_model(nn.Linear(2, 2), backend="eager")
    with pytest.raises(ValueError, match="modules= selects blocks for regional=True"):
        compile_model(TinyGPT(), backend="eager", regional=False, modules=(Block,))
    with pytest.raises(ValueError, match="in TinyGPT: looked for submodules of type Conv1d"):
        compile_model(TinyGPT(), backend="eager", modules=(nn.Conv1d,))
    with pytest.raises(TypeError, match="modules must be an nn.Module subclass"):
        compile_model(TinyGPT(), backend="eager", modules="Block")
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        compile_model(lambda x: x, backend="eager")


def test_compile_available_reports_reasons(monkeypatch):
    assert compile_available("eager") and compile_available("aot_eager").ok
    ok, reason = compile_available("nope")
    assert not ok and "unknown backend 'nope'" in reason
    assert compile_available(lambda gm, inputs: gm.forward).ok
    if not torch.cuda.is_available():
        assert "torch.cuda is not available" in compile_available(device="cuda").reason
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    ok, reason = compile_available("inductor", device="cpu")
    assert not ok and "C++ compiler" in reason
    with pytest.raises(TypeError, match="backend must be a name or a callable"):
        compile_available(3)


# ------------------------------------------------------------------ eager fallback


def _boom(gm, example_inputs):
    raise RuntimeError("boom: this backend cannot compile")


def test_raising_backend_warns_once_and_runs_eagerly():
    ref = TinyGPT()
    model = compile_model(copy.deepcopy(ref), backend=_boom)
    x = _tokens(2, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(x)
        out2 = model(_tokens(2, 12))
    assert [str(w.message) for w in caught if "boom" in str(w.message)] == [str(caught[0].message)]
    assert "running 2 module(s) eagerly" in str(caught[0].message)
    assert not any(_compiled(b) for b in model.blocks)
    torch.testing.assert_close(out, ref(x), rtol=0, atol=0)
    assert out2.shape == (2, 12, VOCAB)


def test_unknown_backend_or_missing_compiler_warns_up_front(monkeypatch):
    with pytest.warns(RuntimeWarning, match="unknown backend 'nope'"):
        model = compile_model(TinyGPT(), backend="nope")
    assert not any(_compiled(b) for b in model.blocks)
    with pytest.raises(RuntimeError, match="cannot compile with backend 'nope'"):
        compile_model(TinyGPT(), backend="nope", fallback=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.warns(RuntimeWarning, match="needs a C\\+\\+ compiler"):
        model = compile_model(TinyGPT())  # inductor on CPU, no compiler: eager, no crash
    assert model(_tokens(1, 4)).shape == (1, 4, VOCAB)


def test_fallback_false_raises_backend_error():
    model = compile_model(TinyGPT(), backend=_boom, fallback=False)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="boom"):
        model(_tokens(1, 4))


def test_user_error_is_raised_not_swallowed():
    model = compile_model(TinyGPT(), backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback warning here would fail the test
        with pytest.raises(RuntimeError, match="normalized_shape|shape"):
            model.blocks[0](torch.randn(1, 4, D + 1))  # wrong width: the eager error surfaces
    assert _compiled(model.blocks[0])  # compile stays on: it was not the compiler's fault
    assert model(_tokens(1, 4)).shape == (1, 4, VOCAB)


# ------------------------------------------------------------------ accounting


def test_track_compiles_counts_graphs_breaks_recompiles_and_time():
    def f(x):
        y = x.sin()
        torch._dynamo.graph_break()
        return y.cos()

    fc = torch.compile(f, backend="eager", dynamic=False)
    before = compile_counters()
    with track_compiles() as stats:
        fc(torch.randn(3))
        fc(torch.randn(3))  # cached: nothing new
    assert (stats.compilations, stats.graph_breaks, stats.recompiles) == (2, 1, 0)
    assert stats.compiled and stats.compile_seconds > 0 and stats.wall_seconds > 0
    with track_compiles() as again:
        fc(torch.randn(5))  # new static shape: both frames recompile
    assert again.recompiles == 2 and again.compilations == 2
    assert any("size mismatch" in r for r in again.recompile_reasons)
    assert compile_counters().compilations - before.compilations == 4
    with track_compiles() as steady:
        fc(torch.randn(5))
    assert not steady.compiled and steady == CompileStats(wall_seconds=steady.wall_seconds)


def test_recompile_limit_hits_are_counted():
    fc = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2), track_compiles() as stats:
        for n in range(1, 6):
            fc(torch.randn(n))
    assert stats.compilations == 2 and stats.recompile_limit_hits >= 1
    assert stats.failures >= 1


def test_no_recompiles_raises_then_restores_stance():
    fc = torch.compile(lambda x: x + 1, backend="eager", dynamic=False)
    fc(torch.randn(2))
    with no_recompiles():
        fc(torch.randn(2))  # cached graph: fine
        with pytest.raises(RuntimeError, match="fail_on_recompile"):
            fc(torch.randn(3))
        fresh = torch.compile(lambda x: x - 1, backend="eager")
        with pytest.raises(RuntimeError, match="fail_on_recompile"):
            fresh(torch.randn(2))  # a never-compiled frame counts too: warm up everything
    with track_compiles() as stats:
        fc(torch.randn(3))  # stance restored: the recompile now just happens
    assert stats.recompiles == 1


def test_no_recompiles_names_the_dimension_that_changed_first():
    fc = torch.compile(lambda x: x * 3, backend="eager", dynamic=False)
    fc(torch.randn(8, 4))
    with pytest.raises(RuntimeError) as info, no_recompiles():
        fc(torch.randn(5, 4))  # a short last batch
    lines = str(info.value).splitlines()
    assert lines[0] == (
        "no_recompiles: an input's dimension 0 is 5, but warm-up compiled 8 (a batch of another "
        "size?); warm up this shape too, or pad every batch to 8"
    )
    assert "fail_on_recompile" in lines[1]  # torch's own message follows, whole


# ------------------------------------------------------------------ buckets + warm-up


def _variable_length_batches(n: int = 20, batch: int = 2) -> list[list[torch.Tensor]]:
    lengths = torch.randint(2, BLOCK + 2, (n, batch)).tolist()  # n - 1 positions <= BLOCK
    return [[_tokens(k) for k in row] for row in lengths]


def _train_steps(model, batches, buckets):
    for docs in batches:
        inputs, targets, _ = pad_to_bucket(docs, buckets=buckets)
        _loss(model, inputs, targets).backward()


def test_bucketing_compiles_once_per_bucket_then_never_recompiles():
    buckets = default_buckets(BLOCK, min_len=8)  # (8, 16, 32)
    batches = _variable_length_batches()
    model = compile_model(TinyGPT(), backend="eager", dynamic=False)
    stats = warmup(model, [_tokens(2, L) for L in buckets])
    assert stats.compilations == len(buckets)  # one graph per bucket, shared by both blocks
    with no_recompiles(), track_compiles() as run:
        _train_steps(model, batches, buckets)
    assert (run.compilations, run.recompiles, run.failures) == (0, 0, 0)

    # Without buckets each new length is a new static graph (or hits the recompile limit).
    torch._dynamo.reset()
    unbucketed = compile_model(TinyGPT(), backend="eager", dynamic=False)
    n_lengths = len({max(len(d) for d in docs) - 1 for docs in batches})
    limit = len(buckets) + 2  # below the default 8 to keep the test short; same behaviour
    with (
        torch._dynamo.config.patch(recompile_limit=limit),
        track_compiles() as storm,
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        for docs in batches:  # forward only: the graphs are what we count
            unbucketed(pad_to_bucket(docs, buckets=(max(len(d) for d in docs) - 1,))[0])
    assert n_lengths > len(buckets)
    assert storm.compilations == min(n_lengths, limit) > stats.compilations
    assert (storm.recompile_limit_hits > 0) is (n_lengths > limit)
    said = [str(w.message) for w in caught if "ran eagerly" in str(w.message)]
    assert len(said) == 1 and storm.eager_block_calls > 0  # past the limit: eager, said once
    assert "recompile limit" in said[0] and "size mismatch" in said[0]


def test_automatic_dynamic_shapes_without_buckets():
    """dynamic=None: the second distinct length makes dynamo compile one dynamic graph."""
    model = compile_model(TinyGPT(n_layer=1), backend="eager")  # dynamic=None
    with track_compiles() as stats:
        for L in (5, 9, 13, 21):
            model(_tokens(2, L))
    assert stats.compilations == 2 and stats.recompiles == 1


def test_warmup_leaves_grads_rng_buffers_and_covers_eval():
    model = compile_model(TinyGPT(n_layer=1, dropout=0.1), backend="eager", dynamic=False)
    model.register_buffer("seen", torch.zeros(()))

    def count_calls(module, args, output):  # a buffer that warm-up must leave untouched
        module.seen.add_(1)

    model.register_forward_hook(count_calls)
    batches = [_tokens(2, 8), (_tokens(2, 16),)]
    rng = torch.get_rng_state()
    stats = warmup(model, batches, also_eval=True)
    assert stats.compilations == 4 and stats.compile_seconds > 0  # 2 shapes x train/eval
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert model.seen.item() == 0 and model.training
    with no_recompiles():
        with torch.no_grad():
            model.eval()
            model(_tokens(2, 16))
        model.train()
        model(_tokens(2, 8)).sum().backward()


def test_warmup_function_needs_params():
    fc = torch.compile(lambda x: (x * 2).sum(), backend="eager")
    with pytest.raises(ValueError, match="needs params="):
        warmup(fc, [torch.randn(3)])
    w = torch.randn(3, requires_grad=True)
    stats = warmup(lambda x: fc(x * w), [torch.randn(3)], params=[w])
    assert stats.compilations >= 1 and w.grad is None


def test_padding_never_changes_the_loss():
    model = TinyGPT()
    docs = [_tokens(n) for n in (5, 12, 9)]
    inputs, targets, lengths = pad_to_bucket(docs, buckets=(8, 16, 32))
    assert inputs.shape == (3, 16) and lengths.tolist() == [4, 11, 8]
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    sums = [F.cross_entropy(model(d[None, :-1])[0], d[1:], reduction="sum") for d in docs]
    torch.testing.assert_close(loss, torch.stack(sums).sum() / lengths.sum())
    for row, d in enumerate(docs):  # causal: padding never reaches earlier positions
        torch.testing.assert_close(logits[row, : len(d) - 1], model(d[None, :-1])[0])
    other, _, _ = pad_to_bucket(docs, buckets=(8, 16, 32), pad_id=VOCAB - 1)
    torch.testing.assert_close(_loss(model, other, targets), loss)


# ------------------------------------------------------------------ composition


def test_checkpointed_blocks_compile_with_equal_gradients():
    ref = TinyGPT(n_layer=1, ckpt=True)
    model = compile_model(copy.deepcopy(ref), backend="aot_eager", dynamic=False)
    inputs, targets = _tokens(2, 16), _tokens(2, 16)
    _loss(ref, inputs, targets).backward()
    warm = warmup(model, [inputs])
    assert warm.compilations == 1 and warm.failures == 0 and warm.compile_seconds > 0
    with no_recompiles(), track_compiles() as step:
        _loss(model, inputs, targets).backward()
    assert not step.compiled  # forward and the lazily compiled backward were both warmed up
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_step_guard_select_skips_a_nan_gradient_through_compiled_blocks():
    """StepGuard(skip_mode="select") around aot_eager-compiled blocks: a NaN gradient changes
    no bit of params, AdamW moments or step; a clean step changes them; nothing recompiles."""
    model = compile_model(TinyGPT(n_layer=1), backend="aot_eager")
    assert _compiled(model.blocks[0])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = StepGuard(opt, model, spike_k=None, skip_mode="select")
    x = _tokens(2, 8)

    def snapshot() -> list[torch.Tensor]:
        state = [opt.state[p][k] for p in model.parameters() for k in ("exp_avg", "exp_avg_sq")]
        return [
            t.clone() for t in (*model.parameters(), *state, opt.state[model.head.weight]["step"])
        ]

    def guarded_step(poison: bool) -> bool:
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), x.flatten())
        if poison:  # adds 0 to the loss, but its gradient is inf * 0 = NaN in every block
            loss = loss + (logits - logits.detach()).pow(2).sum().sqrt()
        loss.backward()
        assert poison == any(not p.grad.isfinite().all() for p in model.blocks.parameters())
        outcome = guard.step(loss.detach())
        assert outcome.reason.item() == (SkipReason.NONFINITE_GRAD if poison else SkipReason.OK)
        return bool(outcome.applied)

    assert guarded_step(poison=False)  # creates the AdamW state
    before = snapshot()
    with no_recompiles():  # in-place updates keep the compiled blocks' graphs valid
        assert not guarded_step(poison=True)
        assert all(torch.equal(a, b) for a, b in zip(snapshot(), before, strict=True))
        assert guarded_step(poison=False)
    assert not any(torch.equal(a, b) for a, b in zip(snapshot(), before, strict=True))
    assert {opt.state[p]["step"].item() for p in model.parameters()} == {2.0}  # applied steps


def test_autocast_bf16_matches_eager_autocast():
    ref = TinyGPT(n_layer=1)
    model = compile_model(copy.deepcopy(ref), backend="aot_eager", dynamic=False)
    x = _tokens(2, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = ref(x)
        stats = warmup(model, [x])
        out = model(x)
    assert out.dtype == expected.dtype == torch.bfloat16 and stats.compilations == 1
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    with no_recompiles(), pytest.raises(RuntimeError, match="fail_on_recompile"):
        model(x)  # autocast is guarded: fp32 needs its own graph, warm it up too


# ------------------------------------------------------------------ inductor (the only one)


@pytest.fixture
def inductor_cache(tmp_path_factory, monkeypatch):
    root = tmp_path_factory.getbasetemp() / "inductor-cache"  # shared by the session
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(root))
    return root


@pytest.mark.slow
def test_inductor_per_block_compile_matches_eager(inductor_cache):
    # Every machine this suite runs on has gcc and the Python headers: a toolchain that is not
    # detected is a bug in compile_available, so it fails here instead of skipping.
    ok, reason = compile_available("inductor", device="cpu")
    assert ok, reason
    assert reason.startswith("inductor on CPU with ")
    ref = TinyGPT(n_layer=1)
    model = compile_model(copy.deepcopy(ref), dynamic=False)
    inputs, targets = _tokens(2, 16), _tokens(2, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no silent eager fallback allowed
        stats = warmup(model, [inputs])
        _loss(model, inputs, targets).backward()
    _loss(ref, inputs, targets).backward()
    assert stats.compilations == 1 and stats.compile_seconds > 0 and _compiled(model.blocks[0])
    assert list(model.state_dict()) == list(ref.state_dict())
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ coverage and copies
class Scaled(nn.Module):
    """A block whose int attribute dynamo specialises on: one graph per block."""

    def __init__(self, i: int) -> None:
        super().__init__()
        self.lin, self.i = nn.Linear(4, 4), i

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.i


def test_blocks_past_the_recompile_limit_are_counted_refused_then_covered_by_warmup():
    x = torch.randn(2, 4)
    model = compile_model(nn.Sequential(*map(Scaled, range(6))), modules=(Scaled,), backend="eager")
    said = r"recompile limit .* self\.module\.i == \d \# return"  # the guard, whitespace folded
    with torch._dynamo.config.patch(recompile_limit=4):
        with pytest.warns(RuntimeWarning, match=said) as caught, track_compiles() as stats:
            model(x)
        assert caught[0].filename == __file__  # the warning names the user's line
        assert (stats.block_calls, stats.eager_block_calls) == (6, 2)
        assert stats.eager_blocks == ["Scaled x2"]
        with no_recompiles(), pytest.raises(RuntimeError, match=r"no_recompiles\(\): a compiled"):
            model(x)  # dynamo itself stays silent here: the frame only runs what it cached
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=4):
        stats = warmup(model, [x], also_eval=True)  # raises the limit to 6 blocks x 2 modes
        assert stats.eager_block_calls == 0 and stats.compiled_block_calls == 12
        with no_recompiles(), track_compiles() as steady:
            model(x).sum().backward()
    assert steady.compiled_block_calls == 6 and steady.compilations == 0


def test_compiled_model_survives_deepcopy_and_pickle(tmp_path):
    model = compile_model(TinyGPT(), backend="eager", dynamic=False)
    x = _tokens(2, 8)
    ref = model(x)
    torch.save(model, tmp_path / "m.pt")
    for twin in (copy.deepcopy(model), torch.load(tmp_path / "m.pt", weights_only=False)):
        with track_compiles() as first:
            assert torch.equal(twin(x), ref)  # torch dropped the compiled code: eager, once
        with track_compiles() as second:
            assert torch.equal(twin(x), ref)
        assert first.eager_block_calls == 2 and second.compiled_block_calls == 2
        assert all(_compiled(b) for b in twin.blocks)
