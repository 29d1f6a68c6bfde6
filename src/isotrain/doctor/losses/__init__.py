"""The loss and its targets: what the loss function is given (targets), where the loss
starts and whether it can fall at all (fit).

Kinds: `labels_not_shifted`, `padding_in_loss`, `loss_broadcast`, `softmax_before_loss`,
`loss_at_init`, `cannot_overfit`.
"""

from isotrain.doctor.ground.kinds import Check
from isotrain.doctor.losses.fit import LOSS_AT_INIT, OVERFIT
from isotrain.doctor.losses.targets import (
    LABELS_NOT_SHIFTED,
    LOSS_BROADCAST,
    PADDING_IN_LOSS,
    SOFTMAX_BEFORE_LOSS,
)

__all__ = ["CHECKS"]

CHECKS: tuple[Check, ...] = (
    LABELS_NOT_SHIFTED,
    PADDING_IN_LOSS,
    LOSS_BROADCAST,
    SOFTMAX_BEFORE_LOSS,
    LOSS_AT_INIT,
    OVERFIT,
)
