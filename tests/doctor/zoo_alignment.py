"""Language-model targets against the tokens the model reads, each bug beside its clean twin.

Every `setup_*(fixed)` returns the keyword arguments of `isotrain.doctor.examine` (task="lm");
the bug ones (fixed=False) cite the public report they were written from. `TWINS` are correct
setups that look like the bugs (a multi-token head, a copy task, targets handed to the model).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from tests.doctor.zoo import TinyLM, adamw, seeded
from torch import nn

V, B, T, BOS = 16, 4, 16, 1


def _ids(seed: int, rows: int = B, cols: int = T) -> torch.Tensor:
    return torch.randint(2, V, (rows, cols), generator=torch.Generator().manual_seed(seed))


def _windows(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y): T-token windows of one stream, y the next token of each x."""
    stream = _ids(seed, cols=T + 1)
    return stream[:, :-1], stream[:, 1:]


def _fit(model: nn.Module, loss_fn: Any, batches: list[Any]) -> dict[str, Any]:
    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        return loss.detach()

    return dict(model=model, optimizer=adamw(model), batches=batches, step=step, task="lm")


class Seq2Seq(nn.Module):
    """An encoder-decoder on token ids: the encoder reads the source both ways, the decoder
    its input causally; `shift_inside` builds the decoder's input from the target (BOS first),
    as Hugging Face encoder-decoders do from labels."""

    def __init__(self, *, shift_inside: bool = False, causal: bool = True, d: int = 16) -> None:
        super().__init__()
        self.causal = causal
        self.src, self.tgt, self.pos = nn.Embedding(V, d), nn.Embedding(V, d), nn.Embedding(T, d)
        self.tf = nn.Transformer(d, 2, 1, 1, 32, dropout=0.0, batch_first=True)
        self.head, self.shift_inside = nn.Linear(d, V), shift_inside

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        if self.shift_inside:
            tgt = torch.cat([torch.full_like(tgt[:, :1], BOS), tgt[:, :-1]], dim=1)
        n = tgt.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n) if self.causal else None
        pos = self.pos(torch.arange(n))
        memory_in = self.src(src) + self.pos(torch.arange(src.shape[1]))
        h = self.tf(memory_in, self.tgt(tgt) + pos, tgt_mask=mask, tgt_is_causal=self.causal)
        return self.head(h)


def _pairs(copy: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(src := _ids(s), src.clone() if copy else _ids(s + 10)) for s in (1, 2)]


def _ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, V), target.reshape(-1))


# -- labels_not_shifted: a decoder that sees the token it is scored against -------------------
def setup_decoder_fed_its_target(fixed: bool) -> dict[str, Any]:
    """https://github.com/bentrevett/pytorch-seq2seq/issues/46: which decoder outputs line up
    with which target tokens. Here the decoder is fed the whole target and scored on it, so
    each position reads the token it must predict; teacher forcing feeds tgt[:, :-1] and
    scores on tgt[:, 1:]."""

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        src, tgt = batch
        if fixed:
            return _ce(model(src, tgt[:, :-1]), tgt[:, 1:])
        return _ce(model(src, tgt), tgt)  # BUG (fixed=False): the decoder reads its answer

    return _fit(seeded(Seq2Seq), loss_fn, _pairs())


def setup_decoder_without_its_mask(fixed: bool) -> dict[str, Any]:
    """A decoder whose self-attention has no causal mask (tgt_mask left out): position t of
    the decoder's input sees the tokens after it; the encoder's input is read both ways by
    design, so the leak is judged on the decoder's."""

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        src, tgt = batch
        return _ce(model(src, tgt[:, :-1]), tgt[:, 1:])

    return _fit(seeded(lambda: Seq2Seq(causal=fixed)), loss_fn, _pairs())


# -- labels_shifted_twice -------------------------------------------------------------------
def setup_pre_shifted_labels_hf(fixed: bool) -> dict[str, Any]:
    """https://github.com/huggingface/transformers/issues/32944 (and the docstring fix in
    transformers#44642): users pre-shift their labels for a *ForCausalLM model, which shifts
    them again, "and end up training next-next-token prediction by accident"."""
    import transformers

    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=V, n_positions=T,
                                  bos_token_id=BOS, eos_token_id=BOS)  # fmt: skip
    model = seeded(lambda: transformers.GPT2LMHeadModel(cfg))
    batches = []
    for seed in (1, 2):
        x, y = _windows(seed)
        batches.append({"input_ids": x, "labels": x.clone() if fixed else y})  # BUG: y
    return dict(model=model, optimizer=adamw(model), batches=batches, task="lm")


def setup_shift_then_shifting_loss(fixed: bool) -> dict[str, Any]:
    """https://github.com/huggingface/transformers/issues/47394: GitForCausalLM shifts its
    labels by hand and hands them to a loss that shifts them again, so position t is trained
    on token t+2. Here the data already gives the next-token window y, and the loop slices
    it again."""

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        if fixed:
            return _ce(logits, y)
        return _ce(logits[:, :-1], y[:, 1:])  # BUG (fixed=False): y is shifted already

    return _fit(seeded(lambda: TinyLM(vocab=V, n_layer=1)), loss_fn, [_windows(s) for s in (1, 2)])


