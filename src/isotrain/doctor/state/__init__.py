"""State across steps: what the step or the evaluation leaves changed for the steps after
it: modes, grad mode, autocast, global flags and RNG (leaks), graphs kept alive (graph), the
learning-rate schedule over the run (schedule; a ReduceLROnPlateau stepped in the step:
plateau), EMA shadows (ema), the sampler's epoch (sampler), and a resume by the user's own
save/load against a run not interrupted (resume).

Kinds: `mode_leak`, `grad_mode_leak`, `autocast_leak`, `global_state_leak`,
`eval_in_train_mode`, `buffer_write_in_eval`, `rng_leak`, `graph_retained`, `lr_collapse`,
`ema_off_decay`, `ema_before_step`, `sampler_epoch`, `resume_mismatch`.
"""

from isotrain.doctor.ground.kinds import Check
from isotrain.doctor.state.ema import EMA
from isotrain.doctor.state.graph import GRAPH_RETAINED
from isotrain.doctor.state.leaks import LEAKS, RNG_LEAK
from isotrain.doctor.state.resume import RESUME
from isotrain.doctor.state.sampler import SAMPLER_EPOCH
from isotrain.doctor.state.schedule import LR_COLLAPSE

__all__ = ["CHECKS"]

CHECKS: tuple[Check, ...] = (
    LEAKS,
    RNG_LEAK,
    GRAPH_RETAINED,
    LR_COLLAPSE,
    EMA,
    SAMPLER_EPOCH,
    RESUME,
)
