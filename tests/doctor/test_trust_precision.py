"""The precision family on correct 16-bit training code as libraries write it: tiny Hugging Face
causal LMs (GPT-2, Llama) under bfloat16 and float16 autocast, in pure bfloat16 and float16,
frozen 16-bit tables, fused optimizers, Fabric and accelerate. Each is examined with the three
kinds (and the fast checks where the setup was clean before): the kinds ran, measured something
("not checked" fails), named no error or warning, and left the objects untouched."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests.doctor.test_trust import examined_untouched
from tests.doctor.zoo import seeded
from tests.doctor.zoo_precision import near_fit
from torch import nn

from isotrain.doctor import Diagnosis

transformers = pytest.importorskip("transformers")

KINDS = ["loss_in_low_precision", "grad_underflow", "optimizer_eps_underflow"]
Step = Callable[[nn.Module, Any, Any], torch.Tensor]


def gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)  # fmt: skip
    return seeded(lambda: transformers.GPT2LMHeadModel(cfg))


def llama() -> nn.Module:
    cfg = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=32, max_position_embeddings=16, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return seeded(lambda: transformers.LlamaForCausalLM(cfg))


def tokens() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 32, (2, 8), generator=g) for _ in range(2)]
    return [{"input_ids": x, "labels": x} for x in ids]


def hf_step(*, autocast: torch.dtype | None = None, scaler: Any = None) -> Step:
    """The model's own loss (labels in the batch), under `autocast` if given; with a scaler:
    scale, backward, unscale_ before clipping, step, update (the AMP recipe)."""

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        on = autocast is not None
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=on):
            loss = model(**batch).loss
        if scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        return loss.detach()

    return step


def judged(setup: dict[str, Any], checks: Any = KINDS) -> Diagnosis:
    """examine, untouched; the three kinds ran and measured; no error or warning of them (of
    any kind when `checks` is wider), no doctor_error."""
    d = examined_untouched(setup, checks=checks)
    assert set(KINDS) <= set(d.checks), d.checks
    assert not d.of("doctor_error"), d
    loud = [f for f in d.findings if f.severity != "info"]
    assert not [f for f in loud if f.kind in KINDS or checks != KINDS], d
    assert not [f for f in d.findings if f.kind in KINDS and "not checked" in f.evidence], d
    return d


def adamw(model: nn.Module, **kw: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, **kw)


# -- 1, 2: float32 parameters, bfloat16 autocast; float16 autocast with a GradScaler ----------


@pytest.mark.parametrize("make", [gpt2, llama])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_precision_of_a_causal_lm_is_clean(
    make: Callable[[], nn.Module], dtype: torch.dtype
) -> None:
    model = make()
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    setup = dict(model=model, optimizer=adamw(model), batches=tokens(),
                 step=hf_step(autocast=dtype, scaler=scaler))  # fmt: skip
    d = judged(setup, checks="fast" if make is llama else KINDS)
    assert not [f for f in d.findings if f.kind in KINDS], d  # not even information


# -- 3: pure bfloat16 LLM fine-tuning, AdamW's default eps ------------------------------------


@pytest.mark.parametrize("make", [gpt2, llama])
def test_pure_bfloat16_finetuning_with_default_eps_is_clean(make: Callable[[], nn.Module]) -> None:
    """eps=1e-8 is a normal bfloat16 number: the probe step stays finite. Both models' own loss
    (transformers' ForCausalLMLoss) casts the bfloat16 logits to float32 before the
    cross-entropy, so no loss is low-precision: the cross-entropy really returned float32. Not
    examined with every check: the update family's update_lost_to_rounding rightly warns here
    (AdamW's 1e-3 steps are below half the bfloat16 spacing of norm weights near 1)."""
    model = make().to(torch.bfloat16)
    setup = dict(model=model, optimizer=adamw(model), batches=tokens(), step=hf_step())
    d = judged(setup)
    assert not [f for f in d.findings if f.kind in KINDS], d
    twin = make().to(torch.bfloat16)  # the step outside examine (it puts back what it kept)
    assert hf_step()(twin, adamw(twin), tokens()[0]).dtype == torch.float32


# -- 4: fused Adam/AdamW and Adam with eps=1e-4 on float16 parameters -------------------------


@pytest.mark.parametrize(
    ("opt", "scaled"),
    [("fused AdamW", False), ("fused Adam", True), ("Adam eps=1e-4", False)],
)
def test_float16_parameters_with_an_optimizer_float16_holds_are_clean(
    opt: str, scaled: bool
) -> None:
    """A fused kernel computes in float32; eps=1e-4 is a float16 number. The fused optimizer
    takes a GradScaler's float16 gradients (it unscales them itself). Without a scaler,
    grad_underflow may say, as information, that nothing is lost yet."""
    model = llama().half()
    optimizer = {
        "fused AdamW": lambda: adamw(model, fused=True),
        "fused Adam": lambda: torch.optim.Adam(model.parameters(), lr=1e-3, fused=True),
        "Adam eps=1e-4": lambda: torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4),
    }[opt]()
    scaler = torch.amp.GradScaler("cpu") if scaled else None
    step = hf_step() if scaler is None else _scaled_without_unscale(scaler)
    judged(dict(model=model, optimizer=optimizer, batches=tokens(), step=step))


def _scaled_without_unscale(scaler: torch.amp.GradScaler) -> Step:
    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(opt)  # a fused optimizer: found_inf and the scale go to its kernel
        scaler.update()
        return loss.detach()

    return step


# -- 5: a frozen float16 table or buffer beside trained float32 parameters --------------------


class FrozenTable(nn.Module):
    """A frozen float16 embedding table (requires_grad False) and a float16 buffer, read in
    float32 by a trained float32 head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16).half().requires_grad_(False)
        self.register_buffer("scale", torch.ones(16, dtype=torch.float16))
        self.head = nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).float() * self.scale.float())


def _next_token(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    ids = batch["input_ids"]
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    opt.step()
    return loss.detach()


def _to_float32(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    return out.float()


def test_frozen_float16_tables_in_the_optimizer_are_never_stepped_so_not_probed() -> None:
    """AdamW(model.parameters()) holds the frozen float16 table too, but a parameter with no
    gradient is never stepped: its dtype cannot make the step NaN. Its trained twin is named."""
    model = seeded(FrozenTable)
    d = judged(dict(model=model, optimizer=adamw(model), batches=tokens(), step=_next_token),
               checks="fast")  # fmt: skip
    assert not [f for f in d.findings if f.kind in KINDS], d
    lm = llama()
    lm.model.embed_tokens.half().requires_grad_(False)  # a frozen float16 vocabulary
    lm.model.embed_tokens.register_forward_hook(_to_float32)
    judged(dict(model=lm, optimizer=adamw(lm), batches=tokens(), step=hf_step()))
    model = seeded(FrozenTable)
    model.emb.requires_grad_(True)  # the same table trained in float16 with eps=1e-8: NaN
    d = examined_untouched(dict(model=model, optimizer=adamw(model), batches=tokens(),
                                step=_next_token), checks=["optimizer_eps_underflow"])  # fmt: skip
    assert [f.severity for f in d.findings] == ["error"], d


# -- 6: a float32 loss from 16-bit logits; Fabric and accelerate in bfloat16 ------------------


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_loss_on_16_bit_logits_cast_to_float32_is_clean(dtype: torch.dtype) -> None:
    model = seeded(TinyLM).to(dtype)
    eps = 1e-4 if dtype == torch.float16 else 1e-8
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=eps)
    d = judged(dict(model=model, optimizer=opt, batches=tokens(), step=_next_token))
    assert not d.of("loss_in_low_precision") and not d.of("optimizer_eps_underflow"), d


@pytest.fixture
def fresh_accelerate() -> Iterator[None]:
    """accelerate keeps its mixed precision in a process-wide state: reset before and after."""
    state = pytest.importorskip("accelerate.state")
    state.AcceleratorState._reset_state(reset_partial_state=True)
    try:
        yield
    finally:
        state.AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.usefixtures("fresh_accelerate")
def test_accelerate_bfloat16_mixed_precision_is_clean() -> None:
    """accelerate's mixed_precision="bf16" runs on CPU (its forward autocast to bfloat16).
    Its "fp16" does not: on CPU it turns into float32 training, nothing 16-bit to judge."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = llama()
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    judged(dict(model=model, optimizer=opt, batches=tokens(), step=step), checks="fast")


def _fabric(precision: str) -> dict[str, Any]:
    fabric_module = pytest.importorskip("lightning.fabric")
    fabric = fabric_module.Fabric(accelerator="cpu", devices=1, precision=precision)
    model = llama()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch).loss
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        return loss.detach()

    return dict(model=model, optimizer=opt, batches=tokens(), step=step)


