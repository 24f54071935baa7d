"""The settings a task cannot honour, refused before a run starts (the pipeline's and the one-process run's alike).

:func:`~pipeline.config.check_settings` checks what any run needs; these
checks need the task's class: the bandit has no sampler, only a Hugging
Face task has reward functions, a chat template or LoRA.
"""

from __future__ import annotations

from ..config import Config, SettingsError, setting_defaults
from ._bandit import BanditTask
from ._digit_task import DigitsTask
from ._hf import HFTask
from ._interface import Task
from ._registry import resolve, task_class

__all__ = ["HF_DATA", "SAMPLER", "check_task_settings", "found_task"]


#: The sampler's settings: (flag, Config attribute, the value that sets nothing).
SAMPLER: tuple[tuple[str, str, float], ...] = (
    ("--temperature", "temperature", 1.0),
    ("--top-p", "top_p", 1.0),
    ("--top-k", "top_k", 0),
    ("--min-p", "min_p", 0.0),
    ("--repetition-penalty", "repetition_penalty", 1.0),
)


def found_task(config: Config) -> type[Task] | None:
    """The class of the run's task, or None where it cannot be found (reported where the run builds it)."""
    try:
        return task_class(config.task)
    except (ImportError, AttributeError, ValueError, TypeError):
        return None


#: What the bandit has no use for: (flag, Config attribute). A rollout is one state's --group actions, each one
#: token whose entropy is its state's.
_NOT_FOR_THE_BANDIT: tuple[tuple[str, str], ...] = (
    ("--prompts", "prompts"),
    ("--max-new-tokens", "max_new_tokens"),
    ("--digits", "digits"),
    ("--top-entropy-quantile", "top_entropy_quantile"),
)


def _refuse_for_the_bandit(config: Config) -> None:
    """Refuse what the bandit would ignore, and trainer ranks its --group rows cannot all be given."""
    defaults = setting_defaults()
    given = [flag for flag, attr in _NOT_FOR_THE_BANDIT if getattr(config, attr) != defaults[attr]]
    if given:
        raise SettingsError(
            f"{', '.join(given)} with --task {config.task}: a bandit's rollout is one state's --group actions, each "
            "one token with its state's entropy; these settings would change nothing"
        )
    rows, ranks = config.group, config.trainer_ranks
    if ranks > 1 and rows < ranks * config.mini_batches:
        raise SettingsError(
            f"--trainer-ranks {ranks} with --mini-batches {config.mini_batches} and --task {config.task}: a "
            f"rollout has {rows} rows (--group), fewer than a row for each rank in each mini-batch"
        )


def check_task_settings(config: Config) -> None:
    """Refuse settings the run's task cannot honour: a KL-term flag without a KL term (given, or the task's
    default β 0), sampler flags for the bandit (no sampler), GDPO without reward functions (not an HF task)."""
    task = found_task(config)
    if task is None:
        return
    if issubclass(task, BanditTask):
        given = [flag for flag, attr, default in SAMPLER if getattr(config, attr) != default]
        if given:
            raise SettingsError(
                f"{', '.join(given)} with --task {config.task}: the bandit draws its actions from the policy's own "
                "softmax, with no sampler to set"
            )
        if config.mask_truncated:
            raise SettingsError(
                f"--mask-truncated with --task {config.task}: a bandit's completion is one action, never cut short"
            )
        _refuse_for_the_bandit(config)
    if not config.disable_dropout and not issubclass(task, HFTask):
        raise SettingsError(
            f"--no-disable-dropout keeps a Hugging Face policy's dropout (--task hf); --task {config.task}'s model is "
            "its own"
        )
    rows = config.group if issubclass(task, BanditTask) else config.prompts * config.group
    if issubclass(task, (BanditTask, HFTask, DigitsTask)) and rows % config.mini_batches:
        raise SettingsError(
            f"--mini-batches {config.mini_batches}: a rollout of {rows} completions does not split into "
            f"{config.mini_batches} equal parts"
        )
    if not issubclass(task, HFTask):
        _refuse_hf_settings(config)
    elif config.digits != setting_defaults()["digits"]:
        raise SettingsError(
            f"--digits {config.digits} sets the digit tasks' numbers; --task {config.task} takes its prompts from "
            "--dataset"
        )
    if config.multi_objective_aggregation == "normalize_then_sum" and not issubclass(task, HFTask):
        raise SettingsError(
            "--multi-objective-aggregation normalize_then_sum normalises each --reward function's rewards "
            f"(--task hf); --task {config.task} has one reward of its own"
        )
    for flag, on, what in (
        ("--sync-ref-model", config.sync_ref_model, "no reference model to sync"),
        ("--use-bias-correction-kl", config.use_bias_correction_kl, "no KL term to correct"),
    ):
        if not on:
            continue
        if config.kl_coeff == 0:
            raise SettingsError(f"{flag} with --kl-coeff 0: there is {what}")
        if config.kl_coeff is None and resolve(config).hyper("kl_coeff") == 0:
            raise SettingsError(
                f"{flag}: --task {config.task} has no KL term by default (β 0), so {what}; give --kl-coeff"
            )


