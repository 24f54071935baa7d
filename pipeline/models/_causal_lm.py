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

import inspect
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..algorithm import LOGITS_PER_CHUNK, chunked_token_logps

__all__ = [
    "CompletionLogps",
    "ModelError",
    "causal_logps",
    "check_model",
    "load_model",
    "load_tokenizer",
    "logits_to_keep_argument",
    "position_limit",
    "positions",
    "require_transformers",
]


_log = logging.getLogger(__name__)


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


def loading_kwargs(name: str, trust_remote_code: bool) -> dict[str, Any]:
    """``from_pretrained``'s keyword arguments: a local folder never touches the network; its own code runs if trusted."""
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if os.path.isdir(name):
        kwargs["local_files_only"] = True
    return kwargs


def _asks_for_trust(exc: BaseException) -> bool:
    """Whether transformers refused ``exc``'s model because its code would have to run (no ``trust_remote_code``)."""
    return "trust_remote_code" in str(exc)


def _untrusted(name: str) -> ModelError:
    return ModelError(
        f"--model {name}: the model brings code of its own (its config's auto_map), which runs only with "
        "--trust-remote-code; read that code first"
    )


def check_model(name: str, trust_remote_code: bool = False) -> Any:
    """``name``'s config, if it describes a causal language model (nothing else is loaded).

    A model with code of its own counts as causal when its ``auto_map`` names an ``AutoModelForCausalLM`` class.
    """
    transformers = require_transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(name, **loading_kwargs(name, trust_remote_code))
    except (OSError, ValueError) as exc:
        if _asks_for_trust(exc):
            raise _untrusted(name) from None
        raise ModelError(f"--model {name}: not a preset, a model folder or a Hub name ({first_line(exc)})") from None
    mapping = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    own_code = (getattr(config, "auto_map", None) or {}).get("AutoModelForCausalLM")
    if config.model_type not in mapping and not own_code:
        raise ModelError(f"--model {name}: a {config.model_type!r} model is not a causal language model")
    if own_code and trust_remote_code:
        _import_own_code(transformers, name, own_code)
    return config


#: Config attributes of rotary position encodings: positions past ``max_position_embeddings`` still compute.
_ROTARY = ("rope_parameters", "rope_scaling", "rope_theta", "rotary_dim", "rotary_pct", "partial_rotary_factor")


def position_limit(config: Any) -> int | None:
    """How many positions a model of ``config`` can take at all: its learned position table's rows
    (``max_position_embeddings``, GPT-2's ``n_positions``), past which the lookup fails (an ``IndexError``, a
    device-side assert on a GPU). None for rotary positions (Llama, Qwen), which run past the length they were
    trained on as transformers' ``generate`` lets them, and where the config does not say."""
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    if any(getattr(text, name, None) is not None for name in _ROTARY):
        return None
    for name in ("max_position_embeddings", "n_positions"):
        limit = getattr(text, name, None)
        if type(limit) is int and limit > 0:
            return limit
    return None


def _import_own_code(transformers: Any, name: str, reference: str) -> None:
    """Import the model's own class once: its code fails here, and transformers' module cache is filled before
    every role loads the model at once (it copies the code there with no lock between processes)."""
    try:
        transformers.dynamic_module_utils.get_class_from_dynamic_module(
            reference, name, local_files_only=os.path.isdir(name)
        )
    except Exception as exc:  # the model's own code: whatever it raises
        raise ModelError(f"--model {name}: its own code ({reference}) cannot be imported: {first_line(exc)}") from None


def load_model(name: str, device: torch.device | str = "cpu", trust_remote_code: bool = False) -> torch.nn.Module:
    """The causal LM ``name`` (a local folder or a Hub name) in float32 on ``device``, in training mode.

    The trainer keeps these float32 weights as its masters (``--dtype
    bfloat16`` is its autocast); generators and the reference cast their
    copy to the run's dtype and receive updates in it.
    """
    transformers = require_transformers()
    check_model(name, trust_remote_code)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            name, dtype=torch.float32, **loading_kwargs(name, trust_remote_code)
        )
    except (OSError, ValueError) as exc:
        if _asks_for_trust(exc):
            raise _untrusted(name) from None
        raise ModelError(f"--model {name}: its weights cannot be loaded ({first_line(exc)})") from None
    return model.to(device).train()  # type: ignore[no-any-return]