def setup_decoder_shifts_inside(fixed: bool) -> dict[str, Any]:
    """https://github.com/huggingface/transformers/issues/46897: Florence2 builds its decoder's
    input by shifting the labels right, then computes a loss that shifts them again, so the
    model trains against labels[..., 1:]."""

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        src, tgt = batch
        logits = model(src, tgt)  # the decoder reads BOS, tgt[0], ..., tgt[T-2]
        if fixed:
            return _ce(logits, tgt)
        return _ce(logits[:, :-1], tgt[:, 1:])  # BUG (fixed=False): shifted a second time

    return _fit(seeded(lambda: Seq2Seq(shift_inside=True)), loss_fn, _pairs())


# -- held out: written after the checks were done, tested once --------------------------------
class VQA(nn.Module):
    """An image-question answerer that computes its own loss, as BlipForQuestionAnswering does:
    the answer's decoder input is the answer shifted right (BOS first), inside."""

    def __init__(self, *, fixed: bool, d: int = 16) -> None:
        super().__init__()
        self.image, self.tok, self.pos = nn.Linear(8, d), nn.Embedding(V, d), nn.Embedding(T, d)
        layer = nn.TransformerDecoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.dec, self.head, self.fixed = nn.TransformerDecoder(layer, 1), nn.Linear(d, V), fixed

    def forward(self, image: torch.Tensor, answer: torch.Tensor) -> tuple[torch.Tensor, Any]:
        dec_in = torch.cat([torch.full_like(answer[:, :1], BOS), answer[:, :-1]], dim=1)
        n = dec_in.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        h = self.dec(self.tok(dec_in) + self.pos(torch.arange(n)), self.image(image)[:, None],
                     tgt_mask=mask, tgt_is_causal=True)  # fmt: skip
        scores = self.head(h)
        if self.fixed:
            return scores, _ce(scores, answer)
        return scores, _ce(scores[:, :-1], answer[:, 1:])  # BUG: shifted again


def setup_blip_redundant_shift(fixed: bool) -> dict[str, Any]:
    """https://github.com/huggingface/transformers/issues/23000: BlipForQuestionAnswering
    shifts the answer right for the decoder's input, then its text decoder shifts the
    prediction scores and labels again: next-next-token prediction."""
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(B, 8, generator=g), _ids(s)) for s in (1, 2)]

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        return model(*batch)[1]

    return _fit(seeded(lambda: VQA(fixed=fixed)), loss_fn, batches)


def setup_monai_latent_transformer(fixed: bool) -> dict[str, Any]:
    """https://github.com/Project-MONAI/GenerativeModels/issues/314: a transformer over an
    image's latent codes trained "to predict token N, given tokens 0-N inclusive":
    ce_loss(logits, latent) with logits of shape (B, V, T) and no shift."""

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        latent = batch
        logits = model(latent).transpose(1, 2)  # (B, V, T), as the inferer returns them
        if fixed:
            return F.cross_entropy(logits[:, :, :-1], latent[:, 1:])
        return F.cross_entropy(logits, latent)  # BUG: the code at N is its own target

    return _fit(seeded(lambda: TinyLM(vocab=V, n_layer=1)), loss_fn, [_ids(s) for s in (1, 2)])


HELD_OUT: list[tuple[str, Any]] = [
    ("labels_shifted_twice", setup_blip_redundant_shift),
    ("labels_not_shifted", setup_monai_latent_transformer),
]


# -- correct code that looks like the bugs ----------------------------------------------------
class TwoHeads(TinyLM):
    """A multi-token-prediction LM: one head for token t+1, a second for token t+2."""

    def __init__(self) -> None:
        super().__init__(vocab=V, n_layer=1)
        self.head2 = nn.Linear(16, V)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        h = self.ln_f(x)
        return self.head(h), self.head2(h)


def twin_multi_token_heads() -> dict[str, Any]:
    """Next-token and next-next-token heads, each on its own targets: right."""

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        one, two = model(x)
        return _ce(one, y) + 0.5 * _ce(two[:, :-1], y[:, 1:])

    return _fit(seeded(TwoHeads), loss_fn, [_windows(s) for s in (1, 2)])


def twin_copy_task() -> dict[str, Any]:
    """A seq2seq copy task (target == source) with teacher forcing: the encoder reads the very
    tokens the decoder predicts, which is the task, not a leak."""

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        src, tgt = batch
        return _ce(model(src, tgt[:, :-1]), tgt[:, 1:])

    return _fit(seeded(Seq2Seq), loss_fn, _pairs(copy=True))


class OwnLoss(TinyLM):
    """nanoGPT's calling convention: model(idx, targets) -> (logits, loss)."""

    def __init__(self) -> None:
        super().__init__(vocab=V, n_layer=1)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> Any:
        logits = super().forward(idx)
        return logits, _ce(logits, targets)


def twin_targets_handed_to_the_model() -> dict[str, Any]:
    """The targets passed positionally to a model that only scores with them: not read."""

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        return model(*batch)[1]

    return _fit(seeded(OwnLoss), loss_fn, [_windows(s) for s in (1, 2)])


BUGS: list[tuple[str, Any]] = [
    ("labels_not_shifted", setup_decoder_fed_its_target),
    ("labels_shifted_twice", setup_pre_shifted_labels_hf),
    ("labels_shifted_twice", setup_shift_then_shifting_loss),
    ("labels_shifted_twice", setup_decoder_shifts_inside),
]
TWINS = [twin_multi_token_heads, twin_copy_task, twin_targets_handed_to_the_model]
# (kind, bug, clean twin, severity), as tests/doctor/test_zoo.py's CASES
CASES: list[tuple[str, Any, Any, str]] = [
    (kind, (lambda m=make: m(False)), (lambda m=make: m(True)), "error")
    for kind, make in BUGS + HELD_OUT
]
