"""The Monitor: cheap invariants of a real run, every N steps (invariants), and the text
of what it finds (text).

Kinds: `lost_update`, `nonfinite_grad`, `lr_off_schedule` (and `replica_divergence`).
"""

from isotrain.doctor.monitor.invariants import KINDS, Monitor

__all__ = ["KINDS", "Monitor"]
