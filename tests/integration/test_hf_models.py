"""The five patterns on Hugging Face GPT-2, Llama and T5, with HF's defaults (use_cache=True).

Tiny random-init models built from configs: nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from typing import Any

import pytest
import torch
from tests.integration.zoo import seeded

from isotrain.autograd import quantize_layers, quantize_linear_layers
from isotrain.autograd._qat import _absmax_fake_quant
from isotrain.checkpointing import apply_activation_checkpointing, measure_activation_memory
from isotrain.compile import compile_model, no_recompiles, track_compiles, warmup
from isotrain.contexts import StateAudit, eval_mode
from isotrain.guard import SkipReason, StepGuard

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    ),
    "llama": lambda: transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, vocab_size=128, max_position_embeddings=32,
    ),
    "t5": lambda: transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=2, d_kv=16,
        vocab_size=128, decoder_start_token_id=0, pad_token_id=0,
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def built() -> dict[str, torch.nn.Module]:
    """Each model once per module (tests copy it): use_cache=True, as HF configs default."""
    auto = {"t5": transformers.AutoModelForSeq2SeqLM}
    made = {}
    for name, config in CONFIGS.items():
        cls = auto.get(name, transformers.AutoModelForCausalLM)
        made[name] = seeded(lambda cls=cls, config=config: cls.from_config(config()))
        assert made[name].config.use_cache
    return made


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def step(model: torch.nn.Module, **kwargs: Any) -> tuple[Any, list[torch.Tensor]]:
    """Forward + backward from a fixed RNG (dropout); the output and every gradient."""
    model.zero_grad(set_to_none=True)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        out = model(**kwargs)
        out.loss.backward()
    return out, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("policy", ["full", "every:2", "selective", "budget:60%"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_checkpointing_with_hf_defaults_equals_the_unwrapped_model(built, name, policy) -> None:
    ref, model = copy.deepcopy(built[name]), copy.deepcopy(built[name])
    ref_out, ref_grads = step(ref, **batch(), use_cache=False)
    with StateAudit(model, raise_on_leak=True, check_params=True):
        apply_activation_checkpointing(
            model, policy=policy, example_kwargs={**batch(), "use_cache": False}
        )
    with pytest.warns(UserWarning, match=r"now run with use_cache=False"):
        out, grads = step(model, **batch())  # the config says use_cache=True
    assert out.past_key_values is None  # neither built twice (16 -> 32 positions) nor crashed
    assert torch.equal(out.loss, ref_out.loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))
    with torch.no_grad():  # generation-style forwards keep their cache
        cached = model(**batch())
    assert cached.past_key_values.get_seq_length() == 16


@pytest.mark.parametrize("name", list(CONFIGS))
def test_measuring_takes_keyword_inputs_and_leaves_everything(built, name) -> None:
    model = copy.deepcopy(built[name])
    step(model, **batch())  # gradients to keep
    with StateAudit(model, raise_on_leak=True, check_params=True):
        report = measure_activation_memory(model, example_kwargs={**batch(), "use_cache": False})
    assert report.total_bytes > 0 and len(report.blocks) == (4 if name == "t5" else 2)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_compile_runs_every_block_compiled_after_warmup(built, name) -> None:
    model = compile_model(copy.deepcopy(built[name]), backend="eager")
    torch._dynamo.reset()
    # HF specialises each layer (its index, its cache slot): one graph per block per mode. A
    # limit of 2 stands in for dynamo's 8 against a 12-layer GPT-2 (4 of 12 fell back, silently).
    with torch._dynamo.config.patch(recompile_limit=2):
        stats = warmup(model, [batch()], also_eval=True)
        with no_recompiles(), track_compiles() as run:
            step(model, **batch(1))
            with eval_mode(model):
                model(**batch(1))
    torch._dynamo.reset()
    assert stats.eager_block_calls == 0 and stats.compiled_block_calls == 4
    assert (run.block_calls, run.compiled_block_calls, run.compilations) == (4, 4, 0)


@pytest.mark.parametrize("bits", [8, 4])
def test_qat_converts_gpt2_conv1d_layers_and_the_loss_falls(built, bits) -> None:
    model = copy.deepcopy(built["gpt2"])
    report = quantize_layers(model, bits=bits, exclude=["lm_head"])
    assert len(report.converted) == 8  # c_attn, c_proj, c_fc, mlp.c_proj in each of 2 blocks
    assert report.skipped[-1] == ("lm_head", "Linear", "excluded by 'lm_head'")
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        out, _ = step(model, **batch(), use_cache=False)
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_quantize_linear_layers_converts_gpt2_conv1d_and_says_so(built, caplog) -> None:
    model = copy.deepcopy(built["gpt2"])
    fp32 = model(**batch()).logits
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # embeddings and an excluded head are choices: no warning
        with caplog.at_level(logging.INFO, logger="isotrain.autograd._qat_convert"):
            quantize_linear_layers(model, bits=4, exclude=["lm_head"])
    said = caplog.records[-1].getMessage()
    assert said.startswith("quantized 8 layer(s), left 3\n  converted transformer.h.0.attn.c_attn")
    assert "kept lm_head (Linear): excluded by 'lm_head'" in said
    layers = [m for n, m in model.named_modules() if n.endswith(("c_attn", "c_proj", "c_fc"))]
    assert len(layers) == 8 and all(type(m).__name__ == "QuantConv1D" for m in layers)
    assert type(model.lm_head) is torch.nn.Linear
    c_attn, x = layers[0], torch.randn(2, 5, 32)
    w = _absmax_fake_quant(c_attn._parameters["weight"], 0, 7)  # per output column, 4 bits
    assert torch.equal(c_attn(x), torch.addmm(c_attn.bias, x.view(10, 32), w).view(2, 5, 96))
    assert not torch.allclose(model(**batch()).logits, fp32, atol=1e-3)
    compiled = torch.compile(copy.deepcopy(built["gpt2"]), backend="eager")  # names: _orig_mod.*
    quantize_linear_layers(compiled, bits=4, exclude=["lm_head"])
    assert type(compiled.lm_head) is torch.nn.Linear


@pytest.mark.parametrize("name", list(CONFIGS))
def test_all_five_patterns_together_skip_a_nan_and_pickle(built, name, tmp_path) -> None:
    model = copy.deepcopy(built[name])
    quantize_layers(model, bits=8, kinds=("linear",))
    apply_activation_checkpointing(model, policy="every:2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = StepGuard(opt, model, skip_mode="found_inf", protect_buffers=True)
    for i in range(3):
        before = [p.detach().clone() for p in model.parameters()]
        said = pytest.warns(UserWarning, match="use_cache=False")  # once: the first forward
        with said if i == 0 else contextlib.nullcontext():
            out = model(**batch(i))
        loss = out.loss * (float("nan") if i == 1 else 1.0)
        loss.backward()
        outcome = guard.step(loss.detach())
        if i == 1:
            assert outcome.reason.item() == SkipReason.NONFINITE_LOSS
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    with StateAudit(model, raise_on_leak=True), eval_mode(model):
        logits = model(**batch(5)).logits
    torch.save(model, tmp_path / "model.pt")
    twin = torch.load(tmp_path / "model.pt", weights_only=False)
    with eval_mode(twin):
        assert torch.equal(twin(**batch(5)).logits, logits)
