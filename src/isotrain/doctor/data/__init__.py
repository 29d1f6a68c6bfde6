"""Batches and data loading: what one batch holds (batch), what the labels mean against the
loss that consumes them (labels), the class mix of the batches against the dataset's (mix),
whether an image and its mask move together (pairs), what a DataLoader's workers draw
(workers) and the eval loaders your eval_fn reads against the training one (splits). Checks
that read the dataset itself need the user's DataLoader as `batches`.

Kinds: `batch_size_mismatch`, `labels_truncated`, `batch_class_mix`,
`pair_transform_mismatch`, `dataloader_worker_seed`, `train_val_overlap`, `eval_augmented`.
"""

from isotrain.doctor.data.batch import BATCH_SIZE
from isotrain.doctor.data.labels import LABELS
from isotrain.doctor.data.mix import MIX
from isotrain.doctor.data.pairs import PAIRS
from isotrain.doctor.data.splits import SPLITS
from isotrain.doctor.data.workers import WORKERS
from isotrain.doctor.ground.kinds import Check

__all__ = ["CHECKS"]

CHECKS: tuple[Check, ...] = (BATCH_SIZE, LABELS, MIX, PAIRS, WORKERS, SPLITS)
