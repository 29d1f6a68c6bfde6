"""What a step costs: host-device syncs (sync), what torch.compile would do with the model
and these batches (compile), and saved activation memory per block (memory).

Kinds: `host_sync`, `graph_break`, `recompile`, `memory`.
"""

from isotrain.doctor.ground.kinds import Check
from isotrain.doctor.performance.compile import GRAPH_BREAK, RECOMPILE
from isotrain.doctor.performance.memory import MEMORY
from isotrain.doctor.performance.sync import HOST_SYNC

__all__ = ["CHECKS"]

CHECKS: tuple[Check, ...] = (HOST_SYNC, GRAPH_BREAK, RECOMPILE, MEMORY)
