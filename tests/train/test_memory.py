"""A shape whose training step cannot fit is refused before anything is built, from a lower
bound of the step's memory that the real step is measured to exceed."""

import dataclasses

import pytest
import torch

from isotrain.train import config as C
from isotrain.train import environment, loop
from isotrain.train.cli.main import main
from isotrain.train.model.memory import step_memory
from isotrain.train.precision import autocast_for

SMOKE = ["train", "--preset", "smoke", "--data.max-bytes", "60000", "--sample-tokens", "0"]


def _saved_bytes(model: torch.nn.Module, x: torch.Tensor, precision: str) -> int:
    """Bytes of the distinct storages the forward saves for backward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        autocast_for(precision, torch.device("cpu")),
    ):
        loss = model(x, x)
    loss.backward()
    return sum(seen.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-matmul"])
def test_the_bound_is_below_what_a_step_saves(precision) -> None:
    cfg = C.ModelConfig(n_layer=2, n_head=2, d_model=32, block_size=64, vocab_size=96)
    model, x = loop.build_model(cfg), torch.randint(0, 96, (3, 64))
    bound = step_memory(cfg, 3, checkpointed=False, low_precision=precision != "fp32")
    params = sum(p.numel() for p in model.parameters())
    assert bound.state == 16 * params  # weights, gradients, two AdamW moments, fp32
    saved = _saved_bytes(model, x, precision)
    assert 0.5 * saved < bound.activations <= saved  # a bound, and not a vacuous one
    ckpt = step_memory(cfg, 3, checkpointed=True, low_precision=False)
    assert ckpt.activations < bound.activations and ckpt.state == bound.state


def test_a_step_that_cannot_fit_is_refused_before_anything_is_built(
    tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.setattr(environment, "available_memory", lambda device: 2**30)
    monkeypatch.setattr(loop, "load_inputs", lambda *a, **k: pytest.fail("read the inputs"))
    monkeypatch.setattr(loop, "build_model", lambda *a, **k: pytest.fail("built a model"))
    argv = [*SMOKE, "--model.block-size", "100000", "--out-dir", str(tmp_path / "r")]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "isotrain train: error: a training step of this shape needs at least 1.8 GiB (model and "
        "AdamW state 49.3 MiB, activations 1.7 GiB) and cpu has 1.0 GiB available; lower "
        "--data.batch-size or --model.block-size (raise --grad-accum to keep the tokens per "
        "step), or pass --checkpointing.policy full\n"
    )
    monkeypatch.setattr(environment, "available_memory", lambda device: 2**28)
    assert main([*argv, "--checkpointing.policy", "full"]) == 2
    err = capsys.readouterr().err  # checkpointed already: not suggested again
    assert err.endswith(
        "lower --data.batch-size or --model.block-size (raise --grad-accum to "
        "keep the tokens per step)\n"
    ), err


def test_available_memory_is_read_where_the_machine_says() -> None:
    have = environment.available_memory(torch.device("cpu"))
    assert have is None or have > 2**20
    assert environment.available_memory(torch.device("meta")) is None


def test_setup_checks_again_the_shape_the_inputs_settle(tmp_path, monkeypatch) -> None:
    seen, load = [], loop.load_inputs

    def wider_vocab(cfg, **kw):  # as --init-from or a tokenizer.json would settle it
        cfg, *rest = load(cfg, **kw)
        return (dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=512)),
                *rest)  # fmt: skip

    monkeypatch.setattr(loop, "load_inputs", wider_vocab)
    monkeypatch.setattr(loop, "require_memory", lambda need, device, **kw: seen.append(need))
    base = C.PRESETS["smoke"]()
    data = dataclasses.replace(base.data, max_bytes=60_000)
    loop.setup(dataclasses.replace(base, out_dir=str(tmp_path), data=data))
    assert len(seen) == 2 and seen[1] > seen[0]  # the shape given, then the one settled
