"""Which settings a run refuses, and why: checked before any process starts.

A setting that cannot train (one sample per prompt, greedy sampling) or
cannot run (no prompts, a negative bound) is refused with one line naming
the flag and the reason, never a traceback, a hang or a run that learns
nothing in silence. Device and transport placement is checked apart, in
:mod:`pipeline.run`; what a task itself refuses (a digit count whose
prompts cannot fill a training and a held-out set), when it is built.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import get_args

from ..algorithm import LOSSES, RATIO_LEVELS, REWARD_SCALES
from ._config import DECODE_PATHS, ENGINES, REPORT_TO, Aggregation, Config, IsCorrection

__all__ = ["SettingsError", "check_settings", "forget_unused_settings", "setting_defaults", "unused_settings"]


class SettingsError(ValueError):
    """A setting the run cannot train with; the message names the flag."""


def _at_least(config: Config, name: str, low: float, why: str = "") -> None:
    value = getattr(config, name)
    if value is not None and value < low:
        raise SettingsError(f"--{name.replace('_', '-')} {value}: must be at least {low}{why}")


def _one_of(config: Config, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(config, name)
    if value is not None and value not in choices:
        raise SettingsError(f"--{name.replace('_', '-')} {value}: choose one of {', '.join(choices)}")


def _check_run_shape(config: Config) -> None:
    """Bounds of the run's checkpoints and schedule (before, each was taken and did nothing sensible)."""
    if config.checkpoint_every < 0:  # (its flag is --save-every: not _at_least's name)
        raise SettingsError(f"--save-every {config.checkpoint_every}: must be at least 0 (0: only at the end)")
    if config.warmup_steps > config.steps:
        raise SettingsError(
            f"--warmup-steps {config.warmup_steps} with --steps {config.steps}: the learning rate would never "
            "reach --lr"
        )


