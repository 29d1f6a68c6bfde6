"""Activation checkpointing: every policy gives the unwrapped numbers and saves what we expect."""

from __future__ import annotations

import copy
import inspect
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from isotrain.checkpointing import (
    ACPolicy,
    CheckpointedTransformerBlock,
    apply_activation_checkpointing,
    measure_activation_memory,
    parse_policy,
    remove_activation_checkpointing,
    selective_policy,
)
from isotrain.checkpointing import _wrap as ac_wrap
from isotrain.checkpointing._wrap import is_checkpointed
from isotrain.contexts import StateAudit

D, H, L, T, B, V = 32, 4, 4, 16, 2, 64
UNIT = B * T * D * 4  # bytes of one fp32 (B, T, D) activation
POLICIES = ["none", "full", "every:2", "selective", "budget:50%"]


class Block(nn.Module):
    """A tiny pre-LN GPT block: forward(x) -> x."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.p = p
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, T, H, D // H).transpose(1, 2) for t in (q, k, v))  # (B, H, T, Dh)
        p = self.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(B, T, D)))
        return x + self.drop(self.fc2(F.gelu(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block(p) for _ in range(L))
        self.head = nn.Linear(D, V)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make(p: float = 0.0) -> tuple[TinyGPT, torch.Tensor]:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return TinyGPT(p), torch.randint(0, V, (B, T))


def run(model: nn.Module, idx: torch.Tensor, seed: int = 1) -> tuple[torch.Tensor, list]:
    """Forward + backward from a fixed RNG; returns the logits and every parameter gradient."""
    model.zero_grad(set_to_none=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        out = model(idx)
        F.cross_entropy(out.flatten(0, 1), idx.flatten()).backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def assert_same(a: tuple, b: tuple) -> None:
    assert torch.equal(a[0], b[0])
    for ga, gb in zip(a[1], b[1], strict=True):
        assert torch.equal(ga, gb)


# ------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("none", ACPolicy("none")),
        (" Full ", ACPolicy("full")),
        ("every:3", ACPolicy("every", every=3)),
        ("selective", ACPolicy("selective")),
        ("budget:200000000", ACPolicy("budget", budget_bytes=200_000_000)),
        ("budget:2e8", ACPolicy("budget", budget_bytes=200_000_000)),
        ("budget:200MB", ACPolicy("budget", budget_bytes=200_000_000)),
        ("budget:1.5GiB", ACPolicy("budget", budget_bytes=3 * 2**29)),
        ("budget:50%", ACPolicy("budget", budget_fraction=0.5)),
        ("budget:12.5%", ACPolicy("budget", budget_fraction=0.125)),
    ],
)
def test_parse_policy(spec: str, expected: ACPolicy) -> None:
    assert parse_policy(spec) == expected
    assert parse_policy(str(expected)) == expected  # str() round-trips to the CLI spec


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("sometimes", "unknown checkpointing policy 'sometimes'"),
        ("full:2", "'full' takes no argument"),
        ("every:0", "K must be an integer >= 1"),
        ("every:two", "K must be an integer >= 1"),
        ("budget:", "BYTES must be a number"),
        ("budget:12parsecs", "BYTES must be a number"),
        ("budget:0MB", "must be a positive number of bytes"),
        ("budget:150%", r"percentage must be in \(0, 100\]"),
    ],
)
def test_parse_policy_errors(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_policy(spec)


def test_acpolicy_validates() -> None:
    with pytest.raises(ValueError, match="exactly one of budget_bytes"):
        ACPolicy("budget")
    with pytest.raises(ValueError, match="unknown policy kind 'most'"):
        ACPolicy("most")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- correctness
@pytest.mark.parametrize("policy", POLICIES)
def test_policy_matches_unwrapped_bitwise_with_dropout(policy: str) -> None:
    model, idx = make(p=0.1)
    ref = run(copy.deepcopy(model), idx)
    keys = list(model.state_dict())
    apply_activation_checkpointing(model, policy=policy, modules=(Block,), example_inputs=(idx,))
    assert list(model.state_dict()) == keys
    assert_same(run(model, idx), ref)  # CPU fp32 recompute is deterministic: bit-exact
    remove_activation_checkpointing(model)
    assert all("forward" not in b.__dict__ for b in model.blocks)
    assert_same(run(model, idx), ref)


@pytest.mark.parametrize(
    ("policy", "where"), [("full", "model"), ("selective", "model"), ("selective", "per_block")]
)
def test_policy_under_compile_aot_eager(policy: str, where: str) -> None:
    model, idx = make()
    ref = run(copy.deepcopy(model), idx)
    keys = list(model.state_dict())
    apply_activation_checkpointing(model, policy=policy, modules=(Block,))
    torch._dynamo.reset()
    try:
        if where == "model":
            got = run(torch.compile(model, backend="aot_eager"), idx)
        else:  # the trainer's order: checkpoint, then compile each block in place
            for block in model.blocks:
                block.compile(backend="aot_eager", fullgraph=True)
            got = run(model, idx)
            assert list(model.state_dict()) == keys
    finally:
        torch._dynamo.reset()
    # aot_eager replays the same aten kernels, so fp32 on CPU is still bit-exact.
    assert_same(got, ref)


def test_a_wrapped_forward_keeps_its_signature() -> None:
    """Frameworks read it: HF Trainer drops the dataset columns `model.forward` does not name."""
    model, _ = make()
    apply_activation_checkpointing(model, policy="full", modules=(Block,))
    assert inspect.signature(model.blocks[0].forward) == inspect.signature(Block().forward)


def test_deepcopy_of_wrapped_model_uses_its_own_weights() -> None:
    model, idx = make()
    apply_activation_checkpointing(model, policy="full")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.head.bias.add_(1.0)
    assert "forward" in twin.blocks[0].__dict__  # still checkpointed
    plain = remove_activation_checkpointing(copy.deepcopy(twin))
    assert_same(run(twin, idx), run(plain, idx))
    assert not torch.equal(run(twin, idx)[0], run(model, idx)[0])
    assert measure_activation_memory(twin, idx).blocks[0].checkpointed


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_grad_mode_alone_decides_whether_blocks_checkpoint(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under no_grad the wrapped forward runs the block once and never enters checkpoint();
    # with grad enabled it checkpoints in train and in eval mode alike (the wrapper does not
    # read `module.training`), so backward re-runs each block's forward.
    model, idx = make()
    ref = {mode: model.train(mode)(idx).detach() for mode in (True, False)}
    apply_activation_checkpointing(model, policy=policy)
    entered, calls = [0], [0] * L
    for i, block in enumerate(model.blocks):
        block.fc.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))

    def counting_checkpoint(*args, **kwargs):
        entered[0] += 1
        return checkpoint(*args, **kwargs)

    monkeypatch.setattr(ac_wrap, "checkpoint", counting_checkpoint)
    for training in (True, False):
        model.train(training)
        entered[0], calls[:] = 0, [0] * L
        with torch.no_grad():
            assert torch.equal(model(idx), ref[training])
        assert entered == [0] and calls == [1] * L
        calls[:] = [0] * L
        out = model(idx)
        assert torch.equal(out.detach(), ref[training])
        assert entered == [L] and calls == [1] * L
        out.sum().backward()
        assert calls == [2] * L  # the recompute


def test_module_selection_and_errors() -> None:
    model, idx = make()
    apply_activation_checkpointing(model, policy="full", modules=lambda n, m: n == "blocks.1")
    report = measure_activation_memory(model, idx)
    assert [b.checkpointed for b in report.blocks] == [False, True, False, False]
    msg = (
        "found no blocks to checkpoint with policy 'full' in TinyGPT: "
        "looked for submodules of type GRU"
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        apply_activation_checkpointing(model, policy="full", modules=nn.GRU)
    with pytest.raises(TypeError, match="modules must be an nn.Module subclass"):
        apply_activation_checkpointing(model, policy="full", modules="Block")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="policy spec must be a str"):
        apply_activation_checkpointing(model, policy=3)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- memory
def measure(policy: str, **kw) -> tuple:
    model, idx = make()
    apply_activation_checkpointing(model, policy=policy, modules=(Block,), example_inputs=(idx,))
    return measure_activation_memory(model, idx, modules=(Block,), **kw), model


def test_saved_bytes_follow_policy() -> None:
    none, full, every, sel = (measure(p)[0] for p in ["none", "full", "every:2", "selective"])
    # Unwrapped pre-LN block: x, ln1, qkv(3), attn, x2, ln2, fc(4), gelu(4) = 16 (B, T, D) units.
    assert all(16 * UNIT <= b.saved_bytes < 17 * UNIT for b in none.blocks)
    assert all(b.saved_bytes == UNIT for b in full.blocks)  # only the block input
    assert [b.saved_bytes for b in every.blocks] == [UNIT, none.blocks[1].saved_bytes] * 2
    # Selective keeps input, qkv(3), attention out, fc(4) = 9 units (+ the attention logsumexp).
    assert all(9 * UNIT <= b.saved_bytes < 10 * UNIT for b in sel.blocks)
    assert full.total_bytes < every.total_bytes < none.total_bytes
    assert full.total_bytes < sel.total_bytes < 0.6 * none.total_bytes
    assert none.other_bytes == full.other_bytes > 0  # embedding and head are never wrapped


def test_recompute_flops() -> None:
    none, full, sel = (measure(p)[0] for p in ["none", "full", "selective"])
    assert none.recompute_flops == 0 and none.forward_flops == full.forward_flops
    # Full recompute reruns each block's forward except its last matmul: nothing in the
    # block's backward needs that output, so checkpoint's early stop never reaches it.
    down_proj = 2 * B * T * 4 * D * D
    assert full.recompute_flops == sum(b.forward_flops - down_proj for b in full.blocks)
    # Selective only reruns the attention out-projection: 2 * tokens * D * D per block.
    assert sel.recompute_flops == L * 2 * B * T * D * D
    assert full.backward_flops == none.backward_flops + full.recompute_flops


@pytest.mark.parametrize("fraction", [0.9, 0.5, 0.2])
def test_budget_meets_budget_with_fewest_blocks(fraction: float) -> None:
    none = measure("none")[0]
    budget = int(fraction * none.total_bytes)
    report, _ = measure(f"budget:{budget}")
    assert report.total_bytes <= budget
    # Identical blocks: the fewest that fit are checkpointed, the earliest first.
    gain = none.blocks[0].saved_bytes - UNIT
    n = max(0, math.ceil((none.total_bytes - budget) / gain))
    assert [b.checkpointed for b in report.blocks] == [True] * n + [False] * (L - n)


def test_budget_errors() -> None:
    model, idx = make()
    with pytest.raises(ValueError, match="needs example_inputs"):
        apply_activation_checkpointing(model, policy="budget:1MB")
    with pytest.raises(ValueError, match="is below .* what checkpointing every block still saves"):
        apply_activation_checkpointing(model, policy="budget:1000", example_inputs=idx)
    assert all("forward" not in b.__dict__ for b in model.blocks)  # failed planning left no wrap


def test_measure_leaves_state_alone() -> None:
    model, idx = make(p=0.1)
    apply_activation_checkpointing(model, policy="full")
    run(model, idx)
    grads = [p.grad.clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    report = measure_activation_memory(model, idx)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert report.peak_bytes is None  # CPU: no allocator peak
    lean = measure_activation_memory(model, idx, recompute=False)  # no unwrapped pass
    assert lean.recompute_flops is None and lean.total_bytes == report.total_bytes
    text = str(report)
    assert "| blocks.3 | yes |" in text and "recompute" in text


# ------------------------------------------------------------------------------- seed block
@pytest.mark.parametrize("mode", [True, "selective"])
def test_seed_block_matches_plain(mode: bool | str) -> None:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        plain = CheckpointedTransformerBlock(D, H, checkpoint=False, dropout=0.1)
        x = torch.randn(B, T, D, requires_grad=True)
    block = copy.deepcopy(plain)
    block.checkpoint_mode = "full" if mode is True else mode
    res = []
    for m in (plain, block):
        x.grad = None
        with torch.random.fork_rng():
            torch.manual_seed(3)
            y = m(x)
            y.square().sum().backward()
        res.append((y.detach(), [x.grad.clone()] + [p.grad.clone() for p in m.parameters()]))
    assert_same(res[0], res[1])
    saved_plain = measure_activation_memory(plain, x, modules=lambda n, m: n == "").total_bytes
    saved_ckpt = measure_activation_memory(block, x, modules=lambda n, m: n == "").total_bytes
    assert saved_ckpt < saved_plain


def test_seed_block_api() -> None:
    block = CheckpointedTransformerBlock(D, H)
    assert block.checkpoint_mode == "full"
    assert block(torch.randn(B, T, D)).shape == (B, T, D)
    with pytest.raises(ValueError, match="checkpoint must be True, False"):
        CheckpointedTransformerBlock(D, H, checkpoint="sometimes")


def test_selective_policy_with_plain_checkpoint() -> None:
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(torch.sigmoid(x @ w) @ w).sum()

    ctx = selective_policy(recompute_every_other_mm=False)
    (g_ref,) = torch.autograd.grad(fn(x), w)
    (g,) = torch.autograd.grad(checkpoint(fn, x, use_reentrant=False, context_fn=ctx), w)
    assert torch.equal(g, g_ref)


# ------------------------------------------------------------------------------- buffers
class ConvBlock(nn.Module):
    """BatchNorm (statistics written by the kernel) plus a counter and an EMA written in Python."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.drop = nn.Dropout(0.2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(c))

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.drop(F.relu(self.bn(self.conv(x)))) * scale
        with torch.no_grad():
            self.calls += 1
            self.ema.lerp_(y.mean((0, 2, 3)), 0.1)
        return x + y, y.mean()  # a tuple output


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4))
        self.layers = nn.Sequential(*(ConvBlock(4) for _ in range(4)))  # no ModuleList

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        x, aux = self.stem(x), 0.0
        for block in self.layers:
            x, a = block(x, scale=scale)
            aux = aux + a
        return x.mean((2, 3)) + aux


