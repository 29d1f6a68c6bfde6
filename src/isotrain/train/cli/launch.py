"""`isotrain train|doctor --nproc-per-node N`: torchrun's own launcher, started in this process.

The command is checked here, once, before any worker starts: a bad setting is one line and
no process is spawned. The workers are torchrun's (`torch.distributed.run`, one node,
rendezvous on a free port). A worker's user error travels back in torchrun's error file and
is printed here once, as one line, in place of torchrun's failure summary. Jobs on several
machines call `torchrun` directly; the error file carries the line there too.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from isotrain.train.config import ConfigError
from isotrain.train.environment import LAUNCHER
from isotrain.train.files import replace_file

if TYPE_CHECKING:  # torch: imported by `launch`, not by `isotrain --help`
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

__all__ = ["QUIET_EXIT", "failed_worker", "launch", "nproc_per_node", "tell_launcher"]

FLAG = "--nproc-per-node"
# torchrun's own log lines (rendezvous, "closing signal SIGTERM", its failure table) say
# again, in its words, what the launcher's one line says.
_QUIET = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")
QUIET_EXIT = "-"  # a worker's error-file message: its status says it all, print no line


def nproc_per_node(argv: Sequence[str]) -> tuple[int | None, list[str]]:
    """The value of `--nproc-per-node N` (None when absent) and argv without it."""
    value, rest, words = None, [], list(argv)
    while words:
        word = words.pop(0)
        if word == FLAG or word.startswith(FLAG + "="):
            text = word.split("=", 1)[1] if "=" in word else (words.pop(0) if words else "")
            if not text.isdigit() or int(text) < 1:
                shown = f" {text}" if text else ""
                raise ConfigError(f"{FLAG}{shown} is not a positive integer; try {FLAG} 2")
            value = int(text)
        else:
            rest.append(word)
    if value is not None and "RANK" in os.environ:
        raise ConfigError(f"{FLAG} starts torchrun itself; under torchrun leave it out")
    return value, rest


def tell_launcher(line: str) -> bool:
    """Hand a worker's one-line error to torchrun's error file; True when the launcher of
    `isotrain train --nproc-per-node` will print it (so the worker stays quiet)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    replace_file(path, json.dumps({"message": line, "timestamp": str(int(time.time()))}))
    return bool(os.environ.get(LAUNCHER))


def _threads(nproc: int) -> str:
    """OMP_NUM_THREADS for each worker: the user's, else this machine's cores shared out."""
    if "OMP_NUM_THREADS" in os.environ:
        return os.environ["OMP_NUM_THREADS"]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return str(max(1, (cores or 1) // nproc))


def _quiet_torchrun() -> None:
    """Only CRITICAL lines from torchrun's loggers (each sets its own level when created)."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(_QUIET):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def failed_worker(e: ChildFailedError, command: str = "train") -> tuple[str, int]:
    """The one line for a failed torchrun job (its first failure) and the exit status; an
    empty line when the worker said all there is (a doctor's table with an error)."""
    rank, failure = e.get_first_failure()
    if isinstance(failure.message, str) and failure.message.startswith("isotrain "):
        line = failure.message  # a worker's own one-line error
    elif failure.message == QUIET_EXIT:
        line = ""
    elif failure.exitcode < 0:
        line = (
            f"isotrain {command}: error: worker rank {rank} was stopped by {failure.signal_name()}"
        )
    else:
        line = (
            f"isotrain {command}: error: worker rank {rank} failed with exit code "
            f"{failure.exitcode}; its output is above"
        )
    return line, failure.exitcode if failure.exitcode > 0 else 1


def launch(
    nproc: int, argv: Sequence[str], command: str = "train", *, rendezvous: Sequence[str] = ()
) -> int:
    """Run `isotrain COMMAND ARGV` in `nproc` torchrun workers on this machine (one node of
    a job across machines with torchrun's `rendezvous` flags); the exit status (the workers'
    own, never torchrun's traceback)."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    threads = _threads(nproc)
    sys.stderr.write(
        f"isotrain {command}: starting {nproc} worker{'s' if nproc != 1 else ''} through torchrun "
        f"on this machine, {threads} thread{'s' if threads != '1' else ''} each "
        "(OMP_NUM_THREADS)\n"
    )
    workers_env = {
        LAUNCHER: str(Path(sys.argv[0]).absolute()) if sys.argv else "isotrain",
        "OMP_NUM_THREADS": threads,
    }
    saved = {k: os.environ.get(k) for k in workers_env}
    os.environ.update(workers_env)  # the workers inherit this process's environment
    where = list(rendezvous) or ["--standalone"]
    args = torchrun.parse_args([*where, FLAG, str(nproc), "-m", "isotrain", command, *argv])
    _quiet_torchrun()
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        line, status = failed_worker(e, command)
        if line:
            sys.stderr.write(line + "\n")
        return status
    except SignalException as e:
        return 128 + int(e.sigval)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return 0
