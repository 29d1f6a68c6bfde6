"""padding_leak in its forms: a mask inverted or unused, no mask at all, the first position
pooled from left padding, and the padded argument not the first (a second sequence beside
the ids, by position or by keyword); each beside a correct model that stays clean, masks taken
from the pad id and masks of one length belonging to different sequences included."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests.doctor import zoo_model as zm
from tests.doctor.test_model_family import one
from tests.doctor.test_trust import examined_untouched, no_alarm
from tests.doctor.zoo import adamw, ce, lm_setup, seeded
from torch import nn

from isotrain.doctor import examine


def _leak(setup: dict[str, Any]) -> Any:
    return one(examined_untouched(setup, checks=["padding_leak"]), "padding_leak")


# -- one sequence: an inverted mask, no mask, and a causal model that needs none --------------
class Encoder(nn.Module):
    """An encoder layer over token ids; `key_mask` says what it is given as its padding mask."""

    def __init__(self, key_mask: str) -> None:
        super().__init__()
        self.key_mask = key_mask
        self.emb = nn.Embedding(zm.VOCAB, 16)
        self.enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        pad = {"right": attention_mask == 0, "inverted": attention_mask.bool(), "none": None}
        h = self.enc(self.emb(input_ids), src_key_padding_mask=pad[self.key_mask])
        return self.head(h[:, 0])  # the first token's state (a [CLS] pooling)


def _encoder(key_mask: str, *, left: bool = False) -> dict[str, Any]:
    model = seeded(lambda: Encoder(key_mask))
    return dict(model=model, optimizer=adamw(model), batches=zm.padded_batches(left=left),
                loss_fn=zm.pooled_ce)  # fmt: skip


@pytest.mark.parametrize("key_mask", ["inverted", "none"])
def test_a_mask_inverted_or_unused_is_an_error(key_mask: str) -> None:
    f = _leak(_encoder(key_mask))
    assert f.severity == "error"
    assert f.evidence.startswith(
        "changing only the 10 padded positions of input_ids (attention_mask 0) to a real token "
        "changed the per-sample outputs (pooled) of row(s) 1, 2, 3 "
    )
    assert "the model computes there, the ids kept (by " in f.evidence


def test_a_mask_used_right_is_clean() -> None:
    no_alarm(examined_untouched(_encoder("right"), checks="all"))
    assert examine(**_encoder("right"), checks=["padding_leak"]).findings == []


def test_the_first_position_pooled_from_left_padding_is_named() -> None:
    """The same encoder on left-padded rows: position 0 is padding there, so its state (the
    [CLS] pooling) reads the padding, mask or not."""
    f = one(examine(**_encoder("right", left=True), checks=["padding_leak"]), "padding_leak")
    assert f.severity == "error" and "row(s) 1, 2, 3 " in f.evidence


class Unmasked(nn.Module):
    """A bidirectional encoder (or a causal one) called with token ids only."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal
        self.emb = nn.Embedding(zm.VOCAB, 16)
        self.enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, zm.VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1]) if self.causal else None
        return self.head(self.enc(self.emb(ids), src_mask=mask, is_causal=self.causal))


