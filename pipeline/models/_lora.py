"""LoRA adapters on the trained policy (``--lora-r``), with PEFT: what trains, what generators get, what is saved.

Only the trainer holds adapters: its policy's linear layers gain low-rank
pairs (A, B; B starts at 0, so the adapted policy starts as the base one)
and only those train. Generators and the reference model keep the plain
model: they receive the *merged* weights, W + (alpha / r) B A, under the
plain model's names, computed afresh from the frozen base at every
publish (never merged into it in place, so rounding never accumulates).
The export is the merged model, which transformers and vLLM load as any
other, and the adapter on its own in PEFT's format.
"""

from __future__ import annotations

from typing import Any

import torch

from ._causal_lm import ModelError, first_line, loading_kwargs, require_transformers
from ._saved_folder import replace_folder, staging_folder

__all__ = ["LoraAdapter", "check_lora_targets", "require_peft"]

#: PEFT's own name for every linear layer but the output head.
ALL_LINEAR = "all-linear"


def require_peft() -> Any:
    """The ``peft`` module, or a clear error naming the extra that installs it."""
    try:
        import peft
    except ImportError:
        raise ModelError("--lora-r trains LoRA adapters with peft: pip install -e '.[hf]'") from None
    return peft


def _targets(spec: str) -> str | list[str]:
    return spec if spec == ALL_LINEAR else [name.strip() for name in spec.split(",") if name.strip()]


def _lora_config(peft: Any, rank: int, alpha: float, targets: str) -> Any:
    """PEFT's settings (the adapter's base model is named by PEFT from the model's own ``name_or_path``)."""
    return peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=_targets(targets),
        lora_dropout=0.0,  # dropout would make the trainer's log-probs differ from the generators' (as --disable-dropout)
        task_type="CAUSAL_LM",
    )


def _refuse_unmatched(model: torch.nn.Module, targets: str) -> None:
    """Each layer name in ``targets`` must name some layer of ``model`` (PEFT skips a misspelt one if another
    matches): as PEFT matches them, a module's dotted name equal to it or ending in ``.<it>``."""
    wanted = _targets(targets)
    if wanted == ALL_LINEAR:
        return
    names = [name for name, _ in model.named_modules()]
    missing = [key for key in wanted if not any(n == key or n.endswith(f".{key}") for n in names)]
    if missing:
        raise ModelError(
            f"--lora-target-modules {targets}: {', '.join(missing)} names no layer of the model (its linear layers' "
            f"names: {', '.join(sorted(_linear_names(model)))})"
        )


def _refuse_tied(model: torch.nn.Module, targets: str) -> None:
    """No target may be the output head or the input embeddings when the two are tied: the generators' model holds
    one matrix for both, so one's merged W + BA and the other's W could not both reach it (the one loaded last would
    overwrite the other, and the generators would sample from a policy the trainer never had). PEFT's
    ``all-linear`` leaves both out."""
    wanted = _targets(targets)
    if wanted == ALL_LINEAR:
        return
    tied = _tied_pair(model)
    if tied is None:
        return
    for name, role, other in (
        (tied[0], "output head", "input embeddings"),
        (tied[1], "input embeddings", "output head"),
    ):
        named = [key for key in wanted if name == key or name.endswith(f".{key}")]
        if named:
            raise ModelError(
                f"--lora-target-modules {targets}: {name} is the model's {role}, tied to its {other} "
                f"(tie_word_embeddings): an adapter on it would give it weights the {other} no longer share, "
                f"which the generators' tied model cannot hold; drop {', '.join(named)} from the targets, or untie "
                "the embeddings (tie_word_embeddings false in the model's config.json)"
            )


def _tied_pair(model: torch.nn.Module) -> tuple[str, str] | None:
    """The dotted names of ``model``'s output head and input embeddings if they hold one parameter, else None."""
    output = getattr(model, "get_output_embeddings", None)
    inputs = getattr(model, "get_input_embeddings", None)
    if output is None or inputs is None:
        return None
    head, embeddings = output(), inputs()
    if head is None or embeddings is None or getattr(head, "weight", None) is not embeddings.weight:
        return None
    names = {id(module): name for name, module in model.named_modules()}
    if id(head) not in names or id(embeddings) not in names:
        return None
    return names[id(head)], names[id(embeddings)]


def _linear_names(model: torch.nn.Module) -> set[str]:
    return {name.rpartition(".")[2] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def check_lora_targets(name: str, targets: str, trust_remote_code: bool = False) -> None:
    """Refuse ``--lora-target-modules`` that name no layer of ``name``, or its output head or input embeddings where
    the two are tied (built on the meta device: no weights load)."""
    transformers = require_transformers()
    require_peft()
    config = transformers.AutoConfig.from_pretrained(name, **loading_kwargs(name, trust_remote_code))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    _refuse_unmatched(model, targets)
    _refuse_tied(model, targets)


class LoraAdapter:
    """LoRA pairs injected into ``model`` in place (it keeps its class, body and head); only they train."""

    def __init__(self, model: torch.nn.Module, rank: int, alpha: float, targets: str) -> None:
        peft = require_peft()
        _refuse_unmatched(model, targets)
        _refuse_tied(model, targets)
        try:
            self._peft = peft.get_peft_model(model, _lora_config(peft, rank, alpha, targets))
        except ValueError as exc:
            raise ModelError(f"--lora-target-modules {targets}: {first_line(exc)}") from None
        self.model = model
        self._layers = {
            name: module for name, module in model.named_modules() if isinstance(module, peft.tuners.lora.LoraLayer)
        }

    def merged_state(self) -> dict[str, torch.Tensor]:
        """The plain model's state (its names, every tensor) with each adapted weight merged: W + (alpha / r) B A."""
        with torch.no_grad():
            deltas = {f"{name}.weight": layer.get_delta_weight("default") for name, layer in self._layers.items()}
            merged = {}
            for name, tensor in self.model.state_dict().items():
                if ".lora_" in name:
                    continue
                plain = name.replace(".base_layer.", ".")
                delta = deltas.get(plain)
                merged[plain] = tensor if delta is None else tensor + delta.to(tensor.dtype)
        return merged

    def save(self, folder: str) -> str:
        """The adapter alone in PEFT's format (``PeftModel.from_pretrained(base, folder)``), replaced whole."""
        staging = staging_folder(folder)
        self._peft.save_pretrained(staging)
        return replace_folder(staging, folder)
