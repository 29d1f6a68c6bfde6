"""The run directory, which is untrusted input: the lock, safe writes, snapshots and resume.

`lock` keeps one writer per run, `writes` turns a failed write into one line,
`integrity` checks every file (sha256, paths kept inside the run, payload structure),
`snapshot` saves and loads atomically, `sharded` does it per rank for FSDP2 through DCP
(read without running code by `safe_dcp`), `metrics` reads `metrics.jsonl` back, and
`resume` knows what a training run consists of and what must match to continue it.
Imports `config`, `fields`, `parallel`, `state`, `model`; never `report`, `weights` or `cli`.
"""
