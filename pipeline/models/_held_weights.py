"""Weights held for inference (generators, the reference) in the run's dtype, derived constants left in float32."""

from __future__ import annotations

import torch

__all__ = ["hold_weights", "weights_dtype"]


def weights_dtype(run_dtype: str) -> torch.dtype:
    """The dtype generators and the reference hold, and updates carry, for the run's ``--dtype`` (the trainer keeps
    float32 and computes under autocast)."""
    return torch.bfloat16 if run_dtype == "bfloat16" else torch.float32


def hold_weights(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` on ``device`` with its weights in ``dtype``: parameters and saved buffers, nothing else.

    Buffers a model does not save (a rotary embedding's inverse frequencies)
    are derived constants it keeps in float32 whatever its weights' dtype, as
    ``from_pretrained(dtype=...)`` leaves them: in bfloat16 they would shift
    every position's angle, more the longer the sequence.
    """
    model = model.to(device)
    if dtype == torch.float32:
        return model
    saved = set(model.state_dict())
    for parameter in model.parameters():
        if parameter.is_floating_point():
            parameter.data = parameter.data.to(dtype)
    for module_name, module in model.named_modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            full = f"{module_name}.{name}" if module_name else name
            if buffer is not None and buffer.is_floating_point() and full in saved:
                setattr(module, name, buffer.to(dtype))
    return model
