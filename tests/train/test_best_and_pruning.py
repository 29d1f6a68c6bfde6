"""BEST names the snapshot of the best evaluation, which pruning keeps; a reader that loses a
snapshot to the pruner lists the snapshots again and takes a newer one."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

from isotrain.train import loop
from isotrain.train.cli.main import main
from isotrain.train.rundir import integrity
from isotrain.train.rundir.metrics import read_metrics
from isotrain.train.rundir.snapshot import SnapshotError, find_snapshots, load_snapshot

SMOKE = ["--preset", "smoke", "--data.max-bytes", "60000", "--sample-tokens", "0"]
PRUNE_EVERY_STEP = ["--snapshot.every", "1", "--snapshot.keep", "1"]
# Validation losses by step: the best (3.0) first at step 4, tied at 8, worse at the end.
SCRIPTED = {2: 5.0, 4: 3.0, 6: 4.0, 8: 3.0, 10: 3.5, 12: 6.0}


def test_best_is_the_best_evaluation_and_survives_pruning(tmp_path, monkeypatch) -> None:
    run = tmp_path / "run"
    monkeypatch.setattr(loop, "evaluate", lambda r: SCRIPTED[r.state.step])
    argv = ["train", *SMOKE, "--steps", "12", "--eval-every", "2", *PRUNE_EVERY_STEP]
    assert main([*argv, "--out-dir", str(run)]) == 0
    history = [(r["step"], r["val_loss"]) for r in read_metrics(run) if r["kind"] == "eval"]
    assert history == sorted(SCRIPTED.items())
    best_step = min(history, key=lambda sv: sv[1])[0]  # the first of equal losses
    snaps = run / "snapshots"
    assert (snaps / "BEST").read_text() == f"step_{best_step:07d}"
    assert [p.name for p in find_snapshots(run)] == [f"step_{best_step:07d}", "step_0000012"]
    _, path = load_snapshot(run, which="best")
    assert path.name == f"step_{best_step:07d}"
    meta = json.loads((path / "meta.json").read_text())
    assert meta["val_loss"] == SCRIPTED[best_step]


def test_a_snapshot_between_evaluations_carries_no_validation_loss(tmp_path) -> None:
    run = tmp_path / "run"
    argv = ["train", *SMOKE, "--steps", "5", "--eval-every", "2", "--snapshot.every", "1"]
    assert main([*argv, "--snapshot.keep", "9", "--out-dir", str(run)]) == 0
    losses = {
        p.name: json.loads((p / "meta.json").read_text())["val_loss"] for p in find_snapshots(run)
    }
    evaluated = [name for name, loss in losses.items() if loss is not None]
    assert evaluated == ["step_0000002", "step_0000004", "step_0000005"]  # the end: evaluated


def test_a_reader_never_loses_to_the_pruner(tmp_path, caplog) -> None:
    run = tmp_path / "run"
    argv = ["train", *SMOKE, "--steps", "60", *PRUNE_EVERY_STEP, "--out-dir", str(run)]
    result: list[int] = []
    trainer = threading.Thread(target=lambda: result.append(main(argv)), daemon=True)
    trainer.start()
    deadline, reads, errors = time.monotonic() + 240, 0, []
    try:
        with caplog.at_level(logging.WARNING):
            while trainer.is_alive() and time.monotonic() < deadline:
                if not (run / "snapshots" / "LATEST").is_file():
                    time.sleep(0.01)
                    continue
                try:
                    load_snapshot(run, check=None)
                    reads += 1
                except SnapshotError as e:
                    errors.append(str(e))
    finally:  # never leave the trainer printing into the next test
        trainer.join(timeout=max(deadline - time.monotonic(), 1))
    assert not trainer.is_alive() and result == [0]
    assert errors == [] and reads >= 10
    assert "damaged" not in caplog.text


def test_a_snapshot_renamed_away_between_its_check_and_its_read_is_listed_again(
    tmp_path, monkeypatch, caplog
) -> None:
    """The pruner's rename lands after a file was found but before it is read: the reader
    takes another snapshot, with no traceback and no "damaged" warning."""
    run = tmp_path / "run"
    argv = ["train", *SMOKE, "--steps", "2", "--snapshot.every", "1", "--snapshot.keep", "2"]
    assert main([*argv, "--out-dir", str(run)]) == 0
    first, latest = find_snapshots(run)
    real, pruned = integrity.sha256, []

    def pruned_while_reading(path):
        if not pruned and latest in path.parents:
            pruned.append(path)
            os.replace(latest, latest.with_name(".pruned"))
            (latest.parent / "LATEST").write_text(first.name)  # as the writer moves it on
        return real(path)

    monkeypatch.setattr(integrity, "sha256", pruned_while_reading)
    with caplog.at_level(logging.WARNING):
        _, path = load_snapshot(run, check=None)
    assert pruned and path == first
    assert "damaged" not in caplog.text
