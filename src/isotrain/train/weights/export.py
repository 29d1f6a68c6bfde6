"""Weights alone, no code, no optimizer: isotrain's own `.safetensors`, or a Hugging Face folder.

`isotrain` format: one file, the model config and the tokenizer in its metadata; `sample` and
`--init-from` read it. `hf` format: a folder `transformers.GPT2LMHeadModel.from_pretrained`
and `AutoTokenizer.from_pretrained` load (config.json, model.safetensors with GPT-2 names,
tokenizer.json). Every file gets the permissions of an ordinary file (0666 less the umask).
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

from isotrain.train.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    byte_level_json,
    run_tokenizer,
)
from isotrain.train.files import make_dir, new_path, remove_stale, replace_file
from isotrain.train.model.gpt import GPT
from isotrain.train.model.hf import gpt2_config, to_gpt2_state
from isotrain.train.rundir.snapshot import load_snapshot
from isotrain.train.weights.load import model_from_snapshot, safetensors_module

__all__ = ["export_hf", "export_run", "export_safetensors", "tokenizer_metadata"]

log = logging.getLogger(__name__)


def tokenizer_metadata(tok: Tokenizer) -> str:
    """How the isotrain format records a tokenizer: "bytes", "ids", or its JSON."""
    return tok.json if isinstance(tok, HFTokenizer) else tok.kind


def export_safetensors(model: GPT, out: str | Path, tokenizer: Tokenizer | None = None) -> Path:
    """Write `model`'s weights, its config and its tokenizer (as metadata) to `out`."""
    out = Path(out)
    make_dir(out.parent, follow=True)
    remove_stale(out.parent)  # what a killed export left
    meta = {
        "isotrain_model_config": json.dumps(model.cfg.__dict__),
        "isotrain_tokenizer": tokenizer_metadata(tokenizer or ByteTokenizer()),
    }
    with new_path(out) as tmp:  # safetensors writes by name: into a fresh file of ours
        safetensors_module().save_model(model, str(tmp), metadata=meta)  # drops the tied copy
    return out


def _tokenizer_files(tok: Tokenizer, folder: Path, block_size: int) -> list[Path]:
    """tokenizer.json + tokenizer_config.json, or nothing (with a warning) for ids."""
    if isinstance(tok, HFTokenizer):
        text = tok.json
    elif tok.kind == "bytes":
        text = byte_level_json()  # ids equal byte values: AutoTokenizer reads text as isotrain
    else:
        log.warning("%s: no tokenizer files: the run trained on ids of unknown text", folder)
        return []
    files = [folder / "tokenizer.json", folder / "tokenizer_config.json"]
    replace_file(files[0], text)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": block_size,
        "clean_up_tokenization_spaces": False,
    }
    replace_file(files[1], json.dumps(config, indent=2) + "\n")
    return files


def export_hf(model: GPT, folder: str | Path, tokenizer: Tokenizer | None = None) -> Path:
    """Write a folder transformers loads as GPT2LMHeadModel (and AutoTokenizer); a failed
    write (a full disk) removes what this call wrote, the folder too if it made it."""
    created = not Path(folder).exists()
    root = make_dir(folder)  # a link planted there (to another model's folder) is refused
    remove_stale(root)
    written: list[Path] = []
    try:
        with new_path(root / "model.safetensors") as tmp:
            safetensors_module().save_file(
                to_gpt2_state(model), str(tmp), metadata={"format": "pt"}
            )
        written.append(root / "model.safetensors")
        text = json.dumps(gpt2_config(model.cfg), indent=2) + "\n"
        written.append(replace_file(root / "config.json", text))
        written += _tokenizer_files(tokenizer or ByteTokenizer(), root, model.cfg.block_size)
    except BaseException:
        for path in written:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        if created:
            with contextlib.suppress(OSError):
                root.rmdir()
        raise
    return root


def export_run(
    run_dir: str, out: str | Path, *, which: str = "latest", fmt: str = "isotrain"
) -> tuple[Path, Path]:
    """Export the weights of a run's snapshot; returns what was written and the snapshot used."""
    payload, snap = load_snapshot(run_dir, which=which)
    model = model_from_snapshot(payload, snap)
    tok = run_tokenizer(run_dir, payload["config"])
    if fmt == "hf":
        return export_hf(model, out, tok), snap
    return export_safetensors(model, out, tok), snap
