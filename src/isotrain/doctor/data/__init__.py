"""Batches and data loading: what one batch holds (batch) and what a DataLoader's workers
draw (workers).

Kinds: `batch_size_mismatch`, `dataloader_worker_seed`.
"""

from isotrain.doctor.data.batch import BATCH_SIZE
from isotrain.doctor.data.workers import WORKERS
from isotrain.doctor.ground.kinds import Check

__all__ = ["CHECKS"]

CHECKS: tuple[Check, ...] = (BATCH_SIZE, WORKERS)
