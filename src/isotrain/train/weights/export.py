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
import os
from pathlib import Path

from isotrain.train.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    byte_level_json,
    run_tokenizer,
)
from isotrain.train.model.gpt import GPT
from isotrain.train.model.hf import gpt2_config, to_gpt2_state
from isotrain.train.rundir.snapshot import load_snapshot
from isotrain.train.weights.load import model_from_snapshot, safetensors_module

__all__ = ["export_hf", "export_run", "export_safetensors", "tokenizer_metadata"]

log = logging.getLogger(__name__)


def _umask() -> int:
    """The process umask, read without changing it where Linux allows (else set and restore)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    old = os.umask(0o022)
    try:
        return old
    finally:
        os.umask(old)


def _ordinary(path: Path) -> Path:
    """Give `path` the mode a plain `open(path, "w")` would (safetensors writes 0600)."""
    path.chmod(0o666 & ~_umask())
    return path


def tokenizer_metadata(tok: Tokenizer) -> str:
    """How the isotrain format records a tokenizer: "bytes", "ids", or its JSON."""
    return tok.json if isinstance(tok, HFTokenizer) else tok.kind


def export_safetensors(model: GPT, out: str | Path, tokenizer: Tokenizer | None = None) -> Path:
    """Write `model`'s weights, its config and its tokenizer (as metadata) to `out`."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "isotrain_model_config": json.dumps(model.cfg.__dict__),
        "isotrain_tokenizer": tokenizer_metadata(tokenizer or ByteTokenizer()),
    }
    safetensors_module().save_model(model, str(out), metadata=meta)  # drops the tied duplicate
    return _ordinary(out)


def _tokenizer_files(tok: Tokenizer, folder: Path, block_size: int, written: list[Path]) -> None:
    """tokenizer.json + tokenizer_config.json, or nothing (with a warning) for ids."""
    if isinstance(tok, HFTokenizer):
        text = tok.json
    elif tok.kind == "bytes":
        text = byte_level_json()  # ids equal byte values: AutoTokenizer reads text as isotrain
    else:
        log.warning("%s: no tokenizer files: the run trained on ids of unknown text", folder)
        return
    written.append(folder / "tokenizer.json")
    written[-1].write_text(text, encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": block_size,
        "clean_up_tokenization_spaces": False,
    }
    written.append(folder / "tokenizer_config.json")
    written[-1].write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def export_hf(model: GPT, folder: str | Path, tokenizer: Tokenizer | None = None) -> Path:
    """Write a folder transformers loads as GPT2LMHeadModel (and AutoTokenizer); a failed
    write (a full disk) removes what this call wrote, the folder too if it made it."""
    root = Path(folder)
    created = not root.exists()
    written: list[Path] = []
    try:
        root.mkdir(parents=True, exist_ok=True)
        written.append(root / "model.safetensors")
        state = to_gpt2_state(model)
        safetensors_module().save_file(state, str(written[-1]), metadata={"format": "pt"})
        written.append(root / "config.json")
        text = json.dumps(gpt2_config(model.cfg), indent=2) + "\n"
        written[-1].write_text(text, encoding="utf-8")
        _tokenizer_files(tokenizer or ByteTokenizer(), root, model.cfg.block_size, written)
        for path in written:
            _ordinary(path)
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
