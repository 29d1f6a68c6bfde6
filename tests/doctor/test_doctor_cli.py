"""`isotrain doctor`: exit 0 clean, 1 with an error finding, 2 for bad input; --json, --only,
--checks, and --trainer (the reference trainer gets no error and no warning)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from isotrain.train.cli.main import main

ROOT = Path(__file__).resolve().parents[2]

SETUP = """
from tests.doctor import zoo

def doctor_setup():
    return zoo.mlp_setup()

def leaky():
    return zoo.mlp_setup(eval_fn=zoo.eval_forgets_train, step=zoo.step_with_item)

def not_a_dict():
    return [1, 2]

def typo():
    return {**zoo.mlp_setup(), "stepp": None}

def sync_only():
    return {**zoo.mlp_setup(step=zoo.step_with_item), "checks": ["host_sync"]}
"""


@pytest.fixture
def setup_file(tmp_path: Path) -> Path:
    path = tmp_path / "mysetup.py"
    path.write_text(SETUP)
    return path


def test_a_clean_setup_exits_0_and_prints_the_table(setup_file: Path, capsys) -> None:
    assert main(["doctor", str(setup_file), "--checks", "fast"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("SEVERITY KIND") and "0 error(s), 0 warning(s)" in out
    assert "\033[" not in out  # plain when not a terminal


def test_an_error_finding_exits_1_and_json_holds_every_finding(
    setup_file: Path, tmp_path: Path, capsys
) -> None:
    report = tmp_path / "doctor.json"
    argv = ["doctor", f"{setup_file}:leaky", "--checks", "fast", "--json", str(report)]
    assert main(argv) == 1
    data = json.loads(report.read_text())
    kinds = {f["kind"]: f["severity"] for f in data["findings"]}
    assert data["ok"] is False and kinds["mode_leak"] == "error"
    assert kinds["host_sync"] == "warning"
    assert "mode_leak" in capsys.readouterr().out


def test_only_examines_the_kinds_named(setup_file: Path, tmp_path: Path) -> None:
    report = tmp_path / "only.json"
    assert (
        main(["doctor", f"{setup_file}:leaky", "--only", "host_sync", "--json", str(report)]) == 0
    )
    data = json.loads(report.read_text())
    assert data["checks"] == ["host_sync"]
    assert [f["kind"] for f in data["findings"]] == ["host_sync"]


def test_the_setups_own_checks_apply_unless_a_flag_names_others(
    setup_file: Path, tmp_path: Path
) -> None:
    report = tmp_path / "own.json"
    assert main(["doctor", f"{setup_file}:sync_only", "--json", str(report)]) == 0
    assert json.loads(report.read_text())["checks"] == ["host_sync"]
    argv = ["doctor", f"{setup_file}:sync_only", "--checks", "fast", "--json", str(report)]
    assert main(argv) == 0
    assert "mode_leak" in json.loads(report.read_text())["checks"]


def test_the_shipped_example_is_clean_under_every_check(capsys) -> None:
    """`isotrain doctor examples/doctor_setup.py`, as the README runs it: no error, no warning."""
    assert main(["doctor", str(ROOT / "examples/doctor_setup.py")]) == 0
    assert "0 error(s), 0 warning(s)" in capsys.readouterr().out


def test_a_missing_function_names_the_keys_and_a_file_that_exists(
    setup_file: Path, capsys, monkeypatch
) -> None:
    monkeypatch.chdir(ROOT)
    assert main(["doctor", f"{setup_file}:nothere"]) == 2
    assert capsys.readouterr().err == (
        f"isotrain doctor: error: {setup_file} defines no function nothere(); write one "
        "returning a dict of isotrain.doctor.examine's arguments (model, optimizer, batches and "
        "any of step, epoch, loss_fn, eval_fn, forward, checks, task, samples_interact, "
        "loss_falls, total_steps, save, load, rank_timeout), "
        "as in examples/doctor_setup.py\n"
    )
    assert main(["doctor", "missing.py"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "isotrain doctor: error: missing.py: no such Python file; give the script that defines "
        "your setup function (a worked one: examples/doctor_setup.py)\n"
    )
    assert (ROOT / "examples/doctor_setup.py").is_file()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["missing.py"], "missing.py: no such Python file"),
        (["{f}:nothere"], "defines no function nothere()"),
        (["{f}:not_a_dict"], "must return a dict with model, optimizer, batches"),
        (["{f}:typo"], "returned unknown keys ['stepp']"),
        (["{f}", "--only", "host_sinc"], "--only host_sinc: no such kind"),
        (["{f}", "--trainer"], "give FILE.py[:FUNCTION] or --trainer"),
        ([], "give FILE.py[:FUNCTION] or --trainer"),
        (["--trainer", "--preset", "huge"], "--preset 'huge' is not a preset"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(setup_file: Path, capsys, argv, message) -> None:
    argv = [a.format(f=setup_file) for a in argv]
    assert main(["doctor", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("isotrain doctor: error: ") and message in err
    assert err.count("\n") == 1


def test_the_reference_trainer_gets_no_error_and_no_warning(tmp_path: Path, capsys) -> None:
    report = tmp_path / "trainer.json"
    argv = ["doctor", "--trainer", "--preset", "smoke", "--json", str(report)]  # all checks
    assert main(argv) == 0
    findings = json.loads(report.read_text())["findings"]
    assert [f for f in findings if f["severity"] != "info"] == []
    assert {f["kind"] for f in findings} <= {"host_sync", "memory", "weight_decay_on_norm_or_bias"}
    assert "0 error(s), 0 warning(s)" in capsys.readouterr().out


def test_the_command_is_listed_in_the_help(capsys) -> None:
    assert main(["--help"]) == 0
    assert "  doctor    find hidden side effects" in capsys.readouterr().out
