"""The kinds of public reports, beyond the zoo's pairs: where each finding points, Hugging Face
models given dict batches without a loss_fn, and a DataLoader as the batches."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from tests.doctor import zoo, zoo_reports
from torch.utils.data import DataLoader, TensorDataset

from isotrain.doctor import examine


def _line(fn: Any, text: str) -> str:
    """`zoo_reports.py:N` of the first line of `fn` containing `text`."""
    lines, start = inspect.getsourcelines(fn)
    return f"zoo_reports.py:{start + next(i for i, s in enumerate(lines) if text in s)}"


@pytest.mark.parametrize(
    ("kind", "setup", "fn", "text"),
    [
        ("loss_broadcast", zoo_reports.setup_broadcast, zoo_reports.mse_unsqueezed, "mse_loss"),
        ("stale_gradient", zoo_reports.setup_stale, zoo_reports.step_without_zero_grad,
         "opt.step()"),
        ("accumulation_scale", zoo_reports.setup_accumulation, zoo_reports.step_accumulating,
         "loss.backward()"),
        ("graph_retained", zoo_reports.setup_graph, zoo_reports.step_summing_losses, "+="),
        ("lr_collapse", zoo_reports.setup_lr, zoo_reports.setup_lr, "scheduler.step()"),
    ],
)  # fmt: skip
def test_a_finding_points_at_the_users_line(kind: str, setup: Any, fn: Any, text: str) -> None:
    (f,) = examine(**setup(False), checks=[kind]).of(kind)
    assert f.where.endswith(_line(fn, text)), f


def test_a_loss_divided_by_the_accumulation_steps_twice_is_found() -> None:
    def step(model: torch.nn.Module, opt: Any, batch: Any) -> Any:
        x, y = batch
        opt.zero_grad()
        for xs, ys in zip(x.chunk(4), y.chunk(4), strict=True):
            loss = torch.nn.functional.cross_entropy(model(xs), ys) / 4
            (loss / 4).backward()  # divided by the accumulation steps twice
        opt.step()
        return loss.detach()

    (f,) = examine(**zoo.mlp_setup(step=step), checks=["accumulation_scale"]).findings
    assert "is 0.25 x the mean gradient" in f.evidence and "divided" in f.evidence


def _gpt2() -> Any:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=16)
    return zoo.seeded(lambda: transformers.GPT2LMHeadModel(cfg))


def _padded(pad: int, *, masked: bool) -> list[dict[str, torch.Tensor]]:
    out = []
    for seed in (1, 2):
        ids = torch.randint(1, 32, (4, 16), generator=torch.Generator().manual_seed(seed))
        mask = torch.ones_like(ids)
        ids[1:, 10:], mask[1:, 10:] = pad, 0
        labels = ids.masked_fill(mask == 0, -100) if masked else ids.clone()
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def test_hugging_face_dict_batches_need_no_loss_fn_and_their_padding_is_checked() -> None:
    model = _gpt2()
    kinds = ["labels_not_shifted", "padding_in_loss"]
    good = examine(model, zoo.adamw(model), _padded(0, masked=True), task="lm", checks=kinds)
    assert not [f for f in good.findings if f.severity != "info"], good
    bad = examine(model, zoo.adamw(model), _padded(0, masked=False), task="lm", checks=kinds)
    (f,) = bad.findings
    assert (f.kind, f.severity) == ("padding_in_loss", "error")
    assert f.evidence.startswith("18 of the 18 positions where attention_mask is 0 have labels 0")


def test_an_mbart_causal_lm_given_labels_equal_to_its_inputs_learns_to_copy() -> None:
    """https://github.com/huggingface/transformers/issues/27517: MBartForCausalLM does not shift
    labels (GPT-2 and Llama do), so the tutorial's labels = input_ids train it to copy."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MBartConfig(vocab_size=32, d_model=16, decoder_layers=1,
                                   decoder_attention_heads=2, decoder_ffn_dim=32,
                                   max_position_embeddings=32)  # fmt: skip
    model = zoo.seeded(lambda: transformers.MBartForCausalLM(cfg))
    ids = [
        torch.randint(3, 32, (4, 16), generator=torch.Generator().manual_seed(s)) for s in (1, 2)
    ]
    batches = [{"input_ids": x, "labels": x} for x in ids]
    (f,) = examine(
        model, zoo.adamw(model), batches, task="lm", checks=["labels_not_shifted"]
    ).findings
    assert f.severity == "error" and "modeling_mbart.py" in f.where
    assert "100% of its 64 targets equal the input token at the same position" in f.evidence
    gpt2 = _gpt2()  # shifts inside: the same batches are right for it
    ok = examine(gpt2, zoo.adamw(gpt2), batches, task="lm", checks=["labels_not_shifted"])
    assert ok.findings == []


