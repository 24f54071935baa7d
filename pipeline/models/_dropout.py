"""Dropout off in a model that trains with a ratio to another process's log-probabilities.

GRPO's ratio is the trainer's log-probability of a token over the one the
generator recorded when it drew it. Generators and the reference model run
in eval mode, without dropout; a trainer in training mode with dropout
active would score every token through a different random mask, so the
ratio is off 1 by noise even at lag 0, the clip acts on that noise, and
the KL to the reference is biased (TRL's ``disable_dropout``). A Hugging
Face model drops out through ``nn.Dropout`` modules (GPT-2's ``attn_pdrop``,
``resid_pdrop``) or a rate a module keeps as a float and passes on (Qwen2's
and Llama's ``attention_dropout``); it may also skip layers (``layerdrop``)
or jitter its router (``jitter_noise``) in training mode. Each is set to 0
here, on the modules: the model's config is left alone, so an exported
model keeps its own rates for whoever trains it next (a model that reads a
rate from its config in the forward keeps it; transformers' causal LMs
default every such rate to 0).
"""

from __future__ import annotations

import torch

__all__ = ["disable_dropout"]

#: What a module's float attribute is named when it is a rate of randomness in training mode.
_RANDOM_IN_TRAINING = ("dropout", "layerdrop", "jitter")
#: torch's dropout modules (each holds its probability as ``p``).
_DROPOUTS = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout probability in ``model`` to 0, in place; how many were above 0."""
    changed = 0
    for module in model.modules():
        if isinstance(module, _DROPOUTS):
            changed += module.p > 0
            module.p = 0.0
            continue
        for name, value in list(vars(module).items()):
            if isinstance(value, float) and any(word in name for word in _RANDOM_IN_TRAINING):
                changed += value > 0
                setattr(module, name, 0.0)
    return changed