def conv_net() -> tuple[ConvNet, torch.Tensor]:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return ConvNet(), torch.randn(2, 3, 8, 8)


def conv_step(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """One training forward + backward; every buffer, gradient and the output after it."""
    with torch.random.fork_rng():
        torch.manual_seed(5)
        out = model(x, scale=0.5)
        out.square().sum().backward()
    return [out.detach(), *model.buffers(), *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("policy", ["full", "selective", "every:2", "budget:60%"])
def test_checkpointed_step_leaves_every_buffer_as_the_unwrapped_one(policy: str) -> None:
    model, x = conv_net()
    ref = conv_step(copy.deepcopy(model), x)
    apply_activation_checkpointing(
        model, policy=policy, modules=(ConvBlock,), example_inputs=(x,), example_kwargs={}
    )
    got = conv_step(model, x)
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))
    assert int(model.layers[0].calls) == 1 and int(model.layers[0].bn.num_batches_tracked) == 1


def test_measuring_and_budget_planning_leave_all_training_state_alone() -> None:
    model, x = conv_net()
    conv_step(model, x)  # gradients and statistics exist
    model.layers[1].eval()  # a mixed mode must survive too
    with StateAudit(model, raise_on_leak=True, check_params=True):
        report = measure_activation_memory(
            model, x, example_kwargs={"scale": 0.5}, modules=(ConvBlock,), loss_fn=torch.sum
        )
        apply_activation_checkpointing(
            model, policy="budget:70%", modules=(ConvBlock,), example_inputs=x
        )
    assert report.total_bytes > 0 and report.blocks[0].name == "layers.0"
    with pytest.raises(ValueError, match=r"example_inputs=\(x,\) and/or example_kwargs"):
        apply_activation_checkpointing(model, policy="budget:1MB", modules=(ConvBlock,))


def test_blocks_in_a_sequential_are_found_by_type_and_the_error_says_so() -> None:
    model, _ = conv_net()
    with pytest.raises(ValueError, match=r"modules=\(ConvBlock,\)"):
        apply_activation_checkpointing(model, policy="full")
    apply_activation_checkpointing(model, policy="full", modules=(ConvBlock,))
    assert all(is_checkpointed(b) for b in model.layers)


def test_checkpointed_model_survives_pickle_and_deepcopy(tmp_path) -> None:
    model, x = conv_net()
    ref = conv_step(copy.deepcopy(model), x)
    apply_activation_checkpointing(model, policy="selective", modules=(ConvBlock,))
    torch.save(model, tmp_path / "model.pt")
    twins = [torch.load(tmp_path / "model.pt", weights_only=False), copy.deepcopy(model)]
    for twin in twins:
        assert all(is_checkpointed(b) for b in twin.layers)
        assert twin.layers[0].forward.module is twin.layers[0]  # bound to the copy
        assert all(torch.equal(a, b) for a, b in zip(conv_step(twin, x), ref))
