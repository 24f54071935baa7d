"""An exported Hugging Face folder's dtype: the one a model's config records, its weights cast to it, and its
``config.json`` saying so (``save_pretrained`` records the dtype of the module it saves: the trainer's float32)."""

from __future__ import annotations

import json
from typing import Any

import torch

__all__ = ["cast_state", "record_dtype", "recorded_dtype"]


def recorded_dtype(config: Any) -> torch.dtype | None:
    """The dtype a model's config records (``dtype``, or ``torch_dtype`` as older ones name it), or None."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) else None


def cast_state(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``model``'s state with its floating-point tensors as ``dtype`` copies in host memory; tied tensors (an
    embedding and its head) stay one tensor, which the save writes once. The modules a transformers model keeps in
    float32 (``_keep_in_fp32_modules``, as its loader does) keep their tensors as they are."""
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    copies: dict[tuple[Any, ...], torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if not tensor.is_floating_point() or any(part in keep for part in name.split(".")):
            state[name] = tensor
            continue
        key = (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        copy = copies.get(key)
        if copy is None:
            copy = copies[key] = tensor.detach().to("cpu", dtype)
        state[name] = copy
    return state


def record_dtype(config_json: str, dtype: torch.dtype) -> None:
    """Say ``dtype`` in a staged folder's ``config.json`` (where readers look: ``dtype``, and ``torch_dtype`` if the
    file has that key too), before the folder is put in place whole (so the file is written as it is)."""
    with open(config_json) as f:
        config = json.load(f)
    _say_dtype(config, str(dtype).removeprefix("torch."))
    with open(config_json, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def _say_dtype(config: dict[str, Any], name: str) -> None:
    """Set ``config``'s dtype to ``name``, and that of each sub-config that records one (``text_config``, ...)."""
    config["dtype"] = name
    if "torch_dtype" in config:
        config["torch_dtype"] = name
    for value in config.values():
        if isinstance(value, dict) and ("dtype" in value or "torch_dtype" in value):
            _say_dtype(value, name)
