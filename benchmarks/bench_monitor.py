"""What isotrain.doctor.Monitor costs a DDP training step, at periods 1, 10 and 100.

Two gloo processes on this machine (one torch thread each) train the tiny preset's GPT (4
layers, d 128, T 256, B 16 per rank) under DistributedDataParallel with fused AdamW: one copy
without a monitor and one per period, interleaved by rounds of `--steps` steps (the order
rotates). Two measures: the step time of each copy, paired per round with the copy without a
monitor (noisy: the check is small against a loaded machine's jitter); and the time spent in
the monitor itself (its optimizer pre-hook and `after_step()`), at check steps and between
them, which the step time carries and which does not depend on the neighbours. The cost of a
period is that check time over the period, as a share of the step.

    python benchmarks/bench_monitor.py           # ~17 minutes on 2 cores at load 7
    python benchmarks/bench_monitor.py --quick   # seconds: a 2-layer d 32 GPT, periods 1, 10

Writes monitor.{md,json} into benchmarks/results/<cpu-kind>/. Checks: the sound copies get
no finding and train the same losses as the copy without a monitor; a parameter changed on
rank 1 only is found at the next check.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common import add_common_args, check, checks_md, machine_line, out_dir, run_meta, write_results
from isotrain.doctor import Monitor
from isotrain.train.data import batches as data_mod
from isotrain.train.update.optim import build_optimizer
from isotrain.train.weights.load import build_model
from loops import QUICK, TINY, load_corpus, train_config
from stats import fmt_ci, paired_diffs, summarize

COLUMNS = ["monitor", "checks in the run", "ms/step (median)",
           "extra ms/step vs off, paired [95% CI]", "one check, ms (median)",
           "between checks, µs/step", "cost per step at this period"]  # fmt: skip
WORLD = 2


class Copy:
    """One DDP model of the tiny preset and its optimizer, with a Monitor every `every` steps
    (0: none) whose two entry points are timed."""

    def __init__(self, cfg: Any, corpus: Any, every: int, **monitor: Any) -> None:
        torch.manual_seed(cfg.seed)  # the same initial weights in every copy
        self.raw = build_model(cfg.model)
        self.model = torch.nn.parallel.DistributedDataParallel(self.raw)
        self.opt = build_optimizer(self.raw, cfg.optim, fused=True)
        self.cfg, self.corpus, self.i, self.losses = cfg, corpus, 0, []
        self.check_s: list[float] = []  # pre-hook + after_step of each check step
        self.between_s: list[float] = []  # the same on other steps
        self.monitor = Monitor(self.model, self.opt, every=every, **monitor) if every else None
        self.pre = 0.0
        if self.monitor is not None:  # time the monitor's pre-hook inside optimizer.step()
            self.monitor._hook.remove()
            hook = self.monitor._pre_step

            def timed(*a: Any) -> None:
                t = time.perf_counter()
                hook(*a)
                self.pre += time.perf_counter() - t

            self.monitor._hook = self.opt.register_step_pre_hook(timed)

    def step(self) -> None:
        c = self.cfg
        x, y = data_mod.get_batch(
            self.corpus.train, batch_size=c.data.batch_size, block_size=c.model.block_size,
            seed=c.seed, step=self.i, rank=dist.get_rank(), world_size=WORLD,
        )  # fmt: skip
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(x, y)
        loss.backward()
        self.pre = 0.0
        self.opt.step()
        self.losses.append(loss.detach())
        self.i += 1
        if self.monitor is not None:
            t = time.perf_counter()
            self.monitor.after_step()
            spent = time.perf_counter() - t + self.pre
            (self.check_s if self.monitor.checked_at == self.i else self.between_s).append(spent)


def _drift_found(cfg: Any, corpus: Any) -> int | None:
    """A copy checked every 2 steps whose rank 1 changes a weight after step 3: the step of
    the finding (4 expected)."""
    copy = Copy(cfg, corpus, every=2, logger=None)
    assert copy.monitor is not None
    for _ in range(6):
        copy.step()
        if copy.i == 3 and dist.get_rank() == 1:
            with torch.no_grad():
                copy.raw.lm_head.weight[0, 0] += 1e-3
        if any(f.kind == "replica_divergence" for f in copy.monitor.findings):
            copy.monitor.close()
            return copy.i
    copy.monitor.close()
    return None


def worker(spec: dict[str, Any]) -> None:
    """One rank: every copy, interleaved by rounds; rank 0 writes what it measured."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = train_config(QUICK if spec["quick"] else TINY)
    corpus = load_corpus()
    copies = {e: Copy(cfg, corpus, e) for e in spec["periods"]}
    for c in copies.values():  # allocator, optimizer state, DDP's bucket rebuild: not timed
        c.step()
    names, times = list(copies), {e: [] for e in copies}
    for r in range(spec["rounds"]):
        for e in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier()
            t = time.perf_counter()
            for _ in range(spec["steps"]):
                copies[e].step()
            times[e].append((time.perf_counter() - t) / spec["steps"])
    out = {
        "times": {str(e): v for e, v in times.items()},
        "check_s": {str(e): c.check_s for e, c in copies.items()},
        "between_s": {str(e): c.between_s for e, c in copies.items()},
        "findings": {
            str(e): [f.kind for f in c.monitor.findings] for e, c in copies.items() if c.monitor
        },
        "same_losses": all(
            torch.equal(torch.stack(c.losses), torch.stack(copies[0].losses))
            for c in copies.values()
        ),
        "drift_found_at": _drift_found(cfg, corpus),
    }
    for c in copies.values():
        if c.monitor is not None:
            c.monitor.close()
    dist.destroy_process_group()
    Path(spec["out"], f"rank{os.environ['RANK']}.json").write_text(json.dumps(out))


