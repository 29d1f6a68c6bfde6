"""Tampered files that are not snapshots: a tokenizer planted into a run, a prepared folder's
meta.json that lies about its data, a --config TOML built to break the parser. Each is
refused in one line (exit 2) before anything trains or is shipped."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from isotrain.train.cli.main import main
from isotrain.train.data.tokenizer import HFTokenizer, text_chunks

SMOKE = ["--preset", "smoke", "--data.max-bytes", "60000", "--sample-tokens", "0"]
TEXT = "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(3000))


def _one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"isotrain {command}: error: "), err
    return err


@pytest.fixture(scope="module")
def bytes_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("tampered") / "run"
    assert main(["train", *SMOKE, "--steps", "2", "--out-dir", str(run)]) == 0
    return run


@pytest.mark.parametrize("command", ["sample", "export"])
def test_a_tokenizer_planted_into_a_bytes_run_is_refused(
    bytes_run, tmp_path, capsys, command
) -> None:
    run = tmp_path / "run"
    shutil.copytree(bytes_run, run)
    HFTokenizer.train_bpe(text_chunks(TEXT), 300).save(run / "tokenizer.json")
    extra = ["--tokens", "4"] if command == "sample" else ["--format", "hf"]
    capsys.readouterr()
    assert main([command, str(run), *extra]) == 2
    err = _one_line_error(capsys, command)
    assert "tokenizer.json: the run trained on bytes or ids, without a tokenizer file" in err
    assert not (run / "hf").exists()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("prepared")
    (root / "corpus.txt").write_text(TEXT)
    out = root / "data"
    argv = ["prepare", "--input", str(root / "corpus.txt"), "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    return out


LIES = {  # what the meta.json claims -> what the refusal says
    "ids beyond its vocabulary": (
        lambda m: m.update(vocab_size=100),
        "its meta.json records 100 tokens",
    ),
    "a dtype whose size divides the file": (
        lambda m: m.update(dtype="uint8"),
        "but meta.json records",
    ),
    "vocab_size -1": (lambda m: m.update(vocab_size=-1), "vocab_size is -1"),
    "splits as a list": (lambda m: m.update(splits=[1, 2]), "unreadable meta file"),
    "negative val bytes": (
        lambda m: m["splits"]["val"].update(bytes=-5),
        "val bytes is -5",
    ),
    "val bytes no tokens could stand for": (
        lambda m: m["splits"]["val"].update(bytes=10**12),
        "val tokens stand for 1000000000000 bytes",
    ),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_meta_json_that_lies_is_refused(prepared, tmp_path, capsys, lie) -> None:
    data = tmp_path / "data"
    shutil.copytree(prepared, data)
    meta = json.loads((data / "meta.json").read_text())
    change, message = LIES[lie]
    change(meta)
    (data / "meta.json").write_text(json.dumps(meta))
    capsys.readouterr()
    argv = ["train", *SMOKE, "--steps", "1", "--data.path", str(data)]
    assert main([*argv, "--out-dir", str(tmp_path / "run")]) == 2
    assert message in _one_line_error(capsys, "train")
    assert not (tmp_path / "run" / "snapshots").exists()


def test_an_honest_meta_json_still_trains(prepared, tmp_path) -> None:
    argv = ["train", *SMOKE, "--steps", "1", "--data.path", str(prepared)]
    assert main([*argv, "--out-dir", str(tmp_path / "run")]) == 0


TOMLS = {
    "arrays nested 100,000 deep": ("steps = " + "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    "tables nested 5,000 deep": ("x = " + "{a = " * 5000 + "1" + "}" * 5000, "nested too deeply"),
    "a 5,000-digit integer": ("steps = " + "9" * 5000, "a number too long"),
    "a 4,000-digit integer": ("[model]\nd_model = " + "9" * 4000, "it must fit in 64 bits"),
    "a list 300 deep for a number": (
        "[model]\nd_model = " + "[" * 300 + "]" * 300,
        "d_model = [[[[",
    ),
}


@pytest.mark.parametrize("case", sorted(TOMLS))
def test_a_hostile_config_file_is_one_line(tmp_path, capsys, case) -> None:
    text, message = TOMLS[case]
    (tmp_path / "c.toml").write_text(text + "\n")
    capsys.readouterr()
    assert main(["train", "--config", str(tmp_path / "c.toml"), "--steps", "1"]) == 2
    err = _one_line_error(capsys, "train")
    assert message in err and len(err) < 300