#: The data, reward and export settings only a Hugging Face task reads: (flag, Config attribute).
HF_DATA: tuple[tuple[str, str], ...] = (
    ("--dataset-split", "dataset_split"),
    ("--dataset-config", "dataset_config"),
    ("--prompt-column", "prompt_column"),
    ("--eval-dataset", "eval_dataset"),
    ("--eval-split", "eval_split"),
    ("--eval-dataset-config", "eval_dataset_config"),
    ("--eval-fraction", "eval_fraction"),
    ("--reward", "rewards"),
    ("--reward-timeout", "reward_timeout"),
    ("--log-completions", "log_completions"),
    ("--export-dtype", "export_dtype"),
)


def _refuse_hf_settings(config: Config) -> None:
    """Settings only a Hugging Face task (``--task hf`` or a subclass of HFTask) has a use for."""
    if config.gradient_checkpointing:
        raise SettingsError(
            "--gradient-checkpointing recomputes a Hugging Face model's layers (--task hf, --dataset); the built-in "
            "tasks' models are small enough to keep their activations"
        )
    if config.engine != "builtin":
        raise SettingsError(
            f"--engine {config.engine} samples a Hugging Face model (--task hf, --dataset); the built-in tasks' "
            "models sample with the built-in sampler"
        )
    defaults = Config()
    given = [flag for flag, attr in HF_DATA if getattr(config, attr) != getattr(defaults, attr)]
    if given:
        raise SettingsError(
            f"{', '.join(given)} with --task {config.task}: only a Hugging Face task (--task hf, --dataset) reads "
            "prompts from a dataset, scores them with reward functions and exports model/"
        )
    if config.num_generations_eval:
        raise SettingsError(
            f"--num-generations-eval {config.num_generations_eval} samples a Hugging Face model's held-out "
            f"completions (--task hf, --dataset); --task {config.task} scores greedy answers"
        )
    if config.chat_template_kwargs:
        raise SettingsError(
            "--chat-template-kwargs sets a Hugging Face tokenizer's chat template variables (--task hf, --dataset); "
            f"--task {config.task} has no chat template"
        )
    if not config.shuffle_dataset:
        raise SettingsError(
            f"--no-shuffle-dataset keeps a dataset's order (--task hf, --dataset); --task {config.task} draws its "
            "prompts at random"
        )
    if config.lora_r:
        raise SettingsError(
            f"--lora-r {config.lora_r} adapts a Hugging Face model's linear layers (--task hf, --dataset); "
            f"--task {config.task}'s model trains whole"
        )
    if config.trust_remote_code:
        raise SettingsError(
            "--trust-remote-code lets a Hugging Face model's own code run (--task hf, --dataset); "
            f"--task {config.task}'s model has none"
        )
