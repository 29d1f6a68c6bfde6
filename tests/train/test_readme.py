"""The commands of the README and of the guide work as written on a fresh clone, in order.

The pages are walked as a reader goes: README.md, then the guide's pages in the order of
mkdocs.yml's nav (tests/guides.py); a command shown again runs once, where it first appears.
Every command of every bash block must be one a fresh clone can run: a `make` target, or a
program in `.venv` (`isotrain`, `pip`, `python`, `torchrun`). `make` targets are checked with
`make -n`; then every command runs in-process, in order, in one temporary directory after
`make train`'s job, as a new user would type them (long ones with a few steps; torchrun's
are parsed). Each command's optional packages must be installed by `make train` or by a
`pip install` shown before it.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from tests import guides

from isotrain.train.cli.launch import nproc_per_node
from isotrain.train.cli.main import main, parse_train_args

ROOT = Path(__file__).resolve().parents[2]


def commands() -> list[tuple[str, dict[str, str], list[str], str]]:
    """(where, environment, argv, note) of each command in the bash blocks of every page, in
    order, each once; `where` is "page: section", `note` the comment of its line."""
    out, seen = [], set()
    for page in guides.PAGES:
        for block in guides.blocks(page):
            if block.lang != "bash":
                continue
            for command in re.sub(r"\\\n\s*", " ", block.code).splitlines():
                note = command.split(" # ", 1)[1] if " # " in command else ""
                words = shlex.split(command, comments=True)
                env = {}
                while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                    key, _, value = words.pop(0).partition("=")
                    env[key] = value
                shown = (tuple(sorted(env.items())), tuple(words))
                if words and shown not in seen:
                    seen.add(shown)
                    out.append((f"{guides.name(page)}: {block.section}", env, words, note))
    return out


COMMANDS = commands()


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
    for where, _, argv, _ in COMMANDS:
        assert argv[0] == "make" or argv[0] in programs, (where, " ".join(argv))
    assert COMMANDS[0][2] == ["make", "train"]  # the README's first command
    assert {"README.md", "docs/trainer.md", "docs/own-data.md", "docs/distributed.md"} <= {
        where.split(":", 1)[0] for where, *_ in COMMANDS
    }  # the walk reaches the guide
    quick = [argv for where, _, argv, _ in COMMANDS if where.startswith("README.md")]
    quick += [argv for where, _, argv, _ in COMMANDS if where.startswith("docs/quickstart.md")]
    assert [a[:2] for a in quick if a[0] == "make"][:6] == [
        ["make", "train"], ["make", "test"], ["make", "sample"], ["make", "plot"],
        ["make", "report"], ["make", "export"],
    ]  # fmt: skip


def test_what_each_command_needs_is_installed_before_it() -> None:
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = _installed_by_make_train()
    assert {"plots", "export"} <= installed
    for where, _, argv, _ in COMMANDS:
        if argv[0] == ".venv/bin/pip":
            assert argv[1] == "install", argv
            assert _extras(argv) <= set(declared["optional-dependencies"]), argv
            installed |= _extras(argv)
        elif argv[0] in (".venv/bin/isotrain", ".venv/bin/torchrun"):
            isotrain = argv[argv.index("isotrain") + 1 :] if "-m" in argv else argv[1:]
            if isotrain and not isotrain[0].startswith("-"):
                missing = _needs(isotrain) - installed
                assert not missing, f"{where}: {' '.join(argv)} needs isotrain{missing}"


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_targets_exist() -> None:
    targets = [argv for _, _, argv, _ in COMMANDS if argv[0] == "make"]
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
    args = ["make", "-n", "-C", str(ROOT), "train", "ARGS=--steps 2000 --out-dir runs/x"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert "isotrain train --steps 2000 --out-dir runs/x\n" in proc.stdout  # ARGS pass through


def _run(argv: list[str]) -> int:
    """`main(argv)`; `--help` exits through SystemExit(0) in tyro's pages."""
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code or 0)