def test_fabric_bfloat16_mixed_and_true_are_clean_and_its_float16_true_adamw_is_named() -> None:
    """Fabric wraps the optimizer in FabricAdamW, a subclass of AdamW whose constructor takes
    the optimizer: the probe builds the AdamW inside. "bf16-true" (bfloat16 parameters) is
    judged on the three kinds only: update_lost_to_rounding rightly warns there, as in pure
    bfloat16. "16-true" is float16 parameters with eps=1e-8: the report's bug."""
    judged(_fabric("bf16-mixed"), checks="fast")
    judged(_fabric("bf16-true"))
    d = examined_untouched(_fabric("16-true"), checks=["optimizer_eps_underflow"])
    (f,) = d.findings
    assert f.severity == "error" and f.where == "FabricAdamW param group 0 (float16)", d


# -- 7: the cross-entropy autocast computes in float32 -----------------------------------------


@pytest.mark.parametrize("loss", ["F.cross_entropy", "nn.CrossEntropyLoss"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_loss_autocast_runs_in_float32_on_16_bit_logits_is_clean(
    loss: str, dtype: torch.dtype
) -> None:
    """Llama's logits are 16-bit under autocast (the upcast is in its own loss, not used here);
    torch's autocast runs the cross-entropy in float32, so the loss is float32."""
    model = llama()
    criterion = F.cross_entropy if loss == "F.cross_entropy" else nn.CrossEntropyLoss()
    step = _autocast_loss(dtype, criterion)
    d = judged(dict(model=model, optimizer=adamw(model), batches=tokens(), step=step))
    assert not [f for f in d.findings if f.kind in KINDS], d
    twin = llama()  # the step outside examine: 16-bit logits, a float32 loss
    assert step(twin, adamw(twin), tokens()[0]).dtype == torch.float32
    with torch.autocast("cpu", dtype=dtype):
        assert twin(input_ids=tokens()[0]["input_ids"]).logits.dtype == dtype


def _autocast_loss(dtype: torch.dtype, criterion: Callable[..., torch.Tensor]) -> Step:
    """The next-token cross-entropy on the model's logits inside the autocast region, with a
    GradScaler for float16."""
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        ids = batch["input_ids"]
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            logits = model(input_ids=ids).logits
            out = criterion(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        scaler.scale(out).backward()
        scaler.step(opt)
        scaler.update()
        return out.detach()

    return step


# -- a GradScaler subclass with its own scale (FSDP's ShardedGradScaler) ----------------------


@pytest.fixture
def one_rank() -> Iterator[None]:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank")
def test_a_loss_fsdps_sharded_grad_scaler_scales_is_scaled() -> None:
    """ShardedGradScaler.scale never calls GradScaler.scale; its loss is scaled all the same,
    so grad_underflow has nothing to say (it said "no GradScaler scales the loss")."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    model = seeded(lambda: nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4)))
    scaler = ShardedGradScaler("cpu")

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            pred = model(x)
        loss = F.mse_loss(pred.float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    setup = dict(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                 batches=near_fit(model), step=step)  # fmt: skip
    d = judged(setup)
    assert not [f for f in d.findings if f.kind in KINDS], d
