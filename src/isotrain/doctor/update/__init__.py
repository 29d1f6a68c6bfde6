"""The update path: which parameters the optimizers hold and move (params), the gradient
optimizer.step() applies against a fresh one of the same samples (gradients), and the order
of zero_grad, backward, clipping, unscale_ and step (order, on the watched calls of path),
whether an actor's loss moves the critic through its advantage (advantage), the loss terms
whose gradient reaches nothing a step updates (terms, on reach), and the update each
parameter received against its optimizer's own rule, replayed (applied and rounding, on rule).

Kinds: `parameter_not_in_optimizer`, `frozen_parameter_in_optimizer`, `duplicate_parameter`,
`weight_decay_on_norm_or_bias`, `unused_parameter`, `params_unchanged`, `loss_term_unused`,
`stale_gradient`, `accumulation_scale`, `gradient_discarded`, `clip_misplaced`,
`advantage_not_detached`, `update_applied_twice`, `update_lost_to_rounding`.
"""

from isotrain.doctor.ground.kinds import Check
from isotrain.doctor.update.advantage import ADVANTAGE
from isotrain.doctor.update.applied import TWICE
from isotrain.doctor.update.gradients import ACCUMULATION_SCALE, STALE_GRADIENT
from isotrain.doctor.update.order import CLIPPING, DISCARDED
from isotrain.doctor.update.params import LEARNING, OPTIMIZER
from isotrain.doctor.update.rounding import ROUNDING
from isotrain.doctor.update.terms import TERMS

__all__ = ["CHECKS"]

CHECKS: tuple[Check, ...] = (
    OPTIMIZER,
    LEARNING,
    TERMS,
    STALE_GRADIENT,
    ACCUMULATION_SCALE,
    DISCARDED,
    CLIPPING,
    ADVANTAGE,
    TWICE,
    ROUNDING,
)
