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
