"""Two bitwise promises on a random-init Hugging Face T5 (dropout 0.1), on every CPU kind:
GuardedTrainer with Seq2SeqTrainer ends on plain Seq2SeqTrainer's weights (no fault, clipping
on), and a model trained checkpointed, then unwrapped, computes the loss of the never-wrapped
model trained with the arguments checkpointing runs (`use_cache=False`: NOTE [caches in
recompute]). The slow test repeats both with ATen's, MKL's and oneDNN's AVX2 kernels forced.

Trained with HF's default `use_cache=True` instead, the never-wrapped T5 below ends 7e-7 apart
in loss on an AMD EPYC's AVX2 kernels (equal on AVX512): the cache lays K and V out
contiguously, and the attention matmul rounds differently on that layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from isotrain.checkpointing import (  # noqa: E402
    apply_activation_checkpointing,
    remove_activation_checkpointing,
)
from isotrain.integrations.transformers import GuardedTrainer  # noqa: E402

# What an AVX2-only CPU runs, as far as one process can ask for it (NOTE [forcing the CPU kind]).
AVX2 = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "ISOTRAIN_CPU_KIND": "avx2",
}


def _t5() -> Any:
    torch.manual_seed(0)
    cfg = transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128, num_heads=4, d_kv=16,
        vocab_size=256, decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.1,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(cfg)


def _rows(n: int = 32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        {"input_ids": torch.randint(1, 128, (8,), generator=g),
         "labels": torch.randint(1, 128, (8,), generator=g)}
        for _ in range(n)
    ]  # fmt: skip


class _GuardedSeq2Seq(GuardedTrainer, transformers.Seq2SeqTrainer):
    pass


def _trained(cls: type, out: str) -> dict[str, torch.Tensor]:
    model = _t5()
    args = transformers.Seq2SeqTrainingArguments(
        output_dir=out, max_steps=6, per_device_train_batch_size=4, learning_rate=1e-2,
        warmup_steps=2, max_grad_norm=1.0, save_strategy="no", report_to=[], use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True, seed=0,
    )  # fmt: skip
    cls(model=model, args=args, train_dataset=_rows()).train()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _step(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    torch.manual_seed(2)  # the same dropout masks in both models
    return model(**batch, use_cache=False).loss


def promises() -> dict[str, Any]:
    """What each promise compares: the guarded run's differing weights; both models' losses."""
    with tempfile.TemporaryDirectory() as tmp:
        guarded = _trained(_GuardedSeq2Seq, tmp)
        plain = _trained(transformers.Seq2SeqTrainer, tmp)
    apart = sorted(k for k in plain if not torch.equal(guarded[k], plain[k]))
    never, wrapped = _t5(), _t5()
    apply_activation_checkpointing(wrapped, policy="full")
    batch = {k: torch.stack([r[k] for r in _rows(4)]) for k in ("input_ids", "labels")}
    for model in (never, wrapped):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(3):
            _step(model, batch).backward()
            opt.step()
            opt.zero_grad()
    remove_activation_checkpointing(wrapped)
    losses = [_step(m, batch).item() for m in (never, wrapped)]
    aten = torch.backends.cpu.get_cpu_capability()
    return {"weights_apart": apart, "losses": losses, "aten": aten}


def test_both_promises_hold_on_this_cpu() -> None:
    got = promises()
    assert got["weights_apart"] == []
    assert got["losses"][0] == got["losses"][1]


@pytest.mark.slow
@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() == "AVX2",
    reason="this CPU's own kernels are AVX2: the test above ran them",
)
def test_both_promises_hold_with_avx2_kernels() -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, **AVX2, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
    code = "import json, tests.integration.test_t5_promises as t; print(json.dumps(t.promises()))"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["aten"] == "AVX2"
    assert got["weights_apart"] == []
    assert got["losses"][0] == got["losses"][1]
