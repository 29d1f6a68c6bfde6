"""batch_size_mismatch: the tensors of one batch disagree on how many samples it holds.

Read from the batches alone. Text fields of a Hugging Face batch (input_ids, attention_mask,
labels, ...) share their first dimension by definition; an image or audio field with another
count is likely a processor that merged the samples (1 row of text against 50 images), unless
the model declares an image token and the rows hold one per image.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
from torch.utils.data import DataLoader, default_collate

from isotrain.doctor.ground.context import Context
from isotrain.doctor.ground.finding import Finding, Severity
from isotrain.doctor.ground.kinds import Check, Kind

__all__ = ["BATCH_SIZE", "check_batch_size"]

TEXT = ("input_ids", "attention_mask", "token_type_ids", "labels", "position_ids",
        "decoder_input_ids", "decoder_attention_mask")  # fmt: skip
MEDIA = ("pixel_values", "pixel_mask", "input_features", "input_values")
_FIX = (
    "give every per-sample tensor the same first dimension: one row of input_ids per image "
    "(a processor given a list of texts, not one joined string), and check the collate_fn"
)


def _rows(batch: dict[str, Any], names: tuple[str, ...]) -> dict[str, int]:
    return {
        k: int(v.shape[0]) for k in names
        if isinstance(v := batch.get(k), torch.Tensor) and v.dim() >= 1
    }  # fmt: skip


def _fits_images(ctx: Context, batch: dict[str, Any], images: int) -> bool:
    """Whether the input_ids hold image tokens (of the token the model's config names) in a
    count that fits `images` images: one per image, one run per image, or a fixed number."""
    config = getattr(ctx.model, "config", None)
    token = getattr(config, "image_token_id", None) or getattr(config, "image_token_index", None)
    ids = batch.get("input_ids")
    if not isinstance(token, int) or not isinstance(ids, torch.Tensor) or not images:
        return False
    hit = ids == token
    tokens = int(hit.sum())
    runs = int((hit[..., 1:] & ~hit[..., :-1]).sum() + hit[..., 0].sum())
    return tokens > 0 and (runs == images or tokens % images == 0)


def _where(ctx: Context, i: int) -> str:
    """The DataLoader's own collate_fn (`file:line` of its def), or which batch it was."""
    collate = (
        getattr(ctx.source, "collate_fn", None) if isinstance(ctx.source, DataLoader) else None
    )
    if collate is None or collate is default_collate:
        return f"batch {i}"
    try:
        path, line = inspect.getsourcefile(collate), inspect.getsourcelines(collate)[1]
    except (OSError, TypeError):
        return f"batch {i}"
    rel = os.path.relpath(path or "?")
    return f"{path if rel.startswith('..') else rel}:{line} (collate_fn)"


def check_batch_size(ctx: Context) -> list[Finding]:
    """The first batch whose per-sample tensors disagree on their first dimension."""
    for i, batch in enumerate(ctx.batches):
        if not isinstance(batch, dict):
            continue
        text, media = _rows(batch, TEXT), _rows(batch, MEDIA)
        rows = {**text, **media}
        if len(set(rows.values())) < 2:
            continue
        shown = ", ".join(f"{k} {n}" for k, n in rows.items())
        sev: Severity = "error" if len(set(text.values())) > 1 else "warning"
        evidence = f"batch {i}: first dimensions {shown}"
        if sev == "warning" and _fits_images(ctx, batch, max(media.values())):
            sev, evidence = (
                "info",
                evidence
                + (
                    "; the rows hold image tokens for every image: expected when a sample "
                    "carries several images, a merged batch when each carries one"
                ),
            )
        return [Finding("batch_size_mismatch", sev, _where(ctx, i), evidence, _FIX)]
    return []


BATCH_SIZE = Check(
    "batch_size",
    (
        Kind(
            "batch_size_mismatch",
            "the tensors of one batch disagree on how many samples it holds",
        ),
    ),
    check_batch_size,
)