def check_settings(config: Config) -> None:
    """Raise :class:`SettingsError` for the first setting of ``config`` that a run cannot train with."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, float) and not math.isfinite(value):  # (NaN passes every ``value < low``)
            raise SettingsError(f"--{field.name.replace('_', '-')} {value}: must be a finite number")
    if config.group < 2:
        raise SettingsError(
            f"--group {config.group}: GRPO needs at least 2 samples per prompt (each sample's advantage is its "
            "reward against the others of its group; alone, every advantage is 0 and nothing is learned)"
        )
    if not config.temperature > 0:
        raise SettingsError(
            f"--temperature {config.temperature}: training samples at a temperature above 0 (at 0 every sample "
            "of a group is the same greedy completion, so every advantage is 0); evaluation is greedy already"
        )
    if not 0 < config.top_p <= 1:
        raise SettingsError(f"--top-p {config.top_p}: the nucleus mass must be in (0, 1]")
    for name in (
        "prompts",
        "steps",
        "eval_size",
        "eval_every",
        "generators",
        "max_inflight",
        "threads",
        "trainer_ranks",
    ):
        _at_least(config, name, 1)
    for name in (
        "max_new_tokens",
        "max_staleness",
        "micro_batch",
        "max_tokens_per_pass",
        "warmup_steps",
        "generator_restarts",
        "top_k",
        "log_completions",
        "num_generations_eval",
        "lora_r",
        "ray_hosts",
    ):
        _at_least(config, name, 0)
    _check_lora(config)
    _at_least(config, "kl_coeff", 0)
    _at_least(config, "max_grad_norm", 0, " (0 turns clipping off)")
    if config.lr is not None and not config.lr > 0:
        raise SettingsError(f"--lr {config.lr}: the learning rate must be above 0")
    if config.clip is not None and not 0 < config.clip < 1:
        raise SettingsError(f"--clip {config.clip}: the ratio clip must be in (0, 1)")
    if config.epsilon_high is not None and not config.epsilon_high > 0:
        raise SettingsError(f"--epsilon-high {config.epsilon_high}: the clip's upper bound must be above 0")
    if config.dual_clip != 0 and not config.dual_clip > 1:
        raise SettingsError(f"--dual-clip {config.dual_clip}: the dual clip C must be above 1 (or 0: off)")
    if not config.reward_timeout > 0:
        raise SettingsError(f"--reward-timeout {config.reward_timeout}: a reward function needs some time (above 0)")
    if not 0 <= config.stop_grace < math.inf:
        raise SettingsError(
            f"--stop-grace {config.stop_grace}: a number of seconds, at least 0 (0: no final checkpoint)"
        )
    if not 0 < config.collective_timeout < math.inf:
        raise SettingsError(f"--collective-timeout {config.collective_timeout}: a number of seconds above 0")
    if not 0 < config.weights_timeout < math.inf:
        raise SettingsError(f"--weights-timeout {config.weights_timeout}: a number of seconds above 0")
    if not 0 < config.eval_fraction < 1:
        raise SettingsError(f"--eval-fraction {config.eval_fraction}: the held-out share must be in (0, 1)")
    _check_run_shape(config)
    _one_of(config, "loss", LOSSES)
    _one_of(config, "scale_rewards", REWARD_SCALES)
    _one_of(config, "lr_schedule", ("constant", "cosine"))
    _one_of(config, "trainer_shard", ("ddp", "fsdp"))
    _one_of(config, "dtype", ("float32", "bfloat16"))
    _one_of(config, "mode", ("async", "sync"))
    _one_of(config, "report_to", REPORT_TO)
    _one_of(config, "engine", ENGINES)
    _one_of(config, "decode", DECODE_PATHS)
    if config.decode != "auto" and config.engine != "builtin":
        raise SettingsError(
            f"--decode {config.decode} picks how the built-in sampler decodes; --engine {config.engine} decodes its "
            "own way"
        )
    _one_of(config, "is_correction", get_args(IsCorrection))
    _one_of(config, "importance_sampling_level", RATIO_LEVELS)
    _at_least(config, "num_iterations", 1)
    _at_least(config, "mini_batches", 1)
    if not 0 < config.top_entropy_quantile <= 1:
        raise SettingsError(
            f"--top-entropy-quantile {config.top_entropy_quantile}: the share of tokens trained must be in (0, 1]"
        )
    if config.sync_ref_model:
        _at_least(config, "ref_model_sync_steps", 1)
        if not 0 < config.ref_model_mixup_alpha <= 1:
            raise SettingsError(
                f"--ref-model-mixup-alpha {config.ref_model_mixup_alpha}: the policy's share of a synced reference "
                "must be in (0, 1]"
            )
        if config.sharded_trainer:
            raise SettingsError(
                f"--sync-ref-model with --trainer-ranks {config.trainer_ranks} --trainer-shard fsdp: the policy is "
                "sharded and the reference is not; use --trainer-shard ddp"
            )
    if config.loss == "cispo" and config.epsilon_high is not None and config.epsilon_high < 1:
        raise SettingsError(
            f"--loss cispo --epsilon-high {config.epsilon_high}: cispo caps the ratio itself at --epsilon-high (not "
            "at 1 + it), so a cap below 1 would weigh every on-policy token below 1; ScaleRL uses 5 (the default)"
        )
    _one_of(config, "multi_objective_aggregation", get_args(Aggregation))
    if config.multi_objective_aggregation == "normalize_then_sum":
        if config.scale_rewards not in (None, "batch"):
            raise SettingsError(
                f"--multi-objective-aggregation normalize_then_sum with --scale-rewards {config.scale_rewards}: "
                "GDPO normalises each function within its group, then the sum over the batch (--scale-rewards batch)"
            )
    if not config.repetition_penalty > 0:
        raise SettingsError(
            f"--repetition-penalty {config.repetition_penalty}: it divides or multiplies logits, so above 0 (1: off)"
        )
    if not 0 <= config.min_p < 1:
        raise SettingsError(f"--min-p {config.min_p}: a share of the likeliest token's probability, in [0, 1)")
    if config.loss == "luspo" and config.importance_sampling_level != "sequence":
        raise SettingsError(
            "--loss luspo weighs GSPO's sequence ratio by each completion's length: add --importance-sampling-level "
            "sequence"
        )
    if config.importance_sampling_level == "sequence" and config.loss in ("dapo", "dr_grpo", "cispo"):
        warnings.warn(  # (TRL warns too: a legitimate objective, but not GSPO's)
            f"--importance-sampling-level sequence with --loss {config.loss}: this loss sums its tokens' terms, so "
            "each completion's shared ratio weighs it by its length; GSPO averages within each completion first "
            "(--loss grpo)",
            UserWarning,
            stacklevel=2,
        )
    if config.loss == "vespo" and config.importance_sampling_level != "token":
        raise SettingsError(
            "--loss vespo --importance-sampling-level sequence: vespo takes each completion's ratio from its tokens' "
            "log-ratios itself; leave the level at token"
        )
    for name in ("vespo_k_pos", "vespo_k_neg"):
        if not getattr(config, name) >= 0:
            flag = "--" + name.replace("_", "-")
            raise SettingsError(f"{flag} {getattr(config, name)}: the weight's power of the ratio must be at least 0")
    for name in ("vespo_lambda_pos", "vespo_lambda_neg"):
        if not getattr(config, name) > 0:
            flag = "--" + name.replace("_", "-")
            raise SettingsError(f"{flag} {getattr(config, name)}: the weight's decay must be above 0")
    for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
        if not getattr(config, name) > 0:
            flag = "--" + name.replace("_", "-")
            raise SettingsError(f"{flag} {getattr(config, name)}: the gate's temperature must be above 0")
    _check_entropy_bonus(config)
    for names, why in unused_settings(config):
        _refuse_without_switch(config, names, why)
    if config.off_policy_mask_threshold is not None and not config.off_policy_mask_threshold >= 0:
        raise SettingsError(
            f"--off-policy-mask-threshold {config.off_policy_mask_threshold}: a completion's mean drift from the "
            "behaviour log-probs is compared with it, so it must be at least 0"
        )
    if config.top_entropy_quantile < 1 and config.trainer_ranks > 1:
        raise SettingsError(
            f"--top-entropy-quantile {config.top_entropy_quantile} with --trainer-ranks {config.trainer_ranks}: each "
            "rank would rank only its own rows' entropies, so the ranks' step would not be one trainer's; "
            "train with one rank"
        )
    if config.mini_batches > 1 and config.is_correction != "none":
        raise SettingsError(
            f"--mini-batches {config.mini_batches} with --is-correction {config.is_correction}: importance weights "
            "take each step's ratio to the trainer's own log-probs just before it, so the parts after the first "
            "would train on a moved policy with no clip to bound them; use --is-correction none (the ratio is then "
            "to the behaviour log-probs, and the clip bounds every part)"
        )
    if config.num_iterations > 1 and config.is_correction != "none":
        raise SettingsError(
            f"--num-iterations {config.num_iterations} with --is-correction {config.is_correction}: importance "
            "weights take each update's ratio to the trainer's own log-probs just before it, so the later "
            "iterations' ratios are 1 and no clip bounds them; use --is-correction none (the ratio is then to the "
            "behaviour log-probs in every iteration)"
        )
    _one_of(config, "vllm_dtype", ("auto", "float32", "bfloat16", "float16"))
    _one_of(config, "export_dtype", ("auto", "float32", "bfloat16", "float16"))
    if not config.is_cap >= 1:
        raise SettingsError(f"--is-cap {config.is_cap}: an importance weight's upper bound must be at least 1")
    if not 0 <= config.is_min < 1:
        raise SettingsError(f"--is-min {config.is_min}: an importance weight's lower bound must be in [0, 1)")
    if not 0 < config.vllm_gpu_memory <= 1:
        raise SettingsError(f"--vllm-gpu-memory {config.vllm_gpu_memory}: a share of the GPU's memory, in (0, 1]")
    _at_least(config, "vllm_max_model_len", 0)
    generator_device = config.device_of("generator")
    if config.engine == "vllm" and generator_device.startswith("cuda:") and generator_device != "cuda:0":
        raise SettingsError(
            f"--engine vllm with generators on {generator_device}: vLLM runs on the first GPU its process sees; "
            "choose the GPUs with CUDA_VISIBLE_DEVICES and place the generators on cuda"
        )
    _check_vllm_log_probs(config)
    _check_trainer_ranks(config)
    _check_chat_template_kwargs(config)


def _check_vllm_log_probs(config: Config) -> None:
    """vLLM with both a temperature and a filter gives only the filtered distribution's log-probs: not the
    trainer's, so they must not anchor the clip (their ratio at lag 0 is the kept mass, at most 1)."""
    filtered = config.top_k > 0 or config.top_p < 1 or config.min_p > 0 or config.repetition_penalty != 1
    if config.engine != "vllm" or config.temperature == 1 or not filtered:
        return
    settings = f"--engine vllm with --temperature {config.temperature:g} and a sampler filter or penalty"
    if config.loss == "vespo" or config.off_policy_mask_threshold is not None:
        used = "--loss vespo" if config.loss == "vespo" else "--off-policy-mask-threshold"
        raise SettingsError(
            f"{settings}: vLLM gives the filtered distribution's log-probs only, and {used} measures the policy's "
            "distance from them, which the filter alone makes large; use --temperature 1 or no filter"
        )
    if config.is_correction == "none":
        raise SettingsError(
            f"{settings}: vLLM gives the filtered distribution's log-probs only (not the trainer's), so they cannot "
            "anchor the clip (the kept mass, below 1, would clip away negative advantages); add --is-correction "
            "tis (the ratio is then to the trainer's own log-probs, and the weight corrects for the sampler), or use "
            "--temperature 1 or no filter"
        )


