"""`isotrain prepare`: text in, train.bin / val.bin / meta.json out, lossless and streamed."""

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from isotrain.train.cli.main import main
from isotrain.train.data import prepare as P
from isotrain.train.data.sources import DataError, TokenData, open_data
from isotrain.train.data.tokenizer import ByteTokenizer, HFTokenizer

LINES = [f"def f{i}(x):  # é✓ {i}\n    return x * {i}\n\n" for i in range(200)]


def _decode(out: Path, split: str, tok) -> str:
    meta = json.loads((out / "meta.json").read_text())
    ids = np.fromfile(out / f"{split}.bin", dtype=meta["dtype"])
    assert len(ids) == meta["splits"][split]["tokens"]
    return tok.decode(ids.tolist())


def test_folder_to_bpe_tokens_losslessly(tmp_path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    texts = ["".join(LINES[i::5]) for i in range(5)]
    for i, t in enumerate(texts):
        (src / f"{i}.py").write_text(t)
    out = tmp_path / "out"
    meta = P.prepare(
        [str(src)], out, tokenizer="bpe", vocab_size=300, val_fraction=0.2, progress=False
    )
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 300
    tok = HFTokenizer.from_file(out / "tokenizer.json")
    assert meta["tokenizer"] == "tokenizer.json" and meta["tokenizer_sha256"] == tok.sha256
    val_text = texts[4]  # one file in five, by count
    assert _decode(out, "val", tok) == val_text
    assert _decode(out, "train", tok) == "".join(texts[:4])
    assert meta["splits"]["val"]["bytes"] == len(val_text.encode())
    data = open_data(str(out), max_bytes=1, val_fraction=0.1)
    assert isinstance(data, TokenData) and isinstance(data.train, np.memmap)
    assert data.meta is not None and data.val_bytes == len(val_text.encode())


def test_one_file_splits_its_tail_at_a_line_and_streams_in_pieces(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(P, "BLOCK", 37)  # many pieces, multi-byte characters cut at edges
    text = "".join(LINES[:60])
    (tmp_path / "a.txt").write_text(text)
    out = tmp_path / "out"
    P.prepare([str(tmp_path / "a.txt")], out, val_fraction=0.25, progress=False)
    train, val = _decode(out, "train", ByteTokenizer()), _decode(out, "val", ByteTokenizer())
    assert train + val == text
    assert train.endswith("\n") and 0.2 < len(val) / len(text) < 0.3


def test_jsonl_records_and_their_errors(tmp_path) -> None:
    rows = [{"text": f"record {i} é"} for i in range(20)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    P.prepare([str(tmp_path / "d.jsonl")], out, val_fraction=0.1, progress=False)
    both = _decode(out, "train", ByteTokenizer()) + _decode(out, "val", ByteTokenizer())
    assert both == "".join(r["text"] + "\n\n" for r in rows)
    with pytest.raises(DataError, match="no text field 'body'; pass --text-field NAME"):
        P.prepare([str(tmp_path / "d.jsonl")], tmp_path / "o2", text_field="body", progress=False)


def test_json_and_parquet_go_through_hf_datasets(tmp_path, monkeypatch) -> None:
    calls = []

    def load_dataset(kind, *, data_files, split):
        calls.append((kind, data_files, split))
        return [{"text": f"row {i}"} for i in range(10)]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    out = tmp_path / "out"
    meta = P.prepare([str(tmp_path / "d.parquet")], out, val_fraction=0.2, progress=False)
    assert calls[0] == ("parquet", [str(tmp_path / "d.parquet")], "train")
    assert _decode(out, "val", ByteTokenizer()) == "row 8\n\nrow 9\n\n"
    assert meta["splits"]["train"]["tokens"] == len("".join(f"row {i}\n\n" for i in range(8)))


def test_refusals(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("".join(LINES[:20]))
    out = tmp_path / "out"
    P.prepare([str(tmp_path / "a.txt")], out, progress=False)
    with pytest.raises(DataError, match="already holds train.bin; pass --overwrite"):
        P.prepare([str(tmp_path / "a.txt")], out, progress=False)
    (tmp_path / "one.txt").write_text("x")
    with pytest.raises(DataError, match="the val split came out empty"):
        P.prepare([str(tmp_path / "one.txt")], tmp_path / "o2", progress=False)
    with pytest.raises(DataError, match="a BPE needs more than 256 tokens; try 1024"):
        P.prepare(
            [str(tmp_path / "a.txt")],
            tmp_path / "o3",
            tokenizer="bpe",
            vocab_size=256,
            progress=False,
        )


def test_cli_prepare_with_a_separate_validation_file(tmp_path, capsys) -> None:
    (tmp_path / "a.txt").write_text("".join(LINES[:100]))
    (tmp_path / "v.txt").write_text("".join(LINES[100:120]))
    out = tmp_path / "out"
    args = ["prepare", "--input", str(tmp_path / "a.txt"), "--val-input", str(tmp_path / "v.txt")]
    assert main([*args, "--out", str(out), "--tokenizer", "bpe", "--vocab-size", "300"]) == 0
    assert f"train with --data.path {out}" in capsys.readouterr().out
    tok = HFTokenizer.from_file(out / "tokenizer.json")
    assert _decode(out, "val", tok) == "".join(LINES[100:120])
    again = tmp_path / "again"
    prep = [*args, "--out", str(again)]
    assert main([*prep, "--tokenizer", str(out / "tokenizer.json"), "--no-progress"]) == 0
    assert (again / "train.bin").read_bytes() == (out / "train.bin").read_bytes()
    assert json.loads((again / "meta.json").read_text())["tokenizer_sha256"] == tok.sha256
    assert main(["prepare", "--input", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 2
    assert "error: --input" in capsys.readouterr().err
