"""What a user trips on after the first run: sample output that reads as text, an export that
never replaces a file silently, a hint that names the interpreter that ran, a short fine-tune
that says its learning rate never peaks, "1 thread"."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from isotrain.train.cli.commands import tidy
from isotrain.train.cli.main import main
from isotrain.train.report import progress

SMOKE = ["--preset", "smoke", "--data.max-bytes", "60000", "--sample-tokens", "0"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("second") / "run"
    assert main(["train", *SMOKE, "--steps", "2", "--out-dir", str(out)]) == 0
    return out


def test_a_sample_is_text_without_trailing_spaces_or_blank_runs() -> None:
    text = "def f():   \n    return 1    \n\n\n\n\nlater"  # four blank lines: two stay
    assert tidy(text) == "def f():\n    return 1\n\n\nlater"  # and what follows them
    assert tidy("a\n\nb  \n" + " " * 160) == "a\n\nb"  # one blank line stays
    assert tidy("\n\n\n\nx = 1\n\n\n") == "\n\nx = 1"
    assert tidy("x = 1") == "x = 1"


def test_sample_says_when_it_tidied_and_raw_prints_as_generated(run, capsys) -> None:
    args = ["sample", str(run), "--prompt", "x   \n\n\n\n", "--tokens", "4"]
    assert main([*args, "--raw"]) == 0
    raw, err = capsys.readouterr()
    assert raw.startswith("x   \n\n\n\n") and len(raw) > len("x   \n\n\n\n\n") and err == ""
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert out == tidy(raw[:-1]) + "\n" and out.startswith("x\n\n") and "--raw shows them" in err


@pytest.mark.parametrize("fmt", ["isotrain", "hf"])
def test_export_refuses_to_replace_an_output_without_force(run, tmp_path, capsys, fmt) -> None:
    out = tmp_path / ("m.safetensors" if fmt == "isotrain" else "hf")
    args = ["export", str(run), "--format", fmt, "--out", str(out)]
    assert main(args) == 0
    first = sorted(p.name for p in out.parent.rglob("*"))
    capsys.readouterr()
    assert main(args) == 2
    assert capsys.readouterr().err == (
        f"isotrain export: error: --out {out} exists; pass --force to replace it, or another "
        "--out\n"
    )
    assert sorted(p.name for p in out.parent.rglob("*")) == first
    assert main([*args, "--force"]) == 0
    assert main(["export", str(run), "--format", fmt]) == 0  # the run's own output: rewritten
    assert main(["export", str(run), "--format", fmt]) == 0


def test_the_next_hint_names_the_interpreter_that_ran(monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["/somewhere/isotrain/__main__.py"])  # torchrun -m
    monkeypatch.setenv("PATH", str(tmp_path))  # no python on the PATH
    assert progress.invoked_as() == f"{sys.executable} -m isotrain"
    monkeypatch.chdir(Path(sys.executable).parents[2])
    venv = Path(sys.executable).relative_to(Path(sys.executable).parents[2])
    assert progress.invoked_as() == f"{venv} -m isotrain"  # .venv/bin/python -m isotrain


def test_a_run_shorter_than_its_warmup_says_so_and_one_thread_is_singular(
    tmp_path, capsys, caplog
) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        args = [*SMOKE, "--steps", "3", "--optim.warmup-steps", "30", "--out-dir", str(tmp_path)]
        assert main(["train", *args]) == 0
    finally:
        torch.set_num_threads(before)
    assert ", 1 thread, subnormals" in capsys.readouterr().out
    assert (
        "--steps 3 is less than --optim.warmup-steps 30: the learning rate only reaches 2.0e-04 "
        "of --optim.lr 0.002; try --optim.warmup-steps 1"
    ) in caplog.text
