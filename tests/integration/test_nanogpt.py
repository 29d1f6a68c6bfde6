"""The five patterns on nanoGPT-style code: ModuleDict transformer, tied head, loss ignoring -1."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from tests.integration.zoo import GPT, seeded

from isotrain.autograd import Bf16Linear, QuantLinear, bf16_linear_layers, quantize_linear_layers
from isotrain.checkpointing import apply_activation_checkpointing
from isotrain.compile import (
    compile_model,
    default_buckets,
    no_recompiles,
    pad_to_bucket,
    track_compiles,
    warmup,
)
from isotrain.contexts import StateAudit, eval_mode, rng_isolated
from isotrain.guard import SkipReason, StepGuard


def tokens(seed: int, b: int = 4, t: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) as nanoGPT's get_batch makes them: y is x shifted by one, both contiguous."""
    data = torch.randint(0, 128, (b, t + 1), generator=torch.Generator().manual_seed(seed))
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def step(model: torch.nn.Module, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """nanoGPT's training forward (targets given: it returns the loss) from a fixed RNG."""
    model.zero_grad(set_to_none=True)
    with torch.random.fork_rng():
        torch.manual_seed(7)
        _, loss = model(*tokens(seed))
        loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("policy", ["full", "every:2", "selective", "budget:50%"])
def test_checkpointing_is_bit_exact_with_dropout(policy: str) -> None:
    ref = seeded(GPT)
    model = copy.deepcopy(ref)
    x, y = tokens(0)
    apply_activation_checkpointing(
        model, policy=policy, example_inputs=(x,), example_kwargs={"targets": y}
    )
    (loss, grads), (ref_loss, ref_grads) = step(model), step(ref)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))


def test_buckets_padded_with_minus_one_keep_the_loss_and_never_recompile() -> None:
    torch._dynamo.reset()
    model = compile_model(seeded(GPT), backend="eager", dynamic=False)
    buckets = default_buckets(32, min_len=8)  # (8, 16, 32)
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 128, (int(n),), generator=gen) for n in torch.randint(3, 34, (12,))]
    batches = [pad_to_bucket(docs[i : i + 3], buckets=buckets, ignore_index=-1) for i in (0, 3, 6)]
    shapes = [(torch.zeros(3, n, dtype=torch.long),) * 2 for n in buckets]
    stats = warmup(model, shapes, also_eval=True)
    assert stats.eager_block_calls == 0
    with no_recompiles(), track_compiles() as run, eval_mode(model):
        for x, y, lengths in batches:
            _, loss = model(x, y)  # nanoGPT's own loss: ignore_index=-1
            logits, _ = model(x)
            flat = logits.flatten(0, 1)
            per_token = F.cross_entropy(flat, y.flatten(), ignore_index=-1, reduction="none")
            real = y.flatten() != -1
            torch.testing.assert_close(loss, per_token[real].mean())  # padding changed nothing
            assert int(real.sum()) == int(lengths.sum())
    torch._dynamo.reset()
    assert run.compilations == 0 and run.compiled_block_calls == run.block_calls == 12


def test_qat_keeps_the_tied_head_and_quantized_bf16_layers_pickle(tmp_path) -> None:
    model = seeded(GPT)
    quantize_linear_layers(model, bits=4, exclude=["lm_head"])
    bf16_linear_layers(model, force=True)
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 8
    assert type(model.lm_head) is Bf16Linear
    assert model.lm_head.weight is model.transformer.wte.weight
    x = tokens(1)[0]
    with eval_mode(model):
        logits, _ = model(x)
    torch.save(model, tmp_path / "gpt.pt")
    for twin in (torch.load(tmp_path / "gpt.pt", weights_only=False), copy.deepcopy(model)):
        assert type(twin.transformer.h[0].mlp.c_fc) is QuantLinear
        assert twin.lm_head.weight is twin.transformer.wte.weight  # still tied
        with eval_mode(twin):
            assert torch.equal(twin(x)[0], logits)


def test_guard_and_a_nanogpt_estimate_loss_inside_contexts() -> None:
    model = seeded(GPT)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = StepGuard(opt, model, max_norm=1.0)  # nanoGPT's grad_clip = 1.0
    for i in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        _, loss = model(*tokens(i))
        loss = loss * (float("inf") if i == 1 else 1.0)
        loss.backward()
        outcome = guard.step(loss.detach())
        assert outcome.applied == (i != 1)
        if i == 1:
            assert outcome.reason.item() == SkipReason.NONFINITE_LOSS
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    with StateAudit(model, raise_on_leak=True), eval_mode(model), rng_isolated(seed=0):
        losses = [model(*tokens(9 + k))[1] for k in range(2)]
    assert torch.stack(losses).isfinite().all() and model.training
