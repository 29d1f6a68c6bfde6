"""The README's commands work as written on a fresh clone, in the order shown.

Every command of every bash block must be one a fresh clone can run: a `make` target, or a
program in `.venv` (`isotrain`, `pip`, `python`, `torchrun`). `make` targets are checked with
`make -n`; the commands of "The trainer" run in-process, in order, in a temporary directory
where a smoke run stands in for `make train`'s `runs/default`; the other sections' commands
(long trainings, torchrun) are parsed, so every flag they use exists. Each command's optional
packages must be installed by `make train` or by a `pip install` the README shows before it.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from isotrain.train.cli import commands
from isotrain.train.cli.args import parse
from isotrain.train.cli.doctor import DoctorArgs
from isotrain.train.cli.main import main, parse_train_args

ROOT = Path(__file__).resolve().parents[2]
RUN_SECTIONS = ("The trainer",)
ARGS = {
    "prepare": commands.PrepareArgs,
    "sample": commands.SampleArgs,
    "plot": commands.PlotArgs,
    "report": commands.ReportArgs,
    "export": commands.ExportArgs,
    "doctor": DoctorArgs,
}


def readme_commands() -> list[tuple[str, dict[str, str], list[str]]]:
    """(section, environment, argv) of each command in the README's bash blocks, in order."""
    out, section, block = [], "", None
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        elif line.strip() == "```bash":
            block = []
        elif line.strip() == "```" and block is not None:
            for command in re.sub(r"\\\n\s*", " ", "\n".join(block)).splitlines():
                words = shlex.split(command, comments=True)
                env = {}
                while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                    key, _, value = words.pop(0).partition("=")
                    env[key] = value
                if words:
                    out.append((section, env, words))
            block = None
        elif block is not None:
            block.append(line)
    return out


COMMANDS = readme_commands()


def _installed_by_make_train() -> set[str]:
    """The extras `make train` installs (`pip install -e ".[plots,export]"` in the Makefile)."""
    text = (ROOT / "Makefile").read_text()
    rule = text.split("$(RUN_STAMP):", 1)[1].split("\n\n", 1)[0]
    found = re.search(r"-e \"?\.\[([\w,]+)\]", rule)
    return set(found.group(1).split(",")) if found else set()


def _needs(argv: list[str]) -> set[str]:
    """The isotrain extras an isotrain command needs."""
    command, text = argv[0], " ".join(argv)
    needs = {"plot": {"plots"}, "export": {"export"}}.get(command, set())
    if command == "sample" and ".safetensors" in text:
        needs.add("export")
    needs |= {n for n in ("tensorboard", "wandb") if "--report.loggers" in text and n in text}
    if re.search(r"--tokenizer (bpe|\S+\.json)", text):
        needs.add("data")
    return needs


def _extras(pip_argv: list[str]) -> set[str]:
    found = re.search(r"\.\[([\w,]+)\]", " ".join(pip_argv))
    return set(found.group(1).split(",")) if found else set()


def test_every_command_is_a_make_target_or_a_program_in_the_venv() -> None:
    assert len(COMMANDS) >= 20
    programs = {".venv/bin/isotrain", ".venv/bin/pip", ".venv/bin/python", ".venv/bin/torchrun"}
    for section, _, argv in COMMANDS:
        assert argv[0] == "make" or argv[0] in programs, (section, " ".join(argv))
    quick = [argv for section, _, argv in COMMANDS if section == "Quick start"]
    assert [a[:2] for a in quick][:5] == [
        ["make", "train"], ["make", "sample"], ["make", "plot"], ["make", "report"],
        ["make", "export"],
    ]  # fmt: skip


def test_what_each_command_needs_is_installed_before_it() -> None:
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = _installed_by_make_train()
    assert {"plots", "export"} <= installed
    for section, _, argv in COMMANDS:
        if argv[0] == ".venv/bin/pip":
            assert argv[1] == "install", argv
            assert _extras(argv) <= set(declared["optional-dependencies"]), argv
            installed |= _extras(argv)
        elif argv[0] in (".venv/bin/isotrain", ".venv/bin/torchrun"):
            isotrain = argv[argv.index("isotrain") + 1 :] if "-m" in argv else argv[1:]
            if isotrain and not isotrain[0].startswith("-"):
                missing = _needs(isotrain) - installed
                assert not missing, f"{section}: {' '.join(argv)} needs isotrain{missing}"


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_targets_exist() -> None:
    targets = [argv for _, _, argv in COMMANDS if argv[0] == "make"]
    assert targets
    for argv in targets:
        proc = subprocess.run(
            ["make", "-n", "-C", str(ROOT), *argv[1:], "RUN=/tmp/isotrain-readme-run"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, (argv, proc.stderr)
        if argv[1] in ("sample", "plot", "report", "export"):
            assert f"isotrain {argv[1]} /tmp/isotrain-readme-run" in proc.stdout


def _run(argv: list[str]) -> int:
    """`main(argv)`; `--help` exits through SystemExit(0) in tyro's pages."""
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code or 0)


def test_the_trainer_commands_run_as_written(tmp_path, monkeypatch, capsys) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    monkeypatch.chdir(tmp_path)
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    # what `make train` leaves, in seconds
    assert main(["train", "--preset", "smoke", "--out-dir", "runs/default"]) == 0
    ran = 0
    for section, env, argv in COMMANDS:
        if section not in RUN_SECTIONS or argv[0] != ".venv/bin/isotrain":
            continue
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        capsys.readouterr()
        code = _run(argv[1:])
        assert code == 0, (" ".join(argv), capsys.readouterr().err)
        ran += 1
    assert ran >= 10
    for path in ("plots/loss.png", "model.safetensors", "my-gpt/config.json"):
        assert (tmp_path / path).is_file(), path
    for path in ("runs/logged/csv", "runs/logged/tensorboard", "runs/logged/wandb"):
        assert (tmp_path / path).is_dir(), path


@pytest.mark.parametrize(
    "argv",
    [a for s, _, a in COMMANDS if s not in RUN_SECTIONS and "isotrain" in " ".join(a)],
    ids=lambda a: " ".join(a)[:60],
)
def test_the_other_sections_commands_parse(argv) -> None:
    isotrain = argv[argv.index("isotrain") + 1 :] if "-m" in argv else argv[1:]
    command, rest = isotrain[0], isotrain[1:]
    if command == "train":
        parse_train_args(rest)
    else:
        parse(ARGS[command], rest, f"isotrain {command}")
