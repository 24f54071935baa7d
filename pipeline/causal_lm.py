"""Hugging Face causal language models: loading them, and their log-probabilities under left padding.

Every role that holds the policy (trainer, generators, reference model)
loads it with :func:`load_model` from the same name or folder, so the
architectures match and weights published by the trainer install anywhere.
Prompts of different lengths share a batch left-padded; positions are
counted from each row's first real token (:func:`positions`), so a prompt
gets the same logits alone or in a padded batch, in generation and in
training. ``transformers`` is imported only here and in the modules that
use it: the ``hf`` extra is optional.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .sampling import token_logps

__all__ = [
    "ModelError",
    "causal_logps",
    "check_model",
    "load_model",
    "load_tokenizer",
    "positions",
    "require_transformers",
]


class ModelError(ValueError):
    """A ``--model`` that is not a causal language model, or a tokenizer the run cannot use."""


def require_transformers() -> Any:
    """The ``transformers`` module, or a clear error naming the extra that installs it."""
    try:
        import transformers
    except ImportError:
        raise ModelError("Hugging Face models need transformers: pip install -e '.[hf]'") from None
    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # roles log their own
    return transformers


def _offline(name: str) -> dict[str, Any]:
    """Keyword arguments that keep a local folder from touching the network."""
    return {"local_files_only": True} if os.path.isdir(name) else {}


def check_model(name: str) -> Any:
    """``name``'s config, if it describes a causal language model (nothing else is loaded)."""
    transformers = require_transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(name, **_offline(name))
    except (OSError, ValueError) as exc:
        raise ModelError(f"--model {name}: not a preset, a model folder or a Hub name ({_first_line(exc)})") from None
    mapping = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if config.model_type not in mapping:
        raise ModelError(f"--model {name}: a {config.model_type!r} model is not a causal language model")
    return config


def load_model(name: str, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The causal LM ``name`` (a local folder or a Hub name) in float32 on ``device``, in training mode.

    Weights are kept in float32 on every role: the trainer trains them
    (``--dtype bfloat16`` is its autocast), and every role installs the
    trainer's float32 updates unchanged.
    """
    transformers = require_transformers()
    check_model(name)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, **_offline(name))
    except (OSError, ValueError) as exc:
        raise ModelError(f"--model {name}: its weights cannot be loaded ({_first_line(exc)})") from None
    return model.to(device).train()  # type: ignore[no-any-return]


def load_tokenizer(name: str) -> Any:
    """``name``'s tokenizer, padding on the left (generation appends on the right), with a pad token."""
    transformers = require_transformers()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(name, **_offline(name))
    except (OSError, ValueError, TypeError) as exc:
        raise ModelError(f"--model {name}: its tokenizer cannot be loaded ({_first_line(exc)})") from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ModelError(f"--model {name}: its tokenizer has neither a pad nor an end-of-sequence token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids counted from each row's first attended token (left padding gets position 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def causal_logps(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    prompt_mask: torch.Tensor,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities [N, T] of the completions in ``tokens`` and their entropies.

    ``tokens`` [N, P + T] holds left-padded prompts (``prompt_mask`` [N, P])
    followed by completions; one teacher-forced pass, the logits in float32
    and scaled by ``temperature`` as the sampler scaled them.
    """
    prompt_length = prompt_mask.shape[1]
    completion = tokens.shape[1] - prompt_length
    attention = torch.cat(
        [
            prompt_mask.to(tokens.dtype),
            torch.ones(tokens.shape[0], completion, dtype=tokens.dtype, device=tokens.device),
        ],
        dim=1,
    )
    inputs = tokens[:, :-1]
    out = model(input_ids=inputs, attention_mask=attention[:, :-1], position_ids=positions(attention[:, :-1]))
    return token_logps(out.logits[:, prompt_length - 1 :].float(), tokens[:, prompt_length:], temperature)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
