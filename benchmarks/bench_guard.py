"""Cost of StepGuard: guarded vs unguarded (plain clip_grad_norm_ + optimizer.step) train steps.

Two model sizes (small transformer encoders, d=128 and d=384), AdamW for-loop (the CPU default)
and AdamW fused. Guarded variants: skip_mode "auto" (on CPU: "host") and the accelerator path
("select" for for-loop AdamW, "found_inf" for fused). Rounds interleave the variants (order
rotating); each round times a few full steps (forward + backward + update) per variant; we
report medians and the median of the per-round paired ratios against the plain step, plus the
update phase alone (clip + step, or guard.step). One thread by default: the machine is shared.

    .venv/bin/python benchmarks/bench_guard.py          # ~2 minutes on 2 shared cores
    .venv/bin/python benchmarks/bench_guard.py --quick  # seconds, a smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from isotrain.guard import StepGuard

RESULTS = Path(__file__).parent / "results"


def build(d: int, layers: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=4 * d, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
                         nn.Linear(d, d))  # fmt: skip


class Variant:
    def __init__(self, d: int, layers: int, opt_kind: str, mode: str | None) -> None:
        self.model = build(d, layers, seed=0)
        fused = opt_kind == "fused"
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=1e-4, fused=fused, foreach=None if fused else False
        )
        self.mode = mode or "plain"
        self.guard = None
        if mode is not None:
            self.guard = StepGuard(self.opt, self.model, max_norm=1.0, skip_mode=mode)

    def step(self, x: torch.Tensor) -> float:
        """One train step; returns the update-phase seconds."""
        loss = self.model(x).square().mean()
        loss.backward()
        t0 = time.perf_counter()
        if self.guard is not None:
            self.guard.step(loss.detach())
        else:
            nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0


def time_steps(v: Variant, x: torch.Tensor, n: int) -> tuple[float, float]:
    totals, updates = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        updates.append(v.step(x))
        totals.append(time.perf_counter() - t0)
    return statistics.median(totals), statistics.median(updates)


def bench(d: int, layers: int, opt_kind: str, rounds: int, steps: int, batch: tuple) -> list:
    device_mode = "found_inf" if opt_kind == "fused" else "select"
    variants = [Variant(d, layers, opt_kind, m) for m in (None, "auto", device_mode)]
    x = torch.randn(*batch, d, generator=torch.Generator().manual_seed(1))
    for v in variants:  # warm up: allocator, optimizer state, the guard's buffers
        time_steps(v, x, 2)
    rows: list[dict[str, tuple[float, float]]] = []
    for r in range(rounds):  # within a round, variants alternate step by step (order rotating)
        order = variants[r % 3 :] + variants[: r % 3]
        per: dict[str, list[tuple[float, float]]] = {v.mode: [] for v in variants}
        for _ in range(steps):
            for v in order:
                per[v.mode].append(time_steps(v, x, 1))
        rows.append({m: (statistics.median(t for t, _ in ts), statistics.median(u for _, u in ts))
                     for m, ts in per.items()})  # fmt: skip
    n_params = sum(p.numel() for p in variants[0].model.parameters())
    out = []
    for v in variants[1:]:
        mode = v.guard.skip_mode  # type: ignore[union-attr]
        ratios = [row[v.mode][0] / row["plain"][0] for row in rows]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        out.append({
            "d_model": d, "layers": layers, "params": n_params, "optimizer": f"AdamW {opt_kind}",
            "skip_mode": f"{v.mode} ({mode})" if v.mode == "auto" else mode, "batch": list(batch),
            "plain_step_ms": 1e3 * statistics.median(row["plain"][0] for row in rows),
            "guarded_step_ms": 1e3 * statistics.median(row[v.mode][0] for row in rows),
            "plain_update_ms": 1e3 * statistics.median(row["plain"][1] for row in rows),
            "guarded_update_ms": 1e3 * statistics.median(row[v.mode][1] for row in rows),
            "ratio_median": statistics.median(ratios), "ratio_q1": q[0], "ratio_q3": q[2],
            "rounds": rounds, "steps_per_round": steps,
        })  # fmt: skip
    return out


def bench_update(d: int, layers: int, opt_kind: str, reps: int) -> dict:
    """The update phase alone, with the same gradients every time: less noise than full steps."""
    device_mode = "found_inf" if opt_kind == "fused" else "select"
    variants = [Variant(d, layers, opt_kind, m) for m in (None, "auto", device_mode)]
    x = torch.randn(4, 64, d, generator=torch.Generator().manual_seed(1))
    variants[0].model(x).square().mean().backward()
    grads = [p.grad.clone() for p in variants[0].model.parameters()]  # type: ignore[union-attr]
    times: dict[str, list[float]] = {v.mode: [] for v in variants}
    for r in range(reps + 2):
        for v in variants[r % 3 :] + variants[: r % 3]:
            for p, g in zip(v.model.parameters(), grads, strict=True):
                p.grad = g.clone()
            t0 = time.perf_counter()
            if v.guard is not None:
                v.guard.step(torch.tensor(1.0))
            else:
                nn.utils.clip_grad_norm_(v.model.parameters(), 1.0)
                v.opt.step()
                v.opt.zero_grad(set_to_none=True)
            if r >= 2:  # the first two rounds warm up
                times[v.mode].append(time.perf_counter() - t0)
    med = {m: 1e3 * statistics.median(t) for m, t in times.items()}
    return {"d_model": d, "optimizer": f"AdamW {opt_kind}", "reps": reps,
            "update_ms": med, "device_mode": device_mode}  # fmt: skip


def write(results: list[dict], updates: list[dict], args: argparse.Namespace) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__, "python": platform.python_version(),
        "threads": torch.get_num_threads(), "machine": platform.machine(),
        "command": "python benchmarks/bench_guard.py" + (" --quick" if args.quick else ""),
    }  # fmt: skip
    payload = {"meta": meta, "results": results, "update_only": updates}
    (RESULTS / "guard.json").write_text(json.dumps(payload, indent=2))
    lines = [
        "# StepGuard overhead",
        "",
        f"`{meta['command']}` (torch {meta['torch']}, CPU, {meta['threads']} threads, shared "
        "machine). Full train step = forward + backward + update. Ratio: median over interleaved "
        "rounds of guarded/plain step time (IQR in brackets). Update = clip + step (+ guard).",
        "",
        "| d_model | params | optimizer | skip_mode | plain step ms | guarded step ms "
        "| ratio [IQR] | plain update ms | guarded update ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['d_model']} | {r['params'] / 1e6:.2f}M | {r['optimizer']} | {r['skip_mode']} "
            f"| {r['plain_step_ms']:.1f} | {r['guarded_step_ms']:.1f} "
            f"| {r['ratio_median']:.3f} [{r['ratio_q1']:.3f}, {r['ratio_q3']:.3f}] "
            f"| {r['plain_update_ms']:.2f} | {r['guarded_update_ms']:.2f} |"
        )
    lines += [
        "",
        "Update phase alone (same gradients each time, median ms over interleaved reps):",
        "",
        "| d_model | optimizer | plain | guarded auto | guarded device path | device path |",
        "|---|---|---|---|---|---|",
    ]
    for u in updates:
        m = u["update_ms"]
        lines.append(
            f"| {u['d_model']} | {u['optimizer']} | {m['plain']:.2f} | {m['auto']:.2f} "
            f"| {m[u['device_mode']]:.2f} | {u['device_mode']} |"
        )
    (RESULTS / "guard.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rounds, steps = (3, 2) if args.quick else (args.rounds, args.steps)
    batch = (2, 16) if args.quick else (4, 64)
    results, updates = [], []
    for d in (64,) if args.quick else (128, 384):
        for opt_kind in ("for-loop", "fused"):
            results.extend(bench(d, 2, opt_kind, rounds, steps, batch))
            updates.append(bench_update(d, 2, opt_kind, reps=5 if args.quick else 30))
            print(json.dumps(results[-2:]), json.dumps(updates[-1]))
    write(results, updates, args)


if __name__ == "__main__":
    main()