#: The adaptive entropy control's settings: without --use-adaptive-entropy they would do nothing.
_ADAPTIVE = ("entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target")


def _check_entropy_bonus(config: Config) -> None:
    """The entropy bonus: a finite coefficient; adaptive bounds in order, a step above 0, a target at least 0."""
    for name in ("entropy_coef", *_ADAPTIVE):
        if not math.isfinite(getattr(config, name)):
            raise SettingsError(f"--{name.replace('_', '-')} {getattr(config, name)}: must be a finite number")
    if not config.use_adaptive_entropy:
        _refuse_without_switch(config, _ADAPTIVE, "set the adaptive entropy control: add --use-adaptive-entropy")
        return
    if not config.entropy_coef_min <= config.entropy_coef_max:
        raise SettingsError(
            f"--entropy-coef-min {config.entropy_coef_min} above --entropy-coef-max {config.entropy_coef_max}"
        )
    if not config.entropy_coef_min <= config.entropy_coef <= config.entropy_coef_max:
        raise SettingsError(
            f"--entropy-coef {config.entropy_coef} with --use-adaptive-entropy: the coefficient starts there, so "
            f"within [--entropy-coef-min, --entropy-coef-max] = [{config.entropy_coef_min}, {config.entropy_coef_max}]"
        )
    if not config.entropy_coef_delta > 0:
        raise SettingsError(f"--entropy-coef-delta {config.entropy_coef_delta}: the coefficient's step must be above 0")
    if not config.entropy_target >= 0:
        raise SettingsError(f"--entropy-target {config.entropy_target}: an entropy is at least 0")


