"""`isotrain doctor FILE.py[:FUNCTION]` and `isotrain doctor --trainer`: parsing and wiring.

FUNCTION (default `doctor_setup`) returns a dict of `isotrain.doctor.examine` arguments; the
table goes to stdout, `--json OUT` writes the diagnosis as JSON, and the exit status is 1
when a finding is an error (so CI can run it), 0 otherwise, 2 for bad input.

Across ranks, `isotrain doctor --nproc-per-node N FILE.py` starts N workers through torchrun's
own launcher in this process (train/cli/launch.py); each joins a gloo group before the setup
runs (unless the setup joins one itself), every rank examines, the ranks are compared, rank 0
prints the one merged table, and the exit status is the doctor's; across machines torchrun's
node flags (`--nnodes`, `--node-rank`, `--rdzv-endpoint`, ...) go with it, on each machine.
Under plain torchrun (`torchrun --nproc-per-node N -m isotrain doctor FILE.py`) the setup joins
the group itself. Either way no rank exits before rank 0 has printed (NOTE [ranks exit
together]).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import inspect
import json
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, cast

import tyro

from isotrain.train.cli.args import check_output, parse
from isotrain.train.cli.launch import QUIET_EXIT, launch, nproc_per_node, tell_launcher
from isotrain.train.config import PRESETS, ConfigError
from isotrain.train.environment import LAUNCHER

if TYPE_CHECKING:  # torch and what imports it: only once the arguments parsed (see `main`)
    import torch
    from torch import nn

    from isotrain.doctor import Diagnosis

__all__ = ["cmd_doctor", "trainer_setup"]

Target = Annotated[str | None, tyro.conf.Positional, tyro.conf.arg(metavar="FILE.py[:FUNCTION]")]


@functools.cache
def _keys() -> tuple[list[str], list[str], str]:
    """What the setup's dict may hold, read from isotrain.doctor.examine's signature: the
    required names, all names, and both in words."""
    from isotrain.doctor import examine

    names = list(inspect.signature(examine).parameters.items())
    required = [n for n, p in names if p.default is inspect.Parameter.empty]
    rest = ", ".join(n for n, _ in names if n not in required)
    return required, [n for n, _ in names], f"{', '.join(required)} and any of {rest}"


EXAMPLE = Path(__file__).resolve().parents[4] / "examples" / "doctor_setup.py"  # in a clone
PRINT_TIMEOUT = 600.0  # seconds the other ranks wait for rank 0's table before exiting
# torchrun's flags for one node of a job across machines, passed on by --nproc-per-node
NODE_FLAGS = ("--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id", "--rdzv-backend",
              "--rdzv-conf", "--master-addr", "--master-port")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class DoctorArgs:
    """Examine a training setup for hidden side effects: FILE.py[:FUNCTION] (FUNCTION, default
    doctor_setup, returns a dict of isotrain.doctor.examine arguments), or --trainer;
    --nproc-per-node N examines FILE.py on N gloo ranks and compares them."""

    target: Target = None
    """The file defining the setup function, optionally :FUNCTION."""
    json: str | None = None
    """Also write the diagnosis as JSON to this file."""
    checks: Annotated[
        Literal["all", "fast"] | None,
        tyro.conf.arg(metavar="{all,fast}", help_behavior_hint="(default: the setup's, else all)"),
    ] = None
    """all, or fast (no compile checks, no few-dozen-step overfit test)."""
    only: tuple[str, ...] = ()
    """Examine only these kinds (e.g. --only host_sync mode_leak)."""
    trainer: bool = False
    """Examine isotrain's own reference trainer (its step and evaluation)."""
    preset: str = "tiny"
    """With --trainer: the trainer preset to examine."""


def _template() -> str:
    """Where to look for a worked setup: the repository's example, when this is a clone."""
    if not EXAMPLE.is_file():
        return "doctor_setup() in isotrain's examples/doctor_setup.py"
    with contextlib.suppress(ValueError):
        return str(EXAMPLE.relative_to(Path.cwd()))
    return str(EXAMPLE)


def _script(target: str) -> Path:
    """FILE of FILE.py[:FUNCTION], refused in one line unless it is a Python file."""
    file = target.partition(":")[0]
    path = Path(file).expanduser()
    if path.suffix != ".py" or not path.is_file():
        raise ConfigError(
            f"{file}: no such Python file; give the script that defines your setup function "
            f"(a worked one: {_template()})"
        )
    return path


