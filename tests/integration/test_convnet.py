"""The five patterns on a ResNet-style BatchNorm network with blocks of several shapes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from tests.integration.zoo import BasicBlock, ResNet, seeded

from isotrain.autograd import quantize_layers
from isotrain.checkpointing import apply_activation_checkpointing, measure_activation_memory
from isotrain.compile import compile_model, no_recompiles, track_compiles, warmup
from isotrain.contexts import StateAudit, eval_mode
from isotrain.guard import StepGuard


def images(i: int, size: int = 12, *, poisoned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(8, 3, size, size, generator=g), torch.randint(0, 10, (8,), generator=g)
    if poisoned:
        x[3, 1, 4, 4] = float("nan")  # one pixel of one image
    return x, y


def sgd_step(model: torch.nn.Module, i: int) -> None:
    x, y = images(i)
    F.cross_entropy(model(x), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
            p.grad = None


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("policy", ["full", "selective", "every:2", "budget:60%"])
def test_checkpointed_training_equals_unwrapped_buffers_included(policy: str) -> None:
    ref = seeded(ResNet)
    model = copy.deepcopy(ref)
    x = images(0)[0]
    with StateAudit(model, raise_on_leak=True, check_params=True):  # planning touches nothing
        apply_activation_checkpointing(
            model, policy=policy, modules=(BasicBlock,), example_inputs=x
        )
    for m in (ref, model):
        for i in range(2):
            sgd_step(m, i)
    assert all(
        torch.equal(a, b) for a, b in zip(ref.state_dict().values(), model.state_dict().values())
    )
    assert int(model.layer1[0].bn1.num_batches_tracked) == 2  # once per step, not twice
    with torch.no_grad():
        assert torch.equal(ref.eval()(x), model.eval()(x))


def test_measuring_leaves_statistics_and_the_error_names_the_block_type() -> None:
    model = seeded(ResNet)
    with StateAudit(model, raise_on_leak=True, check_params=True):
        report = measure_activation_memory(model, images(0)[0], modules=(BasicBlock,))
    assert len(report.blocks) == 4 and report.total_bytes > 0
    with pytest.raises(ValueError, match=r"modules=\(BasicBlock,\)"):
        apply_activation_checkpointing(model, policy="full")  # blocks in nn.Sequential


def test_compile_runs_every_block_shape_compiled_after_warmup() -> None:
    model = compile_model(seeded(ResNet), modules=(BasicBlock,), backend="eager", dynamic=False)
    sizes = (12, 16)
    stats = warmup(model, [images(0, s)[0] for s in sizes], also_eval=True)
    # 3 block shapes x 2 image sizes x train/eval = 12 graphs: past dynamo's default limit of 8
    assert stats.compilations == 12 and stats.eager_block_calls == 0
    with no_recompiles(), track_compiles() as run:
        for s in sizes:
            x, y = images(1, s)
            F.cross_entropy(model(x), y).backward()
            with eval_mode(model):
                model(x)
    assert (run.block_calls, run.compiled_block_calls, run.compilations) == (16, 16, 0)


@pytest.mark.parametrize("bits", [8, 4])
def test_qat_converts_every_convolution_and_the_loss_falls(bits: int) -> None:
    model = seeded(ResNet)
    report = quantize_layers(model, bits=bits)
    assert len(report.converted) == 11 and report.skipped == ()  # 10 convolutions and fc
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = images(0)
    losses = []
    for _ in range(12):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_all_patterns_together_survive_a_nan_image_and_a_pickle(tmp_path) -> None:
    model = seeded(ResNet)
    quantize_layers(model, bits=8)
    apply_activation_checkpointing(model, policy="full", modules=(BasicBlock,))
    # aot_eager: dynamo's debug "eager" backend fails on BatchNorm inside checkpoint (torch 2.13)
    compile_model(model, modules=(BasicBlock,), backend="aot_eager", dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = StepGuard(opt, model, skip_mode="select", protect_buffers=True)
    warmup(model, [images(0)[0]], also_eval=True)
    for i in range(4):
        before = [b.clone() for b in model.buffers()]
        x, y = images(i, poisoned=i == 2)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        applied = bool(guard.step(loss.detach()).applied)
        assert applied is (i != 2)
        if not applied:
            assert all(torch.equal(a, b) for a, b in zip(model.buffers(), before))
    x = images(9)[0]
    with StateAudit(model, raise_on_leak=True), eval_mode(model):
        logits = model(x)
    assert logits.isfinite().all()
    torch.save(model, tmp_path / "model.pt")
    twin = torch.load(tmp_path / "model.pt", weights_only=False)
    with eval_mode(twin):
        assert torch.equal(twin(x), logits)
