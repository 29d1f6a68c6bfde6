"""The doctor: find the hidden side effects in anyone's training step, and say how to fix them.

``examine(model, optimizer, batches, step=...)`` runs the user's own step and validation on
copies and reports each problem as a ``Finding`` (kind, severity, where, evidence, fix) in a
``Diagnosis``; ``KINDS`` lists every kind with one line. Under a process group it also
compares the ranks. ``Monitor`` checks cheap invariants of a real run every N steps. This
``__init__`` is the package's whole public API; the ``_``-modules behind it are private.
"""

from isotrain.doctor._examine import examine
from isotrain.doctor._finding import KINDS, Diagnosis, Finding
from isotrain.doctor._monitor import Monitor

__all__ = ["KINDS", "Diagnosis", "Finding", "Monitor", "examine"]
