"""`isotrain doctor --nproc-per-node 2 FILE.py`: the guide's command (docs/ranks.md), run as a
user types it, starts two gloo ranks through torchrun's launcher; rank 0 prints the one merged
table, the exit status is the doctor's, and nothing of torchrun's reaches the output, with
torchrun's node flags (one node of a job across machines) too. Under plain torchrun the same
table comes once and torchrun's failure summary names that command."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from tests.guides import DOCS, fenced, section
from tests.worlds import ENV, free_port

from isotrain.train.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
STARTING = (
    "isotrain doctor: starting 2 workers through torchrun on this machine, 1 thread each "
    "(OMP_NUM_THREADS)\n"
)


def _page() -> str:
    return section(DOCS / "ranks.md", "# Across ranks")


def _commands() -> list[list[str]]:
    """The guide's launcher commands (one machine; one node of several), as argv for
    `python -m isotrain`, the rendezvous port a free one."""
    lines = [c for c in fenced(_page(), "bash") if "isotrain doctor --nproc-per-node" in c]
    out = []
    for line in lines:
        words = shlex.split(line.replace("\\\n", " ").replace("29500", str(free_port())))
        assert words[:3] == [".venv/bin/isotrain", "doctor", "--nproc-per-node"], words
        out.append(words[1:])
    return out


def _isotrain(
    argv: list[str], cwd: Path, *, under: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """`python -m isotrain ARGV` (under `python -m torch.distributed.run UNDER`, if given)."""
    env = {k: v for k, v in os.environ.items() if k not in ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    launcher = ["-m", "torch.distributed.run", *under] if under else []
    return subprocess.run(
        [sys.executable, *launcher, "-m", "isotrain", *argv], cwd=cwd, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _timing_free(text: str) -> str:
    return re.sub(r"in [0-9.]+ s\)", "in ... s)", text)


@pytest.mark.slow
def test_the_guides_command_prints_one_table_and_exits_with_the_doctors_status(
    tmp_path: Path,
) -> None:
    """Two launches (the clean twin's exit 0 is test_ranks's, in one gloo world)."""
    example = fenced(_page(), "python")[0]
    (tmp_path / "ddp_example.py").write_text(example)
    (shown,) = [b for b in fenced(_page(), "text") if b.startswith("SEVERITY")]
    one_machine, one_node = _commands()
    assert one_node[:3] == one_machine[:3] and "--rdzv-endpoint" in one_node

    bug = _isotrain(one_node, tmp_path)  # torchrun's node flags pass through
    assert (bug.returncode, bug.stderr) == (1, STARTING)  # no traceback, no torchrun summary
    assert _timing_free(bug.stdout) == _timing_free(shown)

    under = ("--standalone", "--nproc-per-node", "2")  # plain torchrun: its status, its summary
    plain = _isotrain(["doctor", *one_machine[3:]], tmp_path, under=under)
    assert plain.returncode == 1 and _timing_free(plain.stdout) == _timing_free(shown)
    assert (
        "traceback : isotrain doctor: error findings (replica_divergence): rank 0's table is "
        "above (isotrain doctor --nproc-per-node N FILE.py, with torchrun's --nnodes"
        in plain.stderr
    )


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--nproc-per-node", "2", "--trainer"], "--nproc-per-node N runs FILE.py's setup on N"),
        (["--nproc-per-node", "2", "nothere.py"], "nothere.py: no such Python file"),
        (["--nproc-per-node", "0", "x.py"], "--nproc-per-node 0 is not a positive integer"),
        (["--nnodes", "2", "x.py"], "--nnodes goes with --nproc-per-node N: isotrain doctor"),
        (["--nproc-per-node", "2", "--rdzv_endpoint"], "--rdzv_endpoint needs a value"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_any_worker_starts(argv, error, capsys) -> None:
    assert main(["doctor", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"isotrain doctor: error: {error}") and err.count("\n") == 1