def _load_setup(target: str) -> dict[str, Any]:
    """Import FILE, call FUNCTION(), check it returned examine's arguments."""
    file, _, func = target.partition(":")
    path = _script(target)
    spec = importlib.util.spec_from_file_location(f"_isotrain_doctor_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{file}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ConfigError(f"importing {file} raised {type(e).__name__}: {e}") from None
    name = func or "doctor_setup"
    fn = getattr(module, name, None)
    required, names, keys = _keys()
    if not callable(fn):
        raise ConfigError(
            f"{file} defines no function {name}(); write one returning a dict of "
            f"isotrain.doctor.examine's arguments ({keys}), as in {_template()}"
        )
    try:
        made = fn()
    except Exception as e:
        raise ConfigError(f"{name}() raised {type(e).__name__}: {e}") from None
    if not isinstance(made, dict) or not set(required) <= set(made):
        raise ConfigError(
            f"{name}() must return a dict with {keys}, got "
            + (f"keys {sorted(made)}" if isinstance(made, dict) else type(made).__name__)
        )
    extra = sorted(set(made) - set(names))
    if extra:
        raise ConfigError(f"{name}() returned unknown keys {extra}; examine takes {keys}")
    return made


def trainer_setup(preset: str = "tiny", *, out_dir: str, batch_size: int = 4) -> dict[str, Any]:
    """examine's arguments for the reference trainer's own step and evaluation, on batches of
    `batch_size` samples (the doctor measures behaviour, not throughput)."""
    from isotrain.train.loop import setup
    from isotrain.train.model.gpt import GPT
    from isotrain.train.step import evaluate, train_step
    from isotrain.train.watch import run_on

    if preset not in PRESETS:
        raise ConfigError(f"--preset {preset!r} is not a preset; try one of {', '.join(PRESETS)}")
    cfg = PRESETS[preset]()
    cfg = dataclasses.replace(
        cfg, out_dir=out_dir, progress=False, eval_batches=min(cfg.eval_batches, 2)
    )
    run = setup(cfg)

    def step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        outcome = train_step(run_on(run, model, optimizer, batch))
        return outcome["loss"] if isinstance(outcome, dict) else outcome.loss

    def eval_fn(model: nn.Module, batches: Any) -> float:
        return evaluate(dataclasses.replace(run, model=cast(GPT, model), train_model=model))

    batches = [tuple(t[:batch_size] for t in run.batches.get("train", i)[:2]) for i in range(2)]
    model = run.train_model
    return dict(
        model=model, optimizer=run.optimizer, batches=batches, step=step, eval_fn=eval_fn,
        task="lm",
    )  # fmt: skip


@contextlib.contextmanager
def _setup_of(a: DoctorArgs) -> Iterator[dict[str, Any]]:
    if a.trainer == (a.target is not None):
        raise ConfigError("give FILE.py[:FUNCTION] or --trainer (one of them); try --help")
    if not a.trainer:
        _join_launched_world()
        yield _load_setup(cast(str, a.target))
        return
    from isotrain.contexts import rng_isolated

    seed = PRESETS[a.preset]().seed if a.preset in PRESETS else 0
    with tempfile.TemporaryDirectory(prefix="isotrain-doctor-") as out, rng_isolated(seed=seed):
        yield trainer_setup(a.preset, out_dir=out)


def _node_flags(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """torchrun's node flags in argv, each with its value (`--flag V` or `--flag=V`, dashes or
    underscores), and argv without them."""
    flags, rest, words = [], [], list(argv)
    while words:
        word = words.pop(0)
        name, eq, value = word.partition("=")
        flag = name.replace("_", "-")
        if flag not in NODE_FLAGS:
            rest.append(word)
            continue
        if not eq:
            if not words or words[0].startswith("--"):
                raise ConfigError(f"{name} needs a value, as torchrun takes it (e.g. {flag} 2)")
            value = words.pop(0)
        flags += [flag, value]
    return flags, rest


def cmd_doctor(argv: Sequence[str]) -> int:
    nproc, argv = nproc_per_node(argv)
    nodes, argv = _node_flags(argv)
    if nodes and nproc is None:
        raise ConfigError(
            f"{nodes[0]} goes with --nproc-per-node N: isotrain doctor then starts torchrun on "
            "this machine, one node of the job (under torchrun itself, leave both out)"
        )
    a = parse(DoctorArgs, argv, "isotrain doctor")
    if a.json is not None:
        check_output("--json", Path(a.json), is_dir=False)
    if nproc is not None:
        if a.trainer or a.target is None:
            raise ConfigError(
                "--nproc-per-node N runs FILE.py's setup on N ranks; give FILE.py[:FUNCTION] "
                "(--trainer examines one process)"
            )
        _script(a.target)  # checked once, before any worker starts
        return launch(nproc, argv, "doctor", rendezvous=nodes)
    from isotrain.doctor import KINDS, examine  # torch: once the arguments parsed

    unknown = [k for k in a.only if k not in KINDS]
    if unknown:
        raise ConfigError(f"--only {' '.join(unknown)}: no such kind; kinds: {', '.join(KINDS)}")
    with _setup_of(a) as kwargs:
        main = _in_group()
        checks = list(a.only) if a.only else a.checks or kwargs.get("checks", "all")
        kwargs = {**kwargs, "checks": checks}
        try:
            diagnosis: Diagnosis = examine(**kwargs)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"examine refused the setup: {e}") from None
    if main:  # under torchrun every rank has the same merged diagnosis: rank 0 prints it
        sys.stdout.write(diagnosis.table(color=sys.stdout.isatty()) + "\n")
        sys.stdout.flush()
        if a.json is not None:
            Path(a.json).write_text(json.dumps(diagnosis.to_json(), indent=2) + "\n")
    status = 0 if diagnosis.ok else 1
    _exit_together(status, diagnosis)
    return status


def _join_launched_world() -> None:
    """In a worker of `isotrain doctor --nproc-per-node`, join the gloo group torchrun's
    environment describes, before the setup runs (a setup that joins one itself keeps it)."""
    if not os.environ.get(LAUNCHER) or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")


# NOTE [ranks exit together]
# torchrun takes a worker's non-zero exit as a failed job: it sends SIGTERM to the other
# workers at once (rank 0, perhaps mid-table or mid-JSON) and raises its ChildFailedError,
# whose traceback and failure summary end the output, exit 1. Rank 1 finishes first (it prints
# nothing), so an error finding used to reach the user as torchrun's traceback. So every rank
# waits, in a barrier rank 0 reaches once it has printed, and a rank that exits 1 writes its
# line in torchrun's error file: the launcher of --nproc-per-node prints none (the table said
# it) and returns the status; plain torchrun shows the line in its summary, in place of "To
# enable traceback", and exits 1 (torchrun's own status for any failed worker). Nothing a
# worker does reaches torchrun's own process: it raises ChildFailedError for any non-zero exit
# (its traceback), and a worker that exits 0 to spare it would make an error finding pass in
# CI. So the line names the launcher that gives the status without it, across machines too
# (torchrun's node flags pass through --nproc-per-node).


def _exit_together(status: int, diagnosis: Diagnosis) -> None:
    """Under a process group: wait for rank 0's table, and leave the error finding's line
    for torchrun's launcher (NOTE [ranks exit together])."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    with contextlib.suppress(Exception):  # rank 0 gone: its own status tells why
        if dist.get_backend() == "gloo":  # rank 0 reaches it once its table is printed
            dist.monitored_barrier(timeout=timedelta(seconds=PRINT_TIMEOUT))
        else:
            dist.barrier()
    if status:
        errors = sorted({f.kind for f in diagnosis.findings if f.severity == "error"})
        line = (
            f"isotrain doctor: error findings ({', '.join(errors)}): rank 0's table is above "
            "(isotrain doctor --nproc-per-node N FILE.py, with torchrun's --nnodes, --node-rank "
            "and --rdzv-endpoint across machines, exits with this status without torchrun's "
            "traceback)"
        )
        tell_launcher(QUIET_EXIT if os.environ.get(LAUNCHER) else line)


def _in_group() -> bool:
    """Whether this process prints: rank 0 of the setup's process group, or a lone process.
    Under torchrun the setup must have joined the group (examine then compares the ranks)."""
    import torch.distributed as dist

    world = os.environ.get("WORLD_SIZE", "1")
    joined = dist.is_available() and dist.is_initialized()
    if world.isdigit() and int(world) > 1 and not joined:
        raise ConfigError(
            f"torchrun started {world} processes, but the setup joined no process group: call "
            "torch.distributed.init_process_group() in it (gloo on CPUs, nccl on GPUs) before "
            "wrapping the model"
        )
    return not joined or dist.get_rank() == 0
