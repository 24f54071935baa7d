"""A reward model: a sequence classifier with one output, called as a reward function in TRL's signature.

TRL's ``reward_funcs`` may name a model; so may ``--reward``: a folder or
Hub name that is not ``module:function``. The model's one logit for
prompt + completion is the reward. Chat prompts are rendered with the
reward model's own chat template, the completion as the assistant's turn;
text prompts are joined to their completion. Rows are padded on the right in
batches, so a completion's reward never depends on the batch it came in.
The checkpoint is checked when it is named (a classifier with one label,
its tokenizer); its weights load on the device of the process that scores
(the scorer's, or the trainer's for held-out rewards), by :meth:`RewardModel.load`,
which the reward set runs untimed before its first timed call (a first call
loads them too, if nothing did).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ._causal_lm import ModelError, first_line, loading_kwargs, require_transformers

__all__ = ["RewardModel"]

#: Completions scored in one forward pass.
BATCH = 32


class RewardModel:
    """``name``'s sequence classifier as a reward function: ``model(prompts, completions) -> list[float]``."""

    def __init__(
        self,
        name: str,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        trust_remote_code: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        transformers = require_transformers()
        self.source = name
        #: The chat template's variables (``--chat-template-kwargs``), as TRL renders a reward model's input.
        self.template_kwargs = dict(chat_template_kwargs or {})
        self.__name__ = name.rstrip("/").rpartition("/")[2]  # reward/<name> in the metrics, as TRL names it
        self.device = torch.device(device)
        self.dtype = dtype
        self._trust = trust_remote_code
        try:
            config = transformers.AutoConfig.from_pretrained(name, **loading_kwargs(name, trust_remote_code))
        except (OSError, ValueError) as exc:
            raise ModelError(
                f"--reward {name}: not a function, nor a reward model's folder or Hub name ({first_line(exc)})"
            ) from None
        architectures = list(getattr(config, "architectures", None) or [])
        if not any(a.endswith("ForSequenceClassification") for a in architectures):
            raise ModelError(
                f"--reward {name}: not a reward model (a sequence classifier with one label); its architectures: "
                f"{', '.join(architectures) or 'none given'}"
            )
        if config.num_labels != 1:
            raise ModelError(
                f"--reward {name}: a reward model has one output, its reward; this one has {config.num_labels}"
            )
        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(name, **loading_kwargs(name, trust_remote_code))
        except (OSError, ValueError, TypeError) as exc:
            raise ModelError(f"--reward {name}: its tokenizer cannot be loaded ({first_line(exc)})") from None
        self.tokenizer.padding_side = "right"
        if self.tokenizer.pad_token_id is None:
            if self.tokenizer.eos_token_id is None:
                raise ModelError(f"--reward {name}: its tokenizer has neither a pad nor an end-of-sequence token")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self._model: Any = None
        self._loading = threading.Lock()

    def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        """Each completion's reward: the model's logit for its prompt and it, together."""
        texts = [self._text(prompt, completion) for prompt, completion in zip(prompts, completions, strict=True)]
        model = self.load()
        rewards: list[float] = []
        with torch.no_grad():
            for start in range(0, len(texts), BATCH):
                encoded = self.tokenizer(
                    texts[start : start + BATCH], return_tensors="pt", padding=True, add_special_tokens=False
                ).to(self.device)
                # (no KV cache: a decoder's config asks for one, which would be built for the batch and dropped)
                rewards += model(**encoded, use_cache=False).logits[:, 0].float().cpu().tolist()
        return rewards

    def check_chat(self) -> None:
        """Refuse chat prompts if this model's tokenizer cannot render them (no chat template, or one that fails
        with the run's template variables)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ModelError(
                f"--reward {self.source}: the prompts are chat messages, but its tokenizer has no chat template"
            )
        probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]
        try:
            self.tokenizer.apply_chat_template(probe, tokenize=False, **self.template_kwargs)
        except Exception as exc:
            raise ModelError(
                f"--reward {self.source}: its chat template cannot render a conversation with the run's "
                f"--chat-template-kwargs {self.template_kwargs}: {first_line(exc)}"
            ) from None

    def _text(self, prompt: Any, completion: Any) -> str:
        if isinstance(prompt, list):  # chat messages; the completion is the assistant's turn
            self.check_chat()
            turn = completion if isinstance(completion, list) else [{"role": "assistant", "content": str(completion)}]
            return str(self.tokenizer.apply_chat_template(prompt + turn, tokenize=False, **self.template_kwargs))
        return str(prompt) + (completion if isinstance(completion, str) else str(completion[-1]["content"]))

    def load(self) -> Any:
        """The model, its weights loaded onto its device the first time (once, whichever threads ask)."""
        with self._loading:
            if self._model is None:
                transformers = require_transformers()
                try:
                    model = transformers.AutoModelForSequenceClassification.from_pretrained(
                        self.source, dtype=self.dtype, **loading_kwargs(self.source, self._trust)
                    )
                except Exception as exc:
                    raise ModelError(
                        f"--reward {self.source}: its weights cannot be loaded ({type(exc).__name__}: "
                        f"{first_line(exc)})"
                    ) from exc
                model.config.pad_token_id = self.tokenizer.pad_token_id  # where each row's last real token is
                self._model = model.to(self.device).eval()
            return self._model