#: ``apply_chat_template``'s own arguments, which the pipeline sets: a prompt renders as a generation prompt, to ids.
_TEMPLATE_ARGUMENTS = (
    "add_generation_prompt",
    "continue_final_message",
    "conversation",
    "return_assistant_tokens_mask",
    "return_dict",
    "return_tensors",
    "tokenize",
)


def _check_chat_template_kwargs(config: Config) -> None:
    """The chat template's variables: an object with text keys, none of them an argument the pipeline sets."""
    variables = config.chat_template_kwargs
    if not isinstance(variables, dict) or not all(isinstance(key, str) for key in variables):
        raise SettingsError(
            f"--chat-template-kwargs {variables!r}: a JSON object of the template's variables, such as "
            "'{\"enable_thinking\": false}'"
        )
    taken = sorted(key for key in variables if key in _TEMPLATE_ARGUMENTS)
    if taken:
        raise SettingsError(
            f"--chat-template-kwargs {', '.join(taken)}: the pipeline sets these itself (each prompt is rendered "
            "as a generation prompt, to token ids)"
        )


def unused_settings(config: Config) -> list[tuple[tuple[str, ...], str]]:
    """The settings that only a switch ``config`` leaves off would use, by group, with the switch to add."""
    groups: list[tuple[tuple[str, ...], str]] = []
    if config.is_correction == "none":
        groups.append((("is_cap", "is_min"), "set the importance weights' bounds: add --is-correction"))
    if config.loss != "sapo":
        groups.append((("sapo_temperature_pos", "sapo_temperature_neg"), "set --loss sapo's gate: add --loss sapo"))
    if config.loss != "vespo":
        vespo = ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
        groups.append((vespo, "set --loss vespo's weight: add --loss vespo"))
    if not config.sync_ref_model:
        groups.append(
            (("ref_model_mixup_alpha", "ref_model_sync_steps"), "set the reference's sync: add --sync-ref-model")
        )
    if config.mode == "sync":
        groups.append(
            (
                ("max_staleness", "max_inflight"),
                "bound an async run's rollouts; --mode sync trains each on the policy that made it: use --mode async",
            )
        )
    if config.loss in ("cispo", "sapo", "vespo"):
        groups.append(
            (
                ("dual_clip",),
                f"bounds a clipped loss's term for a negative advantage; --loss {config.loss} has no such clip: use "
                "--loss grpo, dr_grpo, dapo or luspo",
            )
        )
    if config.loss in ("sapo", "vespo"):
        groups.append((("clip", "epsilon_high"), f"clip the ratio; --loss {config.loss} weighs it without a clip"))
    if config.loss == "cispo":
        groups.append((("clip",), "sets the clip's lower bound; --loss cispo only caps the ratio, at --epsilon-high"))
    if config.engine != "vllm":
        vllm = ("vllm_dtype", "vllm_gpu_memory", "vllm_max_model_len")
        groups.append((vllm, "set vLLM's engine: add --engine vllm"))
    if not config.ray:
        groups.append((("ray_hosts",), "picks the Ray nodes to use: add --ray"))
    if config.trainer_ranks == 1:
        groups.append((("collective_timeout",), "bounds the trainer ranks' collectives: add --trainer-ranks N"))
    if not config.eval_dataset:
        groups.append((("eval_split",), "picks a Hub --eval-dataset's split: add --eval-dataset"))
        groups.append((("eval_dataset_config",), "picks a Hub --eval-dataset's subset: add --eval-dataset"))
    else:
        groups.append((("eval_fraction",), "holds out a share of --dataset; --eval-dataset gives the held-out prompts"))
    return groups