# What the README's long commands (marked "(minutes)") run with here instead: a few steps.
FEW_STEPS = ["--steps", "2", "--data.batch-size", "2", "--eval-batches", "1"]
FEW_STEPS += ["--sample-tokens", "8", "--precision", "fp32", "--data.max-bytes", "200000"]
NOT_RUN = {".venv/bin/pip", ".venv/bin/torchrun"}  # installs (done), and many processes
# (as is `isotrain train --nproc-per-node`)
NOT_RUN_MAKE = {"test", "lint", "bench", "docs"}  # the suite itself, dev tools


def _make_argv(target: str) -> list[str]:
    """The isotrain command a make target runs (`make -n`), as argv for main()."""
    text = (ROOT / "Makefile").read_text()
    recipe = text.split(f"\n{target}:", 1)[1].split("\n\t", 1)[1].split("\n", 1)[0]
    words = recipe.replace("$(ISOTRAIN)", "isotrain").replace("$(RUN)", "runs/default").split()
    return [w for w in words if not w.startswith("$(")][1:]


def _user_files(root: Path) -> None:
    """What the README's commands take as the user's own: notes, code, a corpus, a local GPT-2
    folder, a nanoGPT data folder with its tokenizer; and the clone's doctor example."""
    from isotrain.train.data.tokenizer import HFTokenizer, text_chunks

    lines = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(600)]
    for folder, name, n in (
        ("notes", "n{}.txt", 3),
        ("src/pkg", "m{}.py", 3),
        ("corpus/a", "c{}.txt", 3),
    ):
        (root / folder).mkdir(parents=True)
        for i in range(n):
            (root / folder / name.format(i)).write_text("".join(lines[i::n]))
    (root / "tests").mkdir()
    (root / "tests/test_x.py").write_text("".join(lines[:200]))
    tok = HFTokenizer.train_bpe(text_chunks("".join(lines)), 300)
    (root / "gpt2").mkdir()
    tok.save(root / "gpt2/tokenizer.json")
    owt = root / "nanoGPT/data/openwebtext"
    owt.mkdir(parents=True)
    ids = np.array(tok.encode("".join(lines)), dtype=np.uint16)
    ids[: len(ids) * 9 // 10].tofile(owt / "train.bin")
    ids[len(ids) * 9 // 10 :].tofile(owt / "val.bin")
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=300, n_positions=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(root / "models/gpt2")
    tok.save(root / "models/gpt2/tokenizer.json")
    (root / "examples").mkdir()  # a clone's: the README runs the doctor on its example
    shutil.copy(ROOT / "examples/doctor_setup.py", root / "examples")


@pytest.mark.slow
def test_the_pages_walk_through_in_one_directory_after_make_train(
    tmp_path, monkeypatch, capsys
) -> None:
    """Every command in every bash block, in order, in one fresh directory where `make
    train`'s job has run: a new user's second hour. Commands marked "(minutes)" run with
    FEW_STEPS appended; installs and torchrun are left out (torchrun's are parsed, and must
    name their --out-dir, so they never meet runs/default)."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    monkeypatch.chdir(tmp_path)
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    _user_files(tmp_path)
    ran, left_out = [], []
    times: list[tuple[float, str]] = []
    for _where, env, command, note in COMMANDS:
        if command[0] in NOT_RUN or (command[0] == "make" and command[1] in NOT_RUN_MAKE):
            left_out.append(command)
            if command[0] == ".venv/bin/torchrun":
                isotrain = command[command.index("isotrain") + 1 :]
                if isotrain[0] == "doctor":  # no run directory: tests/doctor/test_ranks.py runs it
                    continue
                assert "--out-dir" in isotrain, command  # never the default run directory
                parse_train_args(isotrain[1:])
            continue
        if command[:2] == [".venv/bin/isotrain", "doctor"] and "--nproc-per-node" in command:
            left_out.append(command)  # many processes: tests/doctor/test_ranks_launch.py runs it
            continue
        if "--nproc-per-node" in command and command[0] == ".venv/bin/isotrain":
            left_out.append(command)  # many processes: tests/train/test_launch.py runs one
            assert "--out-dir" in command, command
            parse_train_args(nproc_per_node(command[2:])[1])
            continue
        if command[0] == "make":
            assert len(command) == 2 or command[2].startswith("TORCH="), command
            if len(command) > 2:  # make train TORCH=...: another torch build, not here
                left_out.append(command)
                continue
            args = _make_argv(command[1])
        elif command[0] == ".venv/bin/python":
            assert command[1] == "-c", command
            exec(command[2], {})  # the page's own snippet, as `python -c` runs it
            ran.append(command)
            continue
        else:
            args = command[1:]
        if "(minutes)" in note:
            args = [*args, *FEW_STEPS]
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        capsys.readouterr()
        t0 = time.perf_counter()
        code = _run(args)
        assert code == 0, (" ".join(command), capsys.readouterr().err)
        times.append((time.perf_counter() - t0, " ".join(command)[:70]))
        ran.append(command)
    if os.environ.get("ISOTRAIN_README_TIMES"):  # a file to write each command's seconds to
        lines = [f"{t:6.1f} s  {c}\n" for t, c in sorted(times)[::-1]]
        Path(os.environ["ISOTRAIN_README_TIMES"]).write_text("".join(lines))
    assert len(ran) >= 25 and len(left_out) <= 10, (len(ran), left_out)
    for path in ("plots/default/loss.png", "model.safetensors", "my-gpt/config.json"):
        assert (tmp_path / path).is_file(), path
    for path in ("runs/logged/csv", "runs/logged/tensorboard", "runs/tuned/hf", "runs/owt"):
        assert (tmp_path / path).is_dir(), path
    assert {p.name for p in tmp_path.iterdir()} <= {  # nothing the pages did not name
        "runs", "plots", "model.safetensors", "my-gpt", "data", "wandb-home",
        "notes", "src", "corpus", "tests", "gpt2", "models", "nanoGPT", "examples", "doctor.json",
    }  # fmt: skip


def inline_commands() -> list[tuple[str, list[str]]]:
    """(page, argv) of each command the pages' prose quotes with its flags: a benchmark script
    (`python benchmarks/bench_mfu.py --rounds 40`) or `isotrain train` with concrete values."""
    out = []
    for page in guides.PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M).replace("\n", " ")
        for command in re.findall(r"`((?:python benchmarks/|isotrain train )[^`]*)`", text):
            words = shlex.split(command)
            if "--" in command and not any(w.isupper() or "..." in w for w in words):
                out.append((guides.name(page), words))
    return out


def _declared_flags(script: Path) -> set[str]:
    """The option strings a benchmark script's parser declares (`add_argument("--x", ...)`)."""
    calls = [
        node
        for node in ast.walk(ast.parse(script.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"
    ]
    return {a.value for c in calls for a in c.args if isinstance(a, ast.Constant)}


def test_the_commands_quoted_in_prose_parse() -> None:
    """A benchmark's flags are ones its script declares; an `isotrain train` command parses."""
    commands = inline_commands()
    assert sum(argv[0] == "python" for _, argv in commands) >= 5
    assert any(argv[0] == "isotrain" for _, argv in commands)
    for page, argv in commands:
        if argv[0] == "python":
            flags = {w for w in argv[2:] if w.startswith("--")}
            unknown = flags - _declared_flags(ROOT / argv[1])
            assert not unknown, f"{page}: {' '.join(argv)}: {argv[1]} has no {sorted(unknown)}"
        elif "--nproc-per-node" in argv:
            parse_train_args(nproc_per_node(argv[2:])[1])
        else:
            parse_train_args(argv[2:])