def load_tokenizer(name: str, trust_remote_code: bool = False) -> Any:
    """``name``'s tokenizer, padding on the left (generation appends on the right), with a pad token."""
    transformers = require_transformers()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(name, **loading_kwargs(name, trust_remote_code))
    except (OSError, ValueError, TypeError) as exc:
        if _asks_for_trust(exc):
            raise _untrusted(name) from None
        raise ModelError(f"--model {name}: its tokenizer cannot be loaded ({first_line(exc)})") from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ModelError(f"--model {name}: its tokenizer has neither a pad nor an end-of-sequence token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def logits_to_keep_argument(model: torch.nn.Module) -> str | None:
    """The name under which ``model``'s forward takes how many last positions to make logits for
    (``logits_to_keep``; ``num_logits_to_keep`` in older transformers), or None if it takes neither."""
    forward = inspect.signature(model.forward).parameters
    return next((name for name in ("logits_to_keep", "num_logits_to_keep") if name in forward), None)


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids counted from each row's first attended token (left padding gets position 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


class CompletionLogps(torch.nn.Module):
    """Per-token log-probabilities of completions under one causal LM, with memory that does not grow with the vocabulary.

    The model's body runs once over prompt + completion; only the hidden
    states at completion positions go through the output head, in chunks
    (:func:`pipeline.algorithm.chunked_token_logps`), so no tensor holds
    logits over the whole vocabulary for the whole batch. That needs the
    model split into body and head (``base_model`` and
    ``get_output_embeddings``, with the logit scaling and soft-capping some
    architectures add); the split is checked against the model's own logits
    on first use, and a model that does not split so is asked for logits at
    the completion positions only (``logits_to_keep``), then scored chunk by chunk.

    It is a module holding the model, so that a sharded trainer can make it
    the root of the shards: its forward is the one the loss runs.
    """

    def __init__(self, model: torch.nn.Module, budget: int = LOGITS_PER_CHUNK, *, compiled: bool = False) -> None:
        """``compiled`` (``--compile``): the head's chunks compiled by ``torch.compile``."""
        super().__init__()
        self.model = model
        self.budget = budget
        self.compiled = compiled
        self.split = _body_and_head(model)
        self._checked = self.split is None
        self._keep = logits_to_keep_argument(model)
        if self.split is None:
            self._say_fallback("its output head could not be taken apart from its body")

    if TYPE_CHECKING:  # Module.__call__ runs forward (and a sharded root's hooks); typed as forward is

        def __call__(
            self, tokens: torch.Tensor, prompt_mask: torch.Tensor, temperature: float = 1.0, entropy_grad: bool = False
        ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, tokens: torch.Tensor, prompt_mask: torch.Tensor, temperature: float = 1.0, entropy_grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probabilities [N, T] of the completions in ``tokens`` and their entropies.

        ``tokens`` [N, P + T] holds left-padded prompts (``prompt_mask`` [N, P])
        followed by completions; one teacher-forced pass, the logits in float32
        and scaled by ``temperature`` as the sampler scaled them. The entropies
        carry a gradient only with ``entropy_grad`` (a loss with an entropy bonus).
        """
        prompt_length = prompt_mask.shape[1]
        completion = tokens.shape[1] - prompt_length
        attention = torch.cat(
            [
                prompt_mask.to(tokens.dtype),
                torch.ones(tokens.shape[0], completion, dtype=tokens.dtype, device=tokens.device),
            ],
            dim=1,
        )[:, :-1]
        inputs: dict[str, Any] = {
            "input_ids": tokens[:, :-1],
            "attention_mask": attention,
            "position_ids": positions(attention),
            "use_cache": False,  # a teacher-forced pass: a KV cache would only hold memory
        }
        targets = tokens[:, prompt_length:]
        if not self._checked and self.split is not None:
            self._check_split(inputs)
        if self.split is not None:
            body, head, vocab = self.split
            hidden = body(**inputs).last_hidden_state[:, -completion:]
            logps, entropy = chunked_token_logps(
                hidden,
                head,
                targets,
                temperature,
                vocab,
                self.budget,
                entropy_grad=entropy_grad,
                compiled=self.compiled,
            )
            return _own(logps), _own(entropy)
        keep = {self._keep: completion} if self._keep is not None else {}
        logits = self.model(**inputs, **keep).logits[:, -completion:]
        logps, entropy = chunked_token_logps(
            logits,
            _identity,
            targets,
            temperature,
            logits.shape[-1],
            self.budget,
            entropy_grad=entropy_grad,
            compiled=self.compiled,
        )
        return _own(logps), _own(entropy)

    def _check_split(self, inputs: dict[str, Any]) -> None:
        """Use the body/head split only if it gives the model's own logits (on one row, no gradient).

        Both sides take the head over the last position alone (``logits_to_keep=1``)
        so a GPU runs the same kernels for both; the tolerance is the logits'
        precision (bfloat16 rounds at 2⁻⁸). A model whose head transforms its
        logits in a way the split does not know differs by far more; it is
        scored through its own forward instead, and a warning says so.
        """
        assert self.split is not None
        body, head, _ = self.split
        one = {name: value[:1] if isinstance(value, torch.Tensor) else value for name, value in inputs.items()}
        last = {self._keep: 1} if self._keep is not None else {}
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                expected = self.model(**one, **last).logits[:, -1]
                got = head(body(**one).last_hidden_state[:, -1])
        finally:
            self.model.train(was_training)
        tolerance = 1e-3 if expected.dtype == torch.float32 else 3e-2
        if got.shape != expected.shape or not torch.allclose(
            got.float(), expected.float(), rtol=tolerance, atol=tolerance
        ):
            self.split = None
            self._say_fallback("its output head could not be taken apart from its body (logits differ)")
        self._checked = True

    def _say_fallback(self, why: str) -> None:
        """Warn that log-probs come from the model's own forward, and what that forward's logits cost."""
        if self._keep is not None:
            how = "with logits at the completion positions only"
        else:  # [N, P + T, V] floats: at a real vocabulary, gigabytes for a modest batch
            how = "which takes no logits_to_keep: logits at every position, prompt included, over the whole vocabulary"
        _log.warning("%s: %s; log-probs are computed from its own forward, %s", type(self.model).__name__, why, how)

    @property
    def path(self) -> str:
        """How log-probs are computed: ``"head in chunks"``, ``"logits_to_keep"`` or, for a forward that takes
        no ``logits_to_keep``, ``"full logits"`` (known after the first call)."""
        if self.split is not None:
            return "head in chunks"
        return "logits_to_keep" if self._keep is not None else "full logits"


def causal_logps(
    model: torch.nn.Module, tokens: torch.Tensor, prompt_mask: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One-off :class:`CompletionLogps` of ``model`` (roles keep one per model: its split is checked once)."""
    return CompletionLogps(model)(tokens, prompt_mask, temperature)


def _own(values: torch.Tensor) -> torch.Tensor:
    """``values`` in storage of their own, not a view ([N, T] floats: a negligible copy).

    A sharded root's outputs carry FSDP's backward hook, which an in-place op
    on a view would drop (FSDP2 warns of every view a root returns).
    """
    return values.clone()


def _identity(logits: torch.Tensor) -> torch.Tensor:
    return logits


class Split(NamedTuple):
    """A causal LM taken apart: its body (hidden states out), its head as a function, the vocabulary it scores."""

    body: torch.nn.Module
    head: Callable[[torch.Tensor], torch.Tensor]
    vocab: int


def _body_and_head(model: torch.nn.Module) -> Split | None:
    """The model's body and output head (:class:`Split`), or None if it does not split so."""
    get_head = getattr(model, "get_output_embeddings", None)
    body = getattr(model, "base_model", None)
    linear = get_head() if callable(get_head) else None
    if not isinstance(linear, torch.nn.Module) or not isinstance(body, torch.nn.Module) or body is model:
        return None
    config = getattr(model, "config", None)
    # a plain Linear, or a layer wrapping one (PEFT's LoRA on the head: --lora-target-modules ...,lm_head), whose
    # output is still the logits; whether it really is, the first use checks against the model's own
    vocab = getattr(linear, "out_features", None)
    vocab = vocab if type(vocab) is int else getattr(config, "vocab_size", None)
    if type(vocab) is not int or vocab < 1:
        return None
    scale = getattr(config, "logit_scale", None)  # Cohere multiplies the logits
    divide = getattr(config, "logits_scaling", None)  # Granite divides them
    cap = getattr(config, "final_logit_softcapping", None)  # Gemma 2 soft-caps them

    def head(hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = linear(hidden)
        if isinstance(scale, (int, float)) and scale != 1:
            logits = logits * scale
        if isinstance(divide, (int, float)) and divide != 1:
            logits = logits / divide
        if isinstance(cap, (int, float)) and cap > 0:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return Split(body, head, vocab)


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (a library's error in one line), or its type's name if it has none."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