def _unmasked(causal: bool) -> dict[str, Any]:
    model = seeded(lambda: Unmasked(causal))
    batches = [(b["input_ids"], b["input_ids"]) for b in zm.padded_batches()]

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        ids, _ = batch
        return F.cross_entropy(m(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())

    return dict(model=model, optimizer=adamw(model), batches=batches, loss_fn=loss_fn)


def test_padding_without_a_mask_is_a_warning_and_a_causal_model_needs_none() -> None:
    f = one(examine(**_unmasked(False), checks=["padding_leak"]), "padding_leak")
    assert f.severity == "warning" and "of ids (0, filling the ends of 3 rows)" in f.evidence
    assert "the model is given no mask to ignore it" in f.evidence
    assert examine(**_unmasked(True), checks=["padding_leak"]).findings == []


def test_a_batch_without_padding_has_nothing_to_leak() -> None:
    assert examine(**lm_setup(), checks=["padding_leak"]).findings == []
    unpadded = [{**b, "attention_mask": torch.ones_like(b["attention_mask"])}
                for b in zm.padded_batches()]  # fmt: skip
    setup = {**_encoder("inverted"), "batches": unpadded}
    assert examine(**setup, checks=["padding_leak"]).findings == []


# -- several sequences: the padded one is not the first -----------------------------------
class Towers(nn.Module):
    """A two-tower retriever: one encoder for the query and the document, their masked means,
    a score per pair. Without masks it takes them from the pad id (`ids != PAD`); `fixed=False`
    leaves the document's padding unmasked, in its attention and its mean."""

    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.fixed = fixed
        self.emb = nn.Embedding(zm.VOCAB, 16)
        self.enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)

    def _encode(self, ids: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
        h = self.enc(self.emb(ids), src_key_padding_mask=None if real is None else ~real)
        m = torch.ones_like(ids) if real is None else real
        m = m.unsqueeze(-1).to(h.dtype)
        return (h * m).sum(1) / m.sum(1)

    def forward(self, query_ids: torch.Tensor, doc_ids: torch.Tensor,
                query_mask: Any = None, doc_mask: Any = None) -> torch.Tensor:  # fmt: skip
        q_real = query_ids != zm.PAD if query_mask is None else query_mask.bool()
        d_real = doc_ids != zm.PAD if doc_mask is None else doc_mask.bool()
        q = self._encode(query_ids, q_real)
        d = self._encode(doc_ids, d_real if self.fixed else None)
        return (q * d).sum(-1)  # (B,): one score per pair


def _towers(fixed: bool, *, masks: bool) -> dict[str, Any]:
    """Queries and documents of one length (8), each padded to its longest row with PAD;
    called as model(query_ids, doc_ids), or by keyword with each one's mask."""
    model = seeded(lambda: Towers(fixed))
    g = torch.Generator().manual_seed(7)
    d_mask = (torch.arange(8)[None] < torch.tensor([4, 8, 6, 2])[:, None]).long()  # 12 pads
    batches = []
    for b in zm.padded_batches():
        doc = torch.randint(1, zm.VOCAB, (4, 8), generator=g).masked_fill(d_mask == 0, zm.PAD)
        y = torch.randint(0, 2, (4,), generator=g).float()
        batches.append((b["input_ids"], b["attention_mask"], doc, d_mask, y))

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        q, q_mask, doc, d_mask, y = batch
        if masks:
            score = m(query_ids=q, doc_ids=doc, query_mask=q_mask, doc_mask=d_mask)
        else:
            score = m(q, doc)
        return F.binary_cross_entropy_with_logits(score, y)

    return dict(model=model, optimizer=adamw(model), batches=batches, loss_fn=loss_fn)


def test_the_second_sequence_given_no_mask_is_named_and_one_masked_by_its_pad_id_is_not() -> None:
    """model(query_ids, doc_ids): both padded with PAD, no mask passed; the model takes each
    mask from the pad id. A real token at the query's padding moves the score (the model then
    reads it as a token, rightly), the noise on its states there does not: not named. The
    document's padding is read: named, by its name."""
    f = _leak(_towers(False, masks=False))
    assert f.severity == "warning"
    assert f.evidence.startswith(
        "changing only the 12 padded positions of doc_ids (0, filling the ends of 3 rows) "
        "to a real token changed the per-sample outputs (pooled) of row(s) 0, 2, 3 "
    )
    assert "query_ids" not in f.evidence
    no_alarm(examined_untouched(_towers(True, masks=False), checks="all"))


def test_a_keyword_sequence_is_judged_by_its_own_mask() -> None:
    """By keyword, each sequence with its mask, all of one length: doc_ids is judged by
    doc_mask (an error: the mask was there), never by query_mask."""
    f = _leak(_towers(False, masks=True))
    assert f.severity == "error"
    assert f.evidence.startswith("changing only the 12 padded positions of doc_ids (doc_mask 0) ")
    no_alarm(examined_untouched(_towers(True, masks=True), checks="all"))


class Segmented(Encoder):
    """BERT's inputs by keyword: token ids, token types (0 at the padding), the mask if any."""

    def __init__(self, key_mask: str) -> None:
        super().__init__(key_mask)
        self.seg = nn.Embedding(2, 16)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                attention_mask: Any = None) -> torch.Tensor:  # fmt: skip
        pad = (
            attention_mask == 0 if self.key_mask == "right" and attention_mask is not None else None
        )
        h = self.enc(self.emb(input_ids) + self.seg(token_type_ids), src_key_padding_mask=pad)
        return self.head(h[:, 0])