def launch(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Both ranks as subprocesses of this script (`--worker`), on a free local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(WORLD):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD),
               "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}  # fmt: skip
        cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
        procs.append(subprocess.Popen(cmd, env=env))
    codes = [p.wait(timeout=3600) for p in procs]
    if any(codes):
        raise SystemExit(f"a worker failed: exit codes {codes}")
    return [json.loads(Path(spec["out"], f"rank{r}.json").read_text()) for r in range(WORLD)]


def rows_of(res: dict[str, Any], periods: list[int]) -> tuple[list[list[str]], dict[str, Any]]:
    times = {str(e): res["times"][str(e)] for e in periods}
    diffs = paired_diffs(times, "0", scale=1e3)
    step_ms = statistics.median(times["0"]) * 1e3
    rows, summary = [], {}
    for e in periods:
        key, ms = str(e), statistics.median(times[str(e)]) * 1e3
        if e == 0:
            rows.append(["off", "-", f"{ms:.1f}", "-", "-", "-", "-"])
            continue
        checks, between = res["check_s"][key], res["between_s"][key]
        check_ms = statistics.median(checks) * 1e3 if checks else float("nan")
        between_us = statistics.median(between) * 1e6 if between else 0.0
        share = (check_ms / e + between_us * (e - 1) / e / 1e3) / step_ms
        summary[key] = {"check_ms": check_ms, "between_us": between_us, "share": share,
                        "extra_ms": summarize(diffs[key])}  # fmt: skip
        rows.append([f"every {e}", str(len(checks)), f"{ms:.1f}", fmt_ci(summarize(diffs[key]), 2),
                     f"{check_ms:.2f}", f"{between_us:.1f}", f"{100 * share:.3f}%"])  # fmt: skip
    return rows, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, threads=None)
    parser.add_argument("--rounds", type=int, default=6, help="rounds of --steps steps per copy")
    parser.add_argument("--steps", type=int, default=20, help="steps per copy per round")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(json.loads(args.worker))
        return 0
    periods = [0, 1, 10] if args.quick else [0, 1, 10, 100]
    rounds, steps = (1, 10) if args.quick else (args.rounds, args.steps)
    out, load_before = out_dir(args), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        spec = {
            "quick": args.quick,
            "periods": periods,
            "rounds": rounds,
            "steps": steps,
            "out": tmp,
        }
        ranks = launch(spec)
    meta = run_meta("bench_monitor.py", argv, load_before)
    meta.update(threads=1, processes=WORLD, rounds=rounds, steps=steps,
                shape=(QUICK if args.quick else TINY).label())  # fmt: skip
    rows, summary = rows_of(ranks[0], periods)
    found = [k for r in ranks for k in r["findings"].values() if k]
    checks = {
        "no finding on the sound copies": check(not found, f"findings: {found or 'none'}"),
        "same losses with and without the monitor": check(all(r["same_losses"] for r in ranks),
                                                          "every copy, bitwise, on every rank"),
        "a drift on rank 1 is found at the next check": check(
            all(r["drift_found_at"] == 4 for r in ranks),
            f"found at step {ranks[0]['drift_found_at']} (changed after step 3, checked every 2)"),
    }  # fmt: skip
    md = markdown(rows, meta, checks)
    return write_results(out, "monitor", {"meta": meta, "summary": summary, "ranks": ranks,
                                          "checks": checks}, md)  # fmt: skip


def markdown(rows: list[list[str]], meta: dict[str, Any], checks: dict[str, Any]) -> str:
    lines = [
        "# The Monitor's cost in a DDP step",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {machine_line(meta)}  ",
        f"{meta['processes']} gloo processes, 1 torch thread each; {meta['shape']} per rank; "
        f"{meta['rounds']} rounds of {meta['steps']} steps per copy, interleaved. The step time "
        "of a loaded machine varies by more than a check costs: read the check's own time.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|---|---:|---:|---|---:|---:|---:|",
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
        "cost per step at this period = (one check / period + the between-checks cost) / the "
        "step time without a monitor.",
        "",
    ]
    return "\n".join([*lines, *checks_md(checks)])


if __name__ == "__main__":
    raise SystemExit(main())
