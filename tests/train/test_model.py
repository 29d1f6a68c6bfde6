"""GPT: causality, shapes, tied weights, initial loss, generation."""

import math

import pytest
import torch

from isotrain.train.model.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, d_model=32)


@pytest.fixture
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG).eval()


def test_logits_shape_and_loss_scalar(model: GPT) -> None:
    idx = torch.randint(0, 256, (3, 16))
    assert model(idx).shape == (3, 16, 256)
    assert model(idx, idx).shape == ()


def test_causal_changing_token_t_never_changes_earlier_logits(model: GPT) -> None:
    idx = torch.randint(0, 256, (2, 16))
    t = 9
    changed = idx.clone()
    changed[:, t] = (changed[:, t] + 1) % 256
    a, b = model(idx), model(changed)
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_lm_head_is_tied_to_embedding(model: GPT) -> None:
    assert model.lm_head.weight is model.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # counted once


def test_initial_loss_close_to_uniform(model: GPT) -> None:
    idx, targets = torch.randint(0, 256, (2, 8, 16))
    assert model(idx, targets).item() == pytest.approx(math.log(256), abs=0.1)


def test_ignore_index_excludes_positions(model: GPT) -> None:
    idx = torch.randint(0, 256, (2, 16))
    targets = idx.clone()
    targets[:, 8:] = -100
    full = torch.nn.functional.cross_entropy(model(idx)[:, :8].flatten(0, 1), idx[:, :8].flatten())
    assert torch.allclose(model(idx, targets), full)


def test_too_long_input_names_the_fix(model: GPT) -> None:
    with pytest.raises(ValueError, match="exceeds block_size 16.*--model.block-size"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_generate_is_reproducible_with_a_generator(model: GPT) -> None:
    idx = torch.tensor([[1, 2, 3]])
    a = model.generate(
        idx, 20, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(1)
    )
    b = model.generate(
        idx, 20, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(1)
    )
    assert a.shape == (1, 23) and torch.equal(a, b)
    assert torch.equal(a[:, :3], idx)


def test_generate_greedy_matches_argmax(model: GPT) -> None:
    idx = torch.tensor([[5, 6]])
    out = model.generate(idx, 1, temperature=0.0)
    assert out[0, -1] == model(idx)[0, -1].argmax()


def test_generate_rejects_bad_arguments(model: GPT) -> None:
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        model.generate(torch.zeros(1, 1, dtype=torch.long), 1, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        model.generate(torch.zeros(1, 1, dtype=torch.long), 1, top_k=0)


def test_tanh_gelu_option_is_gpt2s_approximation() -> None:
    torch.manual_seed(0)
    exact = GPT(CFG).eval()
    tanh = GPT(GPTConfig(**{**CFG.__dict__, "gelu": "tanh"})).eval()
    tanh.load_state_dict(exact.state_dict())
    x = torch.randn(3, 32)
    assert torch.equal(tanh.blocks[0].mlp.fc(x), exact.blocks[0].mlp.fc(x))
    block = tanh.blocks[0].mlp
    expected = block.proj(torch.nn.functional.gelu(block.fc(x), approximate="tanh"))
    assert torch.equal(block(x), expected)
    idx = torch.randint(0, 256, (2, 16))
    assert not torch.equal(tanh(idx), exact(idx))


def test_generate_refuses_nan_temperature_and_bad_top_p(model: GPT) -> None:
    idx = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature must be >= 0, got nan"):
        model.generate(idx, 1, temperature=float("nan"))
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\] or None, got 1.5"):
        model.generate(idx, 1, top_p=1.5)