def _segmented(key_mask: str, batches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    model = seeded(lambda: Segmented(key_mask))

    def loss_fn(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(m(**{k: v for k, v in b.items() if k != "labels"}), b["labels"])

    return dict(model=model, optimizer=adamw(model), batches=batches, loss_fn=loss_fn)


def test_every_padded_sequence_of_the_call_is_named_in_one_finding() -> None:
    batches = [{**b, "token_type_ids": (torch.arange(8)[None] >= 2).long() * b["attention_mask"]}
               for b in zm.padded_batches()]  # fmt: skip
    f = _leak(_segmented("none", batches))
    assert f.severity == "error" and "of input_ids (attention_mask 0)" in f.evidence
    assert "; so does the padding of token_type_ids (attention_mask 0)" in f.evidence
    no_alarm(examined_untouched(_segmented("right", batches), checks="all"))


def test_a_segment_starting_every_row_is_not_taken_for_padding() -> None:
    """Unpadded rows, no mask: the first segment's token types are 0s at every row's start in
    runs of different lengths, as left padding would be; but no row is without one, as the
    longest row would be: not padding, nothing to judge (the model reads every position)."""
    first = torch.tensor([2, 4, 3, 5])[:, None]
    batches = [{"input_ids": b["input_ids"].clamp_min(1), "labels": b["labels"],
                "token_type_ids": (torch.arange(8)[None] >= first).long()}
               for b in zm.padded_batches()]  # fmt: skip
    assert examine(**_segmented("none", batches), checks=["padding_leak"]).findings == []


class Bag(nn.Module):
    """A bag of embeddings: their sum, the padding's row held at zero by padding_idx."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(zm.VOCAB, 16, padding_idx=zm.PAD)
        self.head = nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).sum(1))


def _bag(*, left: bool) -> dict[str, Any]:
    model = seeded(Bag)
    batches = [(b["input_ids"], b["labels"]) for b in zm.padded_batches(left=left)]
    return dict(model=model, optimizer=adamw(model), batches=batches, loss_fn=ce)


def test_a_sum_over_a_padding_idx_embedding_is_not_named() -> None:
    """The padding's embedding is zero by the model's choice, so the sum ignores the padding
    (a mean would not). A real token there moves the sum, and the only state at the padding is
    that fixed row; one more pad id at the end of every row leaves the sum as it was: clean.
    Left-padded, no such row can be added without moving the real tokens: not judged."""
    assert examine(**_bag(left=False), checks=["padding_leak"]).findings == []
    (f,) = examine(**_bag(left=True), checks=["padding_leak"]).findings
    assert f.severity == "info" and f.evidence.startswith("not checked: ids's padding (0, ")
    assert "padding_idx is left as the model fixed it" in f.evidence


class Recurrent(nn.Module):
    """A GRU over padding_idx embeddings, its last state classified; `packed` runs each row
    only over its real tokens (pack_padded_sequence with the lengths the step passes)."""

    def __init__(self, packed: bool) -> None:
        super().__init__()
        self.packed = packed
        self.emb = nn.Embedding(zm.VOCAB, 16, padding_idx=zm.PAD)
        self.rnn = nn.GRU(16, 16, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        if self.packed:
            x = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                  enforce_sorted=False)  # fmt: skip
        _, h = self.rnn(x)  # BUG (not packed): h has run over the padding too
        return self.head(h[-1])


def _recurrent(packed: bool) -> dict[str, Any]:
    model = seeded(lambda: Recurrent(packed))
    batches = [(b["input_ids"], b["attention_mask"].sum(1), b["labels"])
               for b in zm.padded_batches()]  # fmt: skip

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        ids, lengths, y = batch
        return F.cross_entropy(m(ids, lengths), y)

    return dict(model=model, optimizer=adamw(model), batches=batches, loss_fn=loss_fn)


def test_a_recurrent_state_run_over_the_padding_is_named_by_one_more_pad() -> None:
    """No state to move with the ids kept (the padding_idx row, a GRU the doctor does not
    watch): one more pad id at the end of every row moves the last state, not when packed."""
    f = _leak(_recurrent(False))
    assert f.severity == "warning" and "of ids (0, filling the ends of 3 rows)" in f.evidence
    assert ", and so did one more pad id at the end of every row (by " in f.evidence
    no_alarm(examined_untouched(_recurrent(True), checks="all"))


class LeftDecoder(nn.Module):
    """A one-block decoder written by hand over left-padded prompts, given no mask: embeddings
    (the pad's fixed by padding_idx), a layer norm, causal attention in plain matmuls; `fixed`
    masks the padded keys it finds by the pad id (each position still sees itself)."""

    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.fixed = fixed
        self.emb = nn.Embedding(zm.VOCAB, 16, padding_idx=zm.PAD)
        self.pos = nn.Embedding(8, 16)
        self.norm, self.qkv = nn.LayerNorm(16), nn.Linear(16, 48)
        self.head = nn.Linear(16, zm.VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        T = ids.shape[1]
        x = self.norm(self.emb(ids) + self.pos(torch.arange(T)))  # (B, T, 16)
        q, k, v = self.qkv(x).chunk(3, -1)
        hidden = torch.ones(T, T, dtype=torch.bool).triu(1)  # (T, T): the future
        if self.fixed:  # BUG (not fixed): real tokens attend to the padding before them
            hidden = hidden | ((ids == zm.PAD)[:, None, :] & ~torch.eye(T, dtype=torch.bool))
        att = (q @ k.transpose(1, 2) / 4).masked_fill(hidden, float("-inf")).softmax(-1)
        return self.head(x + att @ v)


def _left_decoder(fixed: bool) -> dict[str, Any]:
    model = seeded(lambda: LeftDecoder(fixed))
    batches = [(b["input_ids"], b["input_ids"]) for b in zm.padded_batches(left=True)]

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        ids, _ = batch
        logits = m(ids)[:, :-1].flatten(0, 1)
        return F.cross_entropy(logits, ids[:, 1:].flatten(), ignore_index=zm.PAD)

    return dict(model=model, optimizer=adamw(model), batches=batches, loss_fn=loss_fn)


def test_left_padding_read_by_a_hand_written_attention_is_named_at_its_norm() -> None:
    """Left padding cannot be lengthened and the pad's embedding is fixed: the layer norm's
    output at the padding is the state moved with the ids kept, and the real tokens read it
    unless their attention masks the pad id's keys."""
    f = _leak(_left_decoder(False))
    assert f.severity == "warning" and "of ids (0, filling the starts of 3 rows)" in f.evidence
    assert ", and so did noise on 1 hidden state the model computes there" in f.evidence
    no_alarm(examined_untouched(_left_decoder(True), checks="all"))
