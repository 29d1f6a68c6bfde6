"""The doctor: find the hidden side effects in anyone's training step, and say how to fix them.

``examine(model, optimizer, batches, step=...)`` runs the user's own step and validation on
copies and reports each problem as a ``Finding`` (kind, severity, where, evidence, fix) in a
``Diagnosis``; ``KINDS`` lists every kind with one line. Under a process group it also
compares the ranks. ``Monitor`` checks cheap invariants of a real run every N steps.

This ``__init__`` is the package's whole public API. Behind it, rooms by concept: ``ground``
(running the user's step and putting everything back, watching it, the finding types), one
room per family of checks (``state``, ``update``, ``losses``, ``model``, ``numerics``,
``data``, ``performance``), ``ranks`` (the view across ranks) and ``monitor``; ``_examine``
runs the families. A new check goes in its family's room, beside the `Check` that names its
kinds.
"""

from isotrain.doctor._examine import KINDS, examine
from isotrain.doctor.ground.finding import Diagnosis, Finding
from isotrain.doctor.monitor import Monitor

__all__ = ["KINDS", "Diagnosis", "Finding", "Monitor", "examine"]
