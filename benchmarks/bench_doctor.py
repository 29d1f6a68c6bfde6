"""Wall time of isotrain.doctor.examine, fast checks and all checks, on two models.

Run:  python benchmarks/bench_doctor.py            (5-15 minutes on 2 busy cores)
      python benchmarks/bench_doctor.py --quick    (the smoke preset and a smaller GPT-2, fast
                                                    checks, all checks for the trainer only)

Models: the reference trainer's own step and evaluation at the tiny preset (`isotrain doctor
--trainer`: 4 layers, d_model 128, T 128, batches of 4), and a random-init Hugging Face GPT-2
of the same shape with a plain loss_fn step. The first call of each is timed on its own
(cold: first step, dynamo's first trace); then `--rounds` rounds interleave fast and all.
Both wall time and this process's CPU time are reported: on a shared machine wall time waits
for the neighbours, CPU time does not. Checks: neither setup gets an error or a warning, and
examine leaves model, parameters, buffers, optimizer and RNG as they were (StateAudit).
Writes doctor.{md,json} (doctor-<N>thread.* with --threads N other than 2) into
benchmarks/results/<cpu-kind>/.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from common import (
    add_common_args,
    check,
    checks_md,
    machine_line,
    out_dir,
    run_meta,
    steady_malloc,
    torch_threads,
    write_results,
)
from isotrain.contexts import StateAudit
from isotrain.doctor import Diagnosis, examine
from isotrain.train.cli.doctor import trainer_setup

COLUMNS = ["model", "checks", "cold wall s", "wall s (median)", "CPU s (median)", "target",
           "findings (error/warning/info)"]  # fmt: skip
TARGETS = {"fast": 10.0, "all": 60.0}  # the tiny model on 2 cores


def hf_setup(*, quick: bool) -> dict[str, Any]:
    """A random-init GPT-2 (the trainer's tiny shape; smaller with --quick) and its batches."""
    import transformers

    d, layers, t = (32, 2, 32) if quick else (128, 4, 128)
    cfg = transformers.GPT2Config(
        n_layer=layers, n_head=4, n_embd=d, vocab_size=256, n_positions=t, use_cache=False
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg)
        batches = [torch.randint(0, 256, (4, t)) for _ in range(2)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)

    def loss_fn(m: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return m(input_ids=ids, labels=ids).loss

    return dict(model=model, optimizer=opt, batches=batches, loss_fn=loss_fn, task="lm")


def timed(setup: dict[str, Any], checks: str) -> tuple[float, float, Diagnosis]:
    wall, cpu = time.perf_counter(), time.process_time()
    d = examine(**setup, checks=checks)
    return time.perf_counter() - wall, time.process_time() - cpu, d


def counts(d: Diagnosis) -> str:
    n = [sum(f.severity == s for f in d.findings) for s in ("error", "warning", "info")]
    return "/".join(map(str, n))


def run(
    setups: dict[str, Callable[[], dict[str, Any]]], rounds: int, sets: dict[str, tuple[str, ...]]
) -> dict[str, Any]:
    """Cold call of every (model, check set), then `rounds` interleaved rounds (none: the
    cold call is the only sample)."""
    results: dict[str, Any] = {}
    made = {name: make() for name, make in setups.items()}
    changed = []
    for name, setup in made.items():
        for checks in sets[name]:
            opt_before = copy.deepcopy(setup["optimizer"].state_dict())
            with StateAudit(setup["model"], check_params=True, warn=False) as audit:
                wall, cpu, d = timed(setup, checks)
            if audit.differences or repr(opt_before) != repr(setup["optimizer"].state_dict()):
                changed.append(f"{name} ({checks})")
            results[f"{name}|{checks}"] = {"cold": wall, "wall": [], "cpu": [], "diag": d}
            if not rounds:
                results[f"{name}|{checks}"].update(wall=[wall], cpu=[cpu])
    for _ in range(rounds):  # interleaved: each round times every model and both check sets
        for name, setup in made.items():
            for checks in sets[name]:
                wall, cpu, d = timed(setup, checks)
                r = results[f"{name}|{checks}"]
                r["wall"].append(wall)
                r["cpu"].append(cpu)
    results["_changed"] = changed  # examine changed model, optimizer or RNG (none should)
    return results


def markdown(rows: list[list[str]], meta: dict[str, Any], checks: dict[str, Any]) -> str:
    lines = [
        "# The doctor's cost",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {machine_line(meta)}  ",
        f"Rounds {meta['rounds']} after the cold call, fast and all interleaved (0: the cold "
        "call is the only sample). The machine is shared: wall time includes waiting for other "
        "processes, CPU time does not.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|---|---|---:|---:|---:|---:|---|",
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
        "Targets (the tiny model on 2 cores): fast checks under 10 s, all checks under 60 s.",
        "",
    ]
    return "\n".join([*lines, *checks_md(checks)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, threads=2)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds after the cold call")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.threads = 0, 1
    out = out_dir(args)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp, torch_threads(args.threads):
        preset = "smoke" if args.quick else "tiny"
        trainer, hf = f"trainer --preset {preset}", "HF GPT-2, random init"
        setups = {
            trainer: lambda: trainer_setup(preset, out_dir=tmp),
            hf: lambda: hf_setup(quick=args.quick),
        }
        both = ("fast", "all")
        sets = {trainer: both, hf: ("fast",) if args.quick else both}  # quick: a smoke run
        results = run(setups, args.rounds, sets)
        meta = run_meta("bench_doctor.py", argv, load_before)
    bad = results.pop("_changed")
    rows, dirty = [], []
    for key, r in results.items():
        name, checks = key.split("|")
        wall, cpu = statistics.median(r["wall"]), statistics.median(r["cpu"])
        target = f"< {TARGETS[checks]:.0f} s" if name.endswith("tiny") else "—"
        rows.append([name, checks, f"{r['cold']:.1f}", f"{wall:.1f}", f"{cpu:.1f}", target,
                     counts(r["diag"])])  # fmt: skip
        r["wall_median"], r["cpu_median"] = wall, cpu
        if any(f.severity != "info" for f in r.pop("diag").findings):
            dirty.append(key)
    meta.update(rounds=args.rounds, unit="s")
    checks = {
        "no error or warning": check(not dirty, f"setups with one: {dirty or 'none'}"),
        "state restored": check(not bad, f"setups examine changed: {bad or 'none'}"),
    }
    res = {"meta": meta, "results": results, "checks": checks}
    stem = "doctor" if args.quick or args.threads == 2 else f"doctor-{args.threads}thread"
    return write_results(out, stem, res, markdown(rows, meta, checks))


if __name__ == "__main__":
    steady_malloc()
    raise SystemExit(main())
