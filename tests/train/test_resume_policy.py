"""Resume is explicit: the same run continues; other data, tokenizer, seed or a finished run
are refused with the ways on; snapshots come at every evaluation and every few minutes."""

import dataclasses
from pathlib import Path

import pytest

from isotrain.train import config as C
from isotrain.train import loop, watch
from isotrain.train.cli.main import main

SMOKE = ["--preset", "smoke", "--data.max-bytes", "60000", "--sample-tokens", "0"]


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture
def finished(tmp_path) -> Path:
    run = tmp_path / "run"
    assert main(["train", *SMOKE, "--steps", "4", "--out-dir", str(run)]) == 0
    return run


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--steps", "6", "--seed", "7"],
            "holds a run with --seed 1337, not 7: resuming would continue that run on "
            "something else; try a new --out-dir for a new run, or --init-from {run} to start",
        ),
        (
            ["--steps", "6", "--data.val-fraction", "0.2"],
            "holds a run with --data.val-fraction 0.1, not 0.2",
        ),
    ],
)
def test_a_resume_that_would_mislead_is_refused(finished, capsys, extra, message) -> None:
    before = _tree(finished)
    capsys.readouterr()
    code = main(["train", *SMOKE, "--steps", "4", *extra, "--out-dir", str(finished)])
    err = capsys.readouterr().err
    assert code == 2 and message.format(run=finished) in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert _tree(finished) == before


def test_the_same_command_on_a_finished_run_says_it_is_complete(finished, capsys) -> None:
    before = _tree(finished)
    capsys.readouterr()
    assert main(["train", *SMOKE, "--steps", "4", "--out-dir", str(finished)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        f"isotrain train: {finished} is complete: it trained 4 of --steps 4; pass --steps 8 to "
        "train it further, or a new --out-dir for a new run"
    )
    assert any(ln.startswith("next ") for ln in out) and f"sample {finished}" in out[-1]
    assert _tree(finished) == before


def test_a_command_without_out_dir_is_refused_by_another_run_in_runs_default(
    tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", *SMOKE, "--steps", "2", "--out-dir", "runs/default"]) == 0
    before = _tree(tmp_path / "runs")
    capsys.readouterr()
    assert main(["train", *SMOKE, "--steps", "2", "--model.n-layer", "3"]) == 2
    assert capsys.readouterr().err == (
        "isotrain train: error: runs/default holds another run (it has --model.n-layer 2; this "
        "command: 3), so this command is a new run: pass --out-dir runs/smoke (or any new "
        "directory)\n"
    )
    (tmp_path / "runs/smoke").mkdir()  # the name offered is always a fresh one
    assert main(["train", *SMOKE, "--steps", "2", "--seed", "5", "--data.path", "notes/"]) == 2
    err = capsys.readouterr().err
    assert "(it has --data.path unset --seed 1337; this command: 'notes/', 5)" in err, err
    assert "pass --out-dir runs/smoke-notes (or" in err
    assert main(["train", *SMOKE, "--steps", "2", "--model.n-layer", "3"]) == 2
    assert "pass --out-dir runs/smoke-2 (or" in capsys.readouterr().err
    assert _tree(tmp_path / "runs") == before
    # the same run with more steps continues it; --out-dir runs/default gets the resume's checks
    assert main(["train", *SMOKE, "--steps", "3"]) == 0
    assert main(["train", *SMOKE, "--steps", "4", "--seed", "5", "--out-dir", "runs/default"]) == 2
    assert "holds a run with --seed 1337, not 5" in capsys.readouterr().err


def test_more_steps_continue_the_run(finished) -> None:
    assert main(["train", *SMOKE, "--steps", "6", "--out-dir", str(finished)]) == 0
    assert sorted(p.name for p in (finished / "snapshots").glob("step_*"))[-1] == "step_0000006"


def _saved_steps(monkeypatch, tmp_path, **kw) -> list[int]:
    steps: list[int] = []
    real = watch.save_run  # every snapshot of the loop goes through watch.save

    def record(run):
        steps.append(run.state.step)
        return real(run)

    monkeypatch.setattr(watch, "save_run", record)
    base = C.PRESETS["smoke"]()
    cfg = dataclasses.replace(
        base,
        data=dataclasses.replace(base.data, max_bytes=60_000),
        **{"steps": 6, "eval_every": 2, "sample_tokens": 0, "out_dir": str(tmp_path), **kw},
    )
    loop.train(cfg)
    return steps


def test_snapshots_at_every_evaluation_by_default(monkeypatch, tmp_path) -> None:
    assert C.SnapshotConfig().every is None and C.SnapshotConfig().minutes == 5.0
    no_clock = C.SnapshotConfig(minutes=0)
    assert _saved_steps(monkeypatch, tmp_path / "a", snapshot=no_clock) == [2, 4, 6]
    only_end = C.SnapshotConfig(every=0, minutes=0)
    assert _saved_steps(monkeypatch, tmp_path / "b", snapshot=only_end) == [6]


def test_snapshots_by_wall_time(monkeypatch, tmp_path) -> None:
    always = C.SnapshotConfig(every=0, minutes=1e-9)  # due after every step
    saved = _saved_steps(monkeypatch, tmp_path, snapshot=always, eval_every=100)
    assert saved == [1, 2, 3, 4, 5, 6]
