"""The run's configuration: one dataclass every role receives, and the literal choices its fields take."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

from ..algorithm import EntropyControl, IsMode, LossKind, RatioLevel, RewardScale

__all__ = [
    "DECODE_PATHS",
    "ENGINES",
    "REPORT_TO",
    "Aggregation",
    "Config",
    "DecodePath",
    "EngineKind",
    "InstallMode",
    "IsCorrection",
    "LrSchedule",
    "Mode",
    "ReportTo",
    "TrainDtype",
    "TrainerShard",
]

#: ``--report-to`` choices.
ReportTo = Literal["tensorboard", "wandb", "none"]


REPORT_TO: tuple[str, ...] = ("tensorboard", "wandb", "none")


#: ``async``: generators run ahead of the trainer (bounded); ``sync``: lock-step, on-policy.
Mode = Literal["async", "sync"]


#: How generators install weights: ``copy`` into their parameters, or ``alias`` the published slot.
InstallMode = Literal["copy", "alias"]


#: The learning rate over the run: ``constant``, or ``cosine`` decay to 0 at the last step (after any warm-up).
LrSchedule = Literal["constant", "cosine"]


#: How several trainer ranks hold the policy: ``fsdp`` shards weights, gradients and Adam state; ``ddp`` replicates.
TrainerShard = Literal["ddp", "fsdp"]


#: The run's precision: the trainer's autocast, and the weights generators and the reference hold and receive.
TrainDtype = Literal["float32", "bfloat16"]


#: What draws a generator's completions (pipeline.models, pipeline.models).
EngineKind = Literal["builtin", "hf", "vllm"]
ENGINES: tuple[str, ...] = get_args(EngineKind)

#: How ``--engine builtin`` decodes: ``auto`` (CUDA graphs over a static KV cache on a GPU, else the model's
#: dynamic cache), ``dynamic``, ``static`` (a static cache, eager steps), ``graphs`` or ``compiled`` (the step
#: compiled by torch.compile, on a GPU replayed as a CUDA graph).
DecodePath = Literal["auto", "dynamic", "static", "graphs", "compiled"]
DECODE_PATHS: tuple[str, ...] = ("auto", "dynamic", "static", "graphs", "compiled")


#: How the loss corrects for a behaviour policy that is not the trainer's (pipeline.algorithm).
#: Several reward functions: sum them, then normalise (GRPO), or normalise each within its group, then sum (GDPO).
Aggregation = Literal["sum_then_normalize", "normalize_then_sum"]
#: ``tis`` is ``token_truncate`` (truncated importance sampling), kept under the name it had first.
IsCorrection = Literal["none", "tis", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


@dataclass
class Config:
    """Everything the roles need; travels to every actor as a constructor argument.

    ``lr``, ``clip`` and ``kl_coeff`` left at None take the task's defaults
    (:attr:`pipeline.tasks.Task.defaults`) when the run starts.
    """

    task: str = "reverse"  # reverse | sort | add | bandit | hf | module:Class
    digits: int = 6  # digit tasks: input length
    model: str = "tiny"  # a preset (pipeline.models.PRESETS), or for ``hf`` a Hugging Face model folder or name
    dataset: str = ""  # hf: a .jsonl/.json/.parquet/.csv file, a folder of them, or a Hub dataset name
    dataset_split: str = "train"  # hf: the split of a Hub dataset
    dataset_config: str = ""  # hf: the subset of a Hub dataset (gsm8k's "main")
    prompt_column: str = "prompt"  # hf: text, or a list of chat messages
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # hf: the chat template's variables (TRL's)
    trust_remote_code: bool = False  # hf: run the model's own code (its config's auto_map), as transformers asks
    shuffle_dataset: bool = True  # hf: each epoch in a seeded random order; off: in the dataset's (a curriculum)
    eval_dataset: str = ""  # hf: held-out prompts; "" holds out ``eval_fraction`` of ``dataset``
    eval_split: str = "test"  # hf: the split of a Hub ``eval_dataset`` (TRL's test split)
    eval_dataset_config: str = ""  # hf: a Hub ``eval_dataset``'s subset; "": ``dataset``'s if it is ``dataset``
    eval_fraction: float = 0.1
    rewards: list[str] = field(default_factory=list)  # hf: module:function | file.py:function | built-in [=weight]
    reward_timeout: float = 60.0  # hf: the most seconds one reward function may take on one batch
    log_completions: int = 0  # hf: held-out (prompt, completion, rewards) rows appended per evaluation
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # sample only tokens at least this share of the likeliest one's probability (0: off)
    repetition_penalty: float = 1.0  # tokens already in the prompt or completion drawn less often (1: off)
    report_to: ReportTo = "tensorboard"  # tensorboard | wandb | none: where metric rows go besides metrics.jsonl
    engine: EngineKind = "builtin"  # the generators' sampler: builtin | hf (transformers' generate) | vllm
    decode: DecodePath = "auto"  # builtin: auto | dynamic | static | graphs (pipeline.models.DecoderChoice)
    vllm_dtype: str = "float32"  # vllm: the engine's weights (auto: the checkpoint's); updates are cast to it
    vllm_gpu_memory: float = 0.3  # vllm on a GPU: the share of its memory the engine may take
    vllm_max_model_len: int = 0  # vllm: the longest prompt + completion (0: the model's own limit)
    is_correction: IsCorrection = "none"  # importance weights against the behaviour policy (TRL's vLLM IS modes)
    is_cap: float = 2.0  # importance weights: the upper bound, C_max
    is_min: float = 0.0  # importance weights: the lower bound, C_min (0: none)
    prompts: int = 32  # prompts per rollout (one trainer step)
    group: int = 8  # samples per prompt (GRPO group)
    max_new_tokens: int = 0  # 0: the answer's length + 2
    temperature: float = 1.0
    top_p: float = 1.0
    eval_size: int = 256  # held-out prompts (or states) per evaluation
    num_generations_eval: int = 0  # hf: 0 decodes each held-out prompt greedily; N samples N at training settings
    steps: int = 1000
    generators: int = 2
    mode: Mode = "async"
    max_staleness: int = 2  # the oldest a trained rollout may be, in policy versions (0: on-policy)
    transport: str = "shm"
    seed: int = 0
    lr: float | None = None
    clip: float | None = None
    kl_coeff: float | None = None
    max_inflight: int = 2  # rollouts a generator may have ahead of the trainer
    loss: LossKind = "dapo"  # grpo | dr_grpo | dapo | cispo | sapo | luspo | vespo: the policy term and its average
    scale_rewards: RewardScale | None = None  # group | batch | none; None: none for dr_grpo, else group (batch: GDPO)
    multi_objective_aggregation: Aggregation = "sum_then_normalize"  # hf: normalize_then_sum is GDPO
    epsilon_high: float | None = None  # the clip's upper bound (clip-higher); None: ``clip`` (cispo: the cap, 5)
    dual_clip: float = 3.0  # a negative advantage's term is at most C |A| (0: off)
    mask_truncated: bool = False  # completions that hit the length limit do not train
    importance_sampling_level: RatioLevel = "token"  # sequence: one clipped ratio per completion (GSPO)
    num_iterations: int = 1  # optimiser steps on each rollout (TRL's μ; the clip bounds the later ones)
    mini_batches: int = 1  # optimiser steps per iteration, each on an equal part of the rollout's rows
    sync_ref_model: bool = False  # mix the policy into the reference every ``ref_model_sync_steps`` (TR-DPO style)
    ref_model_mixup_alpha: float = 0.6  # the policy's share of a synced reference: a pi + (1 - a) pi_ref
    ref_model_sync_steps: int = 512  # trainer steps between syncs of the reference
    top_entropy_quantile: float = 1.0  # < 1: the policy term only for this top share of each pass's tokens by entropy
    off_policy_mask_threshold: float | None = None  # A < 0 completions drifted further drop out (DeepSeek-V3.2)
    use_bias_correction_kl: bool = False  # the KL term weighted by the importance ratio
    sapo_temperature_pos: float = 1.0  # --loss sapo: the soft gate's temperature for positive advantages
    sapo_temperature_neg: float = 1.05  # --loss sapo: for the others
    vespo_k_pos: float = 2.0  # --loss vespo: the weight's power and decay where A >= 0, and where A < 0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    entropy_coef: float = 0.0  # the loss minus this x the trained tokens' mean entropy (adaptive: its start)
    use_adaptive_entropy: bool = False  # step entropy_coef toward entropy_target each optimiser step (Skywork-OR1)
    entropy_coef_min: float = 0.0  # adaptive: the coefficient's bounds and step
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    entropy_target: float = 0.2  # adaptive: the mean token entropy (nats) at or below which the bonus applies
    micro_batch: int = 0  # samples per forward/backward pass; 0: as many as ``max_tokens_per_pass`` allows
    max_tokens_per_pass: int = 8192  # rows x token width of one trainer or reference pass (0: no limit)
    trainer_ranks: int = 1  # trainer processes, each training its share of every rollout's rows (gradients summed)
    trainer_shard: TrainerShard = "fsdp"  # with several ranks: fsdp shards the policy over them, ddp replicates it
    collective_timeout: float = 60.0  # with several ranks: the most seconds a rank waits in one collective
    disable_dropout: bool = True  # hf: the policy's dropout off, so the trainer's log-probs are the generators'
    export_dtype: str = "auto"  # hf: model/'s weights: auto (the --model's recorded dtype, else float32) or a dtype
    lora_r: int = 0  # hf: train LoRA adapters of this rank instead of every weight (0: off); generators get merged ones
    lora_alpha: float = 0.0  # hf: the adapters' scale is alpha / r (0: twice the rank)
    lora_target_modules: str = "all-linear"  # hf: the layers adapted: all-linear (PEFT's), or names like q_proj,v_proj
    gradient_checkpointing: bool = False  # a Hugging Face policy recomputes activations in the backward pass
    compile: bool = False  # the trainer's and the reference's repeated blocks and head chunks compiled (torch.compile)
    max_grad_norm: float = 1.0  # clip the gradient's L2 norm to this (0: no clipping)
    lr_schedule: LrSchedule = "constant"  # constant | cosine (to 0 at ``steps``)
    warmup_steps: int = 0  # linear warm-up of the learning rate from 0
    dtype: TrainDtype = "float32"  # bfloat16: trainer autocast (float32 masters), bf16 generators, reference, updates
    eval_every: int = 10
    checkpoint_every: int = 200
    stop_grace: float = 20.0  # seconds Ctrl-C or SIGTERM waits for the trainer's final checkpoint
    generator_restarts: int = 3  # a dead generator is restarted at most this often per minute
    #: How long a generator waits for the policy version its ticket needs: a guard against a hung trainer, so it
    #: must outlast the trainer's longest pause between publishes (an evaluation, a large model's checkpoint, a
    #: peer generator's restart). A trainer that dies is noticed at once, whatever this is.
    weights_timeout: float = 600.0
    target_score: float | None = None  # stop once the task's primary held-out metric reaches this
    threads: int = 1  # torch threads per role (every role is its own process)
    run_dir: str = ""
    device: str = "cpu"  # every role's device, unless ``devices`` names one for it
    devices: dict[str, str] = field(default_factory=dict)  # role -> device: trainer, generator, scorer, ref
    install: InstallMode = "copy"  # "alias": zero-copy, read-only views of the published slot
    ray: str = ""  # a Ray cluster address ("auto": the one this machine joined); "" runs on this host only
    ray_hosts: int = 0  # Ray nodes to spread over (0: every node of the cluster)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Config:
        """A config from :meth:`to_dict`'s output; unknown keys (older runs) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})

    @property
    def sharded_trainer(self) -> bool:
        """Whether the trainer's ranks shard the policy (several ranks, ``--trainer-shard fsdp``)."""
        return self.trainer_ranks > 1 and self.trainer_shard == "fsdp"

    def syncs_reference_after(self, step: int) -> bool:
        """Whether the reference is mixed toward the policy after trainer step ``step`` (``--sync-ref-model``)."""
        return self.sync_ref_model and step % self.ref_model_sync_steps == 0

    def device_of(self, role: str) -> str:
        """The device ``role`` runs on."""
        return self.devices.get(role, self.device)

    @property
    def lora_scale_alpha(self) -> float:
        """The adapters' alpha: ``lora_alpha``, or twice the rank when it is left at 0."""
        return self.lora_alpha or 2.0 * self.lora_r

    def importance_mode(self) -> IsMode | None:
        """The importance weights ``is_correction`` asks for (``tis`` is ``token_truncate``), or None."""
        if self.is_correction == "none":
            return None
        if self.is_correction == "tis":
            return "token_truncate"
        return self.is_correction

    def entropy_control(self) -> EntropyControl:
        """The entropy bonus's coefficient as these settings start it (:class:`pipeline.algorithm.EntropyControl`)."""
        return EntropyControl(
            self.entropy_coef,
            self.use_adaptive_entropy,
            self.entropy_target,
            self.entropy_coef_delta,
            self.entropy_coef_min,
            self.entropy_coef_max,
        )

    def hyper(self, name: str) -> float:
        """A hyper-parameter that :func:`pipeline.tasks.resolve` has filled in."""
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"config.{name} is unset: resolve the config with pipeline.tasks.resolve first")
        return float(value)
