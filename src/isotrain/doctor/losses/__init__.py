"""The loss and its targets: what the loss function is given (targets against the tokens the
model reads, padding), each loss against its input contract (logits, probabilities or
log-probabilities; the targets' range; the weights' shape and order), where the loss starts
and whether it can fall at all (fit).

Kinds: `labels_not_shifted`, `labels_shifted_twice`, `padding_in_loss`, `loss_broadcast`,
`softmax_before_loss`, `not_log_probabilities`, `target_out_of_range`, `loss_weight_shape`,
`loss_unread`, `class_weight_order`, `loss_at_init`, `cannot_overfit`.
"""

from isotrain.doctor.ground.kinds import Check
from isotrain.doctor.losses.alignment import LABELS_ALIGNED
from isotrain.doctor.losses.contract import LOSS_CONTRACT
from isotrain.doctor.losses.fit import LOSS_AT_INIT, OVERFIT
from isotrain.doctor.losses.padding import PADDING_IN_LOSS
from isotrain.doctor.losses.targets import LOSS_BROADCAST
from isotrain.doctor.losses.weights import CLASS_WEIGHTS

__all__ = ["CHECKS"]

CHECKS: tuple[Check, ...] = (
    LABELS_ALIGNED,
    PADDING_IN_LOSS,
    LOSS_BROADCAST,
    LOSS_CONTRACT,
    CLASS_WEIGHTS,
    LOSS_AT_INIT,
    OVERFIT,
)
