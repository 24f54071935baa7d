"""GRPO's mathematics on tensors, at the bottom of the pipeline.

Group advantages, the clipped token loss and its variants (``grpo``,
``dr_grpo``, ``dapo``, ``cispo``, ``sapo``, ``luspo``, ``vespo``, GSPO's sequence ratio, the dual clip, the
off-policy mask, the k3 KL, truncated importance weights), the entropy bonus's coefficient, one sampling step, and the
log-probabilities of chosen tokens
computed chunk by chunk so memory does not grow with the vocabulary.
Imports torch alone: no actors, no models, no configuration.
"""

from ._entropy_control import EntropyControl
from ._logit_head import LOGITS_PER_CHUNK, chunk_positions, chunked_token_logps
from ._loss import (
    CISPO_CAP,
    IS_MODES,
    LOSSES,
    RATIO_LEVELS,
    REWARD_SCALES,
    IsMode,
    LossKind,
    LossSpec,
    RatioLevel,
    RewardScale,
    TokenLoss,
    group_advantages,
    group_spread,
    high_entropy_tokens,
    nan_moments,
    token_grpo_loss,
    token_weights,
)
from ._sampling import RepeatPenalty, draw, filter_logits, token_logps

__all__ = [
    "CISPO_CAP",
    "IS_MODES",
    "LOGITS_PER_CHUNK",
    "LOSSES",
    "RATIO_LEVELS",
    "REWARD_SCALES",
    "EntropyControl",
    "IsMode",
    "LossKind",
    "LossSpec",
    "RatioLevel",
    "RepeatPenalty",
    "RewardScale",
    "TokenLoss",
    "chunk_positions",
    "chunked_token_logps",
    "draw",
    "filter_logits",
    "group_advantages",
    "group_spread",
    "high_entropy_tokens",
    "nan_moments",
    "token_grpo_loss",
    "token_logps",
    "token_weights",
]