def setting_defaults() -> dict[str, object]:
    """Each setting's default, by field name."""
    return {f.name: f.default for f in dataclasses.fields(Config)}


def forget_unused_settings(config: Config) -> None:
    """Put back the defaults of settings no switch uses (a run saved before they were refused never used them)."""
    defaults = setting_defaults()
    for names, _why in unused_settings(config):
        for name in names:
            setattr(config, name, defaults[name])


def _refuse_without_switch(config: Config, names: tuple[str, ...], why: str) -> None:
    """Refuse settings among ``names`` given (away from their defaults) while the switch that uses them is off."""
    defaults = setting_defaults()
    given = [name for name in names if getattr(config, name) != defaults[name]]
    if given:
        raise SettingsError(f"{', '.join('--' + name.replace('_', '-') for name in given)} {why}")


def _check_lora(config: Config) -> None:
    """LoRA: a scale at least 0, layers named, ranks that replicate (not fsdp), no reference sync (the base)."""
    if not config.lora_r:
        _refuse_without_switch(config, ("lora_alpha", "lora_target_modules"), "set LoRA adapters: add --lora-r")
        return
    if not config.lora_alpha >= 0 or not math.isfinite(config.lora_alpha):
        raise SettingsError(
            f"--lora-alpha {config.lora_alpha}: the adapters' scale is alpha / r, so at least 0 (0: 2 r)"
        )
    if not config.lora_target_modules.strip(" ,"):
        raise SettingsError("--lora-target-modules: name the layers to adapt (all-linear, or q_proj,v_proj,...)")
    if config.sharded_trainer:
        raise SettingsError(
            f"--lora-r with --trainer-ranks {config.trainer_ranks} --trainer-shard fsdp: the adapters are small and "
            "the base is frozen, so each rank holds them whole: use --trainer-shard ddp"
        )
    if config.sync_ref_model:
        raise SettingsError(
            "--lora-r with --sync-ref-model: the reference is the base model under the adapters, which stays as "
            "it is (as in TRL, which has no reference model to sync with PEFT)"
        )


def _check_trainer_ranks(config: Config) -> None:
    """Several trainer ranks: each needs rows to train (their GPUs are checked with the placement)."""
    ranks = config.trainer_ranks
    if ranks == 1:
        return
    if config.compile and config.trainer_shard == "fsdp":
        raise SettingsError(
            f"--compile with --trainer-ranks {ranks} --trainer-shard fsdp: compiled blocks under FSDP2's hooks are "
            "not supported yet; compile replicated ranks (--trainer-shard ddp) or one rank"
        )
    if config.prompts * config.group < ranks:
        raise SettingsError(
            f"--trainer-ranks {ranks}: a rollout has {config.prompts * config.group} rows (--prompts x --group) "
            "to share out; each rank needs at least one"
        )
    if config.prompts * config.group < ranks * config.mini_batches:
        raise SettingsError(
            f"--trainer-ranks {ranks} with --mini-batches {config.mini_batches}: a mini-batch of a rollout's "
            f"{config.prompts * config.group} rows (--prompts x --group) has fewer rows than ranks to share them"
        )