def test_dict_batches_of_a_model_that_returns_its_loss_need_no_loss_fn() -> None:
    model = _gpt2()
    batches = _padded(0, masked=True)
    d = examine(model, zoo.adamw(model), batches, checks=["params_unchanged", "unused_parameter"])
    assert d.findings == []
    unlabelled = [{k: v for k, v in b.items() if k != "labels"} for b in batches]
    found = examine(model, zoo.adamw(model), unlabelled, checks=["params_unchanged"])
    (err,) = found.of("doctor_error")
    assert "the step raised ValueError: the model returned no .loss for a dict" in err.evidence
    with pytest.raises(ValueError, match="a dict batch needs neither"):
        examine(model, zoo.adamw(model), [(b["input_ids"],) for b in batches])


def test_a_dataloader_is_examined_by_its_first_batches_and_its_order_is_left_alone() -> None:
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(32, 8), torch.randint(0, 4, (32,)))
    loader = DataLoader(data, batch_size=8, shuffle=True, generator=g)
    twin = DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3))
    model = zoo.seeded(zoo.MLP)
    d = examine(model, zoo.adamw(model), loader, step=zoo.good_step, checks=["host_sync"])
    assert d.ok
    assert all(torch.equal(a[0], b[0]) for a, b in zip(loader, twin, strict=True))


@torch.library.custom_op("isotrain_zoo::host_matmul", mutates_args=())
def host_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A kernel outside the dispatcher (as a C++ or Triton one is): autocast never sees it."""
    return torch.from_numpy(x.detach().numpy() @ w.detach().numpy().T)


@host_matmul.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


def _autocast_step(matmul: Any) -> Any:
    def step(model: torch.nn.Module, opt: Any, batch: Any) -> Any:
        x, y = batch
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = model.fc1(x)
            extra = matmul(x, model.fc1.weight.detach())  # a matmul the region should cast
            loss = torch.nn.functional.cross_entropy(model.fc2(torch.relu(h + extra)), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def test_matmuls_that_escape_the_autocast_region_are_named_at_their_line() -> None:
    def out_form(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, w.t(), out=torch.empty(x.shape[0], w.shape[0]))

    d = examine(**zoo.mlp_setup(step=_autocast_step(out_form)), checks=["autocast_not_applied"])
    (f,) = d.findings
    assert f.severity == "warning" and "aten.mm.out (an in-place or out= form" in f.evidence
    assert f.where.endswith(f"test_reports.py:{inspect.getsourcelines(out_form)[1] + 1}")
    kernel = examine(**zoo.mlp_setup(step=_autocast_step(host_matmul)),
                     checks=["autocast_not_applied"])  # fmt: skip
    (info,) = kernel.findings
    assert info.severity == "info" and "custom op isotrain_zoo::host_matmul" in info.evidence
    plain = examine(**zoo.mlp_setup(step=_autocast_step(torch.nn.functional.linear)),
                    checks=["autocast_not_applied"])  # fmt: skip
    assert plain.findings == []
