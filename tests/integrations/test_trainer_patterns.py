"""All five patterns through GuardedTrainer and GuardCallback: QAT converted before (the
recipe), activation checkpointing and per-block compile as options, guard and isolated eval."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from isotrain.autograd import quantize_layers
from isotrain.checkpointing import checkpointed_blocks
from isotrain.compile import compiled_blocks, track_compiles

# aot_eager: backend="eager" runs a checkpointed region without its RNG replay (pytorch#160773)
OPTIONS = {"checkpointing": "full", "compile_blocks": {"backend": "aot_eager"}}


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _gpt2() -> Any:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2, use_cache=False
    )  # dropout on (0.1): the recompute must replay it
    model = transformers.GPT2LMHeadModel(cfg)
    quantize_layers(model, bits=8, exclude=["lm_head"])  # QAT: convert, then hand it over
    return model


def _hf_fit(tmp: Path, **options: Any) -> tuple[Any, list[torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    from isotrain.integrations.transformers import GuardedTrainer

    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 32, (16, 8), generator=g)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = GuardedTrainer(model=_gpt2(), args=args, train_dataset=data, **options)
    torch._dynamo.reset()
    try:
        with track_compiles() as stats:
            trainer.train()
    finally:
        torch._dynamo.reset()
    trainer.stats = stats
    return trainer, _params(trainer.model)


def test_guarded_trainer_checkpoints_and_compiles_blocks_bitwise(tmp_path: Path) -> None:
    _, want = _hf_fit(tmp_path / "plain")
    trainer, got = _hf_fit(tmp_path / "patterns", **OPTIONS)
    blocks = ["transformer.h.0"]
    assert checkpointed_blocks(trainer.model) == compiled_blocks(trainer.model) == blocks
    assert trainer.stats.compiled_block_calls > 0 and trainer.stats.eager_block_calls == 0
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert trainer.optimizer.guard.summary()["applied"] == 3


def test_guarded_trainer_refuses_patterns_it_cannot_apply(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from isotrain.integrations.transformers import GuardedTrainer

    args = transformers.TrainingArguments(str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match=r"checkpointing='budget:50%'\) needs a real batch"):
        GuardedTrainer(model=_gpt2(), args=args, checkpointing="budget:50%")
    with pytest.raises(ValueError, match=r"got backnd, which compile_model does not take"):
        GuardedTrainer(model=_gpt2(), args=args, compile_blocks={"backnd": "eager"})
    args.gradient_checkpointing = True
    said = r"checkpointing and args.gradient_checkpointing=True both ask for it"
    with pytest.raises(ValueError, match=said):
        GuardedTrainer(model=_gpt2(), args=args, checkpointing="full")


def _lightning_fit(**options: Any) -> tuple[Any, list[torch.Tensor]]:
    pl = pytest.importorskip("lightning.pytorch")
    from isotrain.integrations.lightning import GuardCallback

    class Blocks(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.2), nn.Tanh()) for _ in range(2)
            )
            self.head = nn.Linear(6, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            for block in self.blocks:
                x = x + block(x)
            return (self.head(x) - y).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    module = Blocks()
    quantize_layers(module, bits=8, exclude=["head"])  # QAT: convert, then hand it over
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4
    )
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0,
        callbacks=[GuardCallback(**options)],
    )  # fmt: skip
    torch._dynamo.reset()
    try:
        torch.manual_seed(2)  # dropout: the same draws in both runs
        trainer.fit(module, loader)
    finally:
        torch._dynamo.reset()
    return trainer, _params(module)


def test_guard_callback_checkpoints_and_compiles_blocks_bitwise() -> None:
    _, want = _lightning_fit()
    trainer, got = _lightning_fit(**OPTIONS)
    module = trainer.lightning_module
    assert checkpointed_blocks(module) == compiled_blocks(module) == ["blocks.0", "blocks.1"]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert trainer.optimizers[0].guard.summary()["applied"] == 4
