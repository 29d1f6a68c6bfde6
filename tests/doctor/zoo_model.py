"""The network itself built wrong the way users build it, each bug beside its clean twin.

Every `setup_*(fixed)` returns the keyword arguments of `isotrain.doctor.examine`; the bug
ones (fixed=False) cite the public report they were written from (model_reports.md). The
models are tiny.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from tests.doctor.zoo import adamw, ce, features, seeded
from torch import nn

VOCAB, PAD = 12, 0


def _classifier_setup(model: nn.Module) -> dict[str, Any]:
    return dict(model=model, optimizer=adamw(model), batches=features(2), loss_fn=ce)


# -- unregistered_parameter -----------------------------------------------------------------
class ListNet(nn.Module):
    """Two hidden layers and a head; the hidden ones in a plain list when not `fixed`."""

    def __init__(self, fixed: bool) -> None:
        super().__init__()
        hidden = [nn.Linear(8, 8) for _ in range(2)]
        # BUG (fixed=False): a plain list registers nothing
        self.layers = nn.ModuleList(hidden) if fixed else hidden
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def setup_layers_in_list(fixed: bool) -> dict[str, Any]:
    """https://github.com/pytorch/pytorch/issues/59925: `self.layers = [nn.Linear(4, 4) for i
    in range(2)]`; model.parameters() lacks them and nothing warns."""
    return _classifier_setup(seeded(lambda: ListNet(fixed)))


# -- inplace_overwrite ----------------------------------------------------------------------
class ResidualNet(nn.Module):
    """A stem, one residual block and a head, its ReLU in place (torchvision's habit)."""

    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.fixed = fixed
        self.stem, self.fc, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        identity = x
        # BUG (fixed=False): the in-place ReLU turns `identity` (it is x) into ReLU(x)
        out = self.relu(self.fc(x)) if self.fixed else self.fc(self.relu(x))
        return self.head(out + identity)


def setup_inplace_identity(fixed: bool) -> dict[str, Any]:
    """https://github.com/iduta/iresnet/pull/2: `out = self.relu(x)` with nn.ReLU(inplace=True)
    makes the identity branch ReLU(x). Fixed: the in-place ReLU acts on a fresh tensor."""
    return _classifier_setup(seeded(lambda: ResidualNet(fixed)))


# -- padding_leak ---------------------------------------------------------------------------
class MeanPooled(nn.Module):
    """An embedding, one encoder layer that masks the padding, a mean over time, a head."""

    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.fixed = fixed
        self.emb = nn.Embedding(VOCAB, 16, padding_idx=PAD)
        self.enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.enc(self.emb(input_ids), src_key_padding_mask=attention_mask == 0)
        if self.fixed:
            m = attention_mask.unsqueeze(-1).to(h.dtype)
            return self.head((h * m).sum(1) / m.sum(1))
        return self.head(h.mean(dim=1))  # BUG (fixed=False): the padding is averaged in


def padded_batches(n: int = 2, *, left: bool = False) -> list[dict[str, torch.Tensor]]:
    """Rows of 3..8 tokens padded with PAD to 8, their attention mask and a class each."""
    g = torch.Generator().manual_seed(4)
    out = []
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (4, 8), generator=g)
        lengths = torch.tensor([8, 5, 3, 6])
        real = torch.arange(8)[None, :] < lengths[:, None]
        real = real.flip(1) if left else real
        out.append({"input_ids": ids.masked_fill(~real, PAD), "attention_mask": real.long(),
                    "labels": torch.randint(0, 3, (4,), generator=g)})  # fmt: skip
    return out


def pooled_ce(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["input_ids"], attention_mask=batch["attention_mask"]),
                           batch["labels"])  # fmt: skip


def setup_mean_pool_padding(fixed: bool) -> dict[str, Any]:
    """https://github.com/jsboige/CoursIA/issues/15045: `last_hidden_state.mean(dim=1)` with no
    mask, after an encoder that masks the padding: the sentence embedding depends on how
    much padding its batch gave it. Fixed: the mean over real positions."""
    model = seeded(lambda: MeanPooled(fixed))
    return dict(model=model, optimizer=adamw(model), batches=padded_batches(), loss_fn=pooled_ce)


BUILT: list[tuple[str, Any, str]] = [
    ("unregistered_parameter", setup_layers_in_list, "error"),
    ("inplace_overwrite", setup_inplace_identity, "error"),
    ("padding_leak", setup_mean_pool_padding, "error"),
]

# (kind, bug, clean twin, severity), as tests/doctor/test_zoo.py's CASES
CASES: list[tuple[str, Any, Any, str]] = [
    (kind, partial(make, False), partial(make, True), sev) for kind, make, sev in BUILT
]


# -- held out until the checks were done (model_reports.md), rebuilt once ---------------------
class Relations(nn.Module):
    """pytorch#632: per-relation weights kept in dicts (ParameterDict/ModuleDict when fixed)."""

    def __init__(self, fixed: bool) -> None:
        super().__init__()
        waggrs = {str(r): {"w": nn.Parameter(1.0 + torch.randn(1, 8)),
                           "b": nn.Parameter(torch.zeros(1, 4))} for r in range(3)}  # fmt: skip
        relations = {str(r): nn.Linear(8, 4) for r in range(3)}
        if fixed:
            self.waggrs = nn.ModuleDict({r: nn.ParameterDict(d) for r, d in waggrs.items()})
            self.list_relations: Any = nn.ModuleDict(relations)
        else:  # BUG: plain dicts register nothing
            self.waggrs, self.list_relations = waggrs, relations  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = [self.list_relations[r](x * self.waggrs[r]["w"]) + self.waggrs[r]["b"]
               for r in self.list_relations]  # fmt: skip
        return torch.stack(out).sum(0)


def setup_relations_in_dicts(fixed: bool) -> dict[str, Any]:
    """https://github.com/pytorch/pytorch/issues/632: `self.waggrs[rel] = {'w': nn.Parameter
    (...), 'b': nn.Parameter(...)}` and `self.list_relations[rel] = nn.Linear(...)`, in dicts.
    The model's own parameters are empty when broken, so a stand-in keeps the optimizer legal."""
    model = seeded(lambda: Relations(fixed))
    params = list(model.parameters()) or [nn.Parameter(torch.zeros(1))]
    return dict(model=model, optimizer=torch.optim.Adam(params, lr=1e-3),
                batches=features(2), loss_fn=ce)  # fmt: skip


class SASRec(nn.Module):
    """pmixer/SASRec.pytorch's model, one block: left-padded item sequences, causal attention;
    its key padding mask commented out (fixed: real positions never attend to padding)."""

    def __init__(self, fixed: bool, items: int = 20, maxlen: int = 8, d: int = 16) -> None:
        super().__init__()
        self.fixed, self.d = fixed, d
        self.item_emb = nn.Embedding(items + 1, d, padding_idx=0)
        self.pos_emb = nn.Embedding(maxlen, d)
        self.attn_norm, self.ffn_norm, self.last_norm = (nn.LayerNorm(d) for _ in range(3))
        self.attn = nn.MultiheadAttention(d, 1, dropout=0.2, batch_first=True)
        self.ffn = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Dropout(0.2), nn.Linear(d, d))

    def log2feats(self, log_seqs: torch.Tensor) -> torch.Tensor:
        T = log_seqs.shape[1]
        seqs = self.item_emb(log_seqs) * self.d**0.5 + self.pos_emb(torch.arange(T))[None]
        timeline_mask = log_seqs == 0  # (B, T) True at padding
        seqs = seqs * ~timeline_mask.unsqueeze(-1)
        causal = ~torch.tril(torch.ones(T, T, dtype=torch.bool))
        mask: torch.Tensor = causal
        if self.fixed:  # a real query never sees padding; a pad query sees the pads before it
            key_pad = timeline_mask[:, None, :] & ~timeline_mask[:, :, None]
            mask = causal[None] | key_pad  # (B, T, T), one head
        q = self.attn_norm(seqs)
        # BUG (fixed=False): key_padding_mask=timeline_mask is commented out upstream
        seqs = q + self.attn(q, seqs, seqs, attn_mask=mask, need_weights=False)[0]
        seqs = seqs + self.ffn(self.ffn_norm(seqs))
        return self.last_norm(seqs * ~timeline_mask.unsqueeze(-1))

    def forward(self, user_ids: Any, log_seqs: Any, pos_seqs: Any, neg_seqs: Any) -> Any:
        feats = self.log2feats(log_seqs)
        pos = (feats * self.item_emb(pos_seqs)).sum(-1)
        return pos, (feats * self.item_emb(neg_seqs)).sum(-1)


def _sasrec_batches(n: int = 2) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(6)
    out = []
    for _ in range(n):
        seq = torch.randint(1, 21, (4, 9), generator=g)
        lengths = torch.tensor([9, 6, 4, 7])
        seq = seq.masked_fill(torch.arange(9).flip(0)[None] >= lengths[:, None], 0)  # left pad
        neg = torch.randint(1, 21, (4, 8), generator=g).masked_fill(seq[:, 1:] == 0, 0)
        out.append((torch.arange(4), seq[:, :-1], seq[:, 1:], neg))
    return out


def sasrec_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """BCE of the next item against one negative, over the real positions (no host sync)."""
    u, seq, pos, neg = batch
    pos_logits, neg_logits = model(u, seq, pos, neg)
    real = (pos != 0).float()
    bce = F.binary_cross_entropy_with_logits
    each = bce(pos_logits, torch.ones_like(pos_logits), reduction="none") + bce(
        neg_logits, torch.zeros_like(neg_logits), reduction="none"
    )
    return (each * real).sum() / real.sum()


def setup_sasrec_no_key_mask(fixed: bool) -> dict[str, Any]:
    """https://github.com/pmixer/SASRec.pytorch/issues/36: `key_padding_mask=timeline_mask`
    commented out; real items attend to the left padding's (zeroed) states."""
    model = seeded(lambda: SASRec(fixed))
    return dict(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
                batches=_sasrec_batches(), loss_fn=sasrec_loss)  # fmt: skip


HELD_OUT: list[tuple[str, Any, str | None]] = [
    ("unregistered_parameter", setup_relations_in_dicts, "error"),
    ("padding_leak", setup_sasrec_no_key_mask, "warning"),  # missed when held out: see .md
]
