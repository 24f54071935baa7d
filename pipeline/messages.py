"""The typed messages that flow around the pipeline, and its configuration."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

from actors import WeightManifest

from .sinks import ReportTo
from .token_loss import LossKind, RewardScale

__all__ = [
    "WAKE",
    "Config",
    "GeneratorTimes",
    "Grant",
    "InstallMode",
    "LrSchedule",
    "Mode",
    "Rollout",
    "ScoredRollout",
    "StepReport",
    "TrainDtype",
]

#: The ticket of a :class:`Grant` that only wakes a generator.
WAKE = -1
#: ``async``: generators run ahead of the trainer (bounded); ``sync``: lock-step, on-policy.
Mode = Literal["async", "sync"]
#: How generators install weights: ``copy`` into their parameters, or ``alias`` the published slot.
InstallMode = Literal["copy", "alias"]
#: The learning rate over the run: ``constant``, or ``cosine`` decay to 0 at the last step (after any warm-up).
LrSchedule = Literal["constant", "cosine"]
#: The run's precision: the trainer's autocast, and the weights generators and the reference hold and receive.
TrainDtype = Literal["float32", "bfloat16"]
#: What draws a generator's completions (pipeline.engines, pipeline.vllm_engine).
EngineKind = Literal["builtin", "hf", "vllm"]
#: How the loss corrects for a behaviour policy that is not the trainer's (pipeline.token_loss).
IsCorrection = Literal["none", "tis"]


@dataclass
class GeneratorTimes:
    """Where a generator's time went since it sent its previous rollout (seconds)."""

    cycle: float = 0.0  # since the previous rollout was sent
    wait: float = 0.0  # blocked: no credit, or the policy a grant requires not yet here
    generate: float = 0.0  # sampling this rollout
    install: float = 0.0  # installing weights before it
    delivery: float | None = None  # last installed update: trainer's publish -> start of its install


@dataclass
class Rollout:
    """One batch of samples from a generator, with the policy version that drew them.

    ``samples`` is the task's own dataclass of CPU tensors (the behaviour
    log-probabilities included); ``tokens`` and ``response_length`` are the
    task's :meth:`~pipeline.task.Task.measure` of it.
    """

    generator: int
    rollout_id: int
    version: int  # policy version that produced it
    samples: Any
    tokens: int = 0
    response_length: float = 0.0
    times: GeneratorTimes = field(default_factory=GeneratorTimes)
    ticket: int = -1  # the trainer step it was granted for (pipeline.tickets)
    peak_gpu_gb: float | None = None  # the generator's peak GPU memory so far (torch's allocator); None on a CPU
    reserved_gpu_gb: float | None = None  # the most its caching allocator has reserved (cached blocks included)


@dataclass
class ScoredRollout:
    """A rollout with the verifier's reward per sample (and exact correctness, if the task has it).

    The RefModel passes it on with ``ref_logps``, the reference policy's
    log-probabilities of the samples; a run without a KL term (β = 0) has
    no RefModel and the scorer's rollouts reach the trainer without them.
    """

    rollout: Rollout
    rewards: torch.Tensor
    accuracy: torch.Tensor | None = None
    scorer_queue: int = 0  # scorer's backlog when it forwarded this
    ref_logps: torch.Tensor | None = None
    ref_queue: int = 0  # reference model's backlog when it forwarded this
    reward_components: dict[str, float] = field(default_factory=dict)  # each reward function's mean


@dataclass
class Grant:
    """A ticket: permission for a generator to produce the rollout the trainer trains at step ``ticket``.

    The generator draws it with policy version ``min_version`` or newer,
    so it is at most ``max_staleness`` versions old when trained
    (:mod:`pipeline.tickets`); ``manifest`` carries the weights when the
    trainer knows the generator lacks them. A ticket of :data:`WAKE` only
    wakes a generator waiting for one (``drain``).
    """

    ticket: int
    min_version: int = 0
    manifest: WeightManifest | None = None


@dataclass
class StepReport:
    """What the trainer measured in one step; :class:`pipeline.metrics.MetricsLog` turns it into a row."""

    step: int
    time: float  # seconds since training started
    version: int
    generator: int
    staleness: int  # policy versions between the sample's and the trainer's
    dropped_stale: int  # cumulative
    reward_mean: float
    reward_std: float
    accuracy: float | None  # exact match of the sampled completions, if the task has it
    evaluation: dict[str, float] | None  # held-out metrics, on evaluation steps
    score: float | None  # the newest held-out value of the task's primary metric
    loss: float
    policy_loss: float
    kl: float
    clip_fraction: float
    entropy: float
    grad_norm: float  # before clipping
    response_length: float
    tokens: int  # tokens in the trained rollout
    tokens_received: int  # cumulative tokens of every rollout that reached the trainer (dropped ones too)
    wait_batch: float  # seconds the trainer waited for this batch
    train: float  # seconds of the update itself
    publish: float  # seconds to publish the new version
    generator_times: GeneratorTimes
    trainer_queue: int
    scorer_queue: int
    ref_queue: int
    dual_clip_fraction: float = 0.0
    logp_diff: float = 0.0  # mean |log π_trainer - log π_behaviour| of the rollout's tokens, before the update
    is_weight: float = 1.0  # --is-correction tis: the mean token weight
    is_truncated: float = 0.0  # --is-correction tis: the share of tokens whose weight was capped
    lr: float = 0.0  # the learning rate this step used
    update_bytes: int = 0  # bytes of the newest weight update published (in the generators' dtype)
    trainer_peak_gpu_gb: float | None = None  # the trainer's peak GPU memory so far; None on a CPU
    generator_peak_gpu_gb: float | None = None  # that of the generator that drew this rollout
    trainer_reserved_gpu_gb: float | None = None  # the most the trainer's caching allocator has reserved
    generator_reserved_gpu_gb: float | None = None  # that of the generator that drew this rollout
    reward_components: dict[str, float] = field(default_factory=dict)  # each reward function's mean


@dataclass
class Config:
    """Everything the roles need; travels to every actor as a constructor argument.

    ``lr``, ``clip`` and ``kl_coeff`` left at None take the task's defaults
    (:attr:`pipeline.task.Task.defaults`) when the run starts.
    """

    task: str = "reverse"  # reverse | sort | add | bandit | hf | module:Class
    digits: int = 6  # digit tasks: input length
    model: str = "tiny"  # a preset (pipeline.model.PRESETS), or for ``hf`` a Hugging Face model folder or name
    dataset: str = ""  # hf: a .jsonl/.json/.parquet/.csv file or a Hub dataset name
    dataset_split: str = "train"  # hf: the split of a Hub dataset
    dataset_config: str = ""  # hf: the subset of a Hub dataset (gsm8k's "main")
    prompt_column: str = "prompt"  # hf: text, or a list of chat messages
    eval_dataset: str = ""  # hf: held-out prompts; "" holds out ``eval_fraction`` of ``dataset``
    eval_fraction: float = 0.1
    rewards: list[str] = field(default_factory=list)  # hf: module:function | file.py:function | built-in [=weight]
    reward_timeout: float = 60.0  # hf: the most seconds one reward function may take on one batch
    log_completions: int = 0  # hf: held-out (prompt, completion, rewards) rows appended per evaluation
    top_k: int = 0  # 0: off
    report_to: ReportTo = "tensorboard"  # tensorboard | wandb | none: where metric rows go besides metrics.jsonl
    engine: EngineKind = "builtin"  # the generators' sampler: builtin | hf (transformers' generate) | vllm
    vllm_dtype: str = "float32"  # vllm: the engine's weights (auto: the checkpoint's); updates are cast to it
    vllm_gpu_memory: float = 0.3  # vllm on a GPU: the share of its memory the engine may take
    vllm_max_model_len: int = 0  # vllm: the longest prompt + completion (0: the model's own limit)
    is_correction: IsCorrection = "none"  # tis: truncated importance sampling against the behaviour policy
    is_cap: float = 2.0  # tis: the most one token's importance weight may be
    prompts: int = 32  # prompts per rollout (one trainer step)
    group: int = 8  # samples per prompt (GRPO group)
    max_new_tokens: int = 0  # 0: the answer's length + 2
    temperature: float = 1.0
    top_p: float = 1.0
    eval_size: int = 256  # held-out prompts (or states) per evaluation
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
    loss: LossKind = "dapo"  # grpo | dr_grpo | dapo: how token terms are averaged (pipeline.token_loss)
    scale_rewards: RewardScale | None = None  # group | batch | none; None: none for dr_grpo, else group
    epsilon_high: float | None = None  # the clip's upper bound (clip-higher); None: the same as ``clip``
    dual_clip: float = 3.0  # a negative advantage's term is at most C |A| (0: off)
    mask_truncated: bool = False  # completions that hit the length limit do not train
    micro_batch: int = 0  # samples per forward/backward pass; 0: as many as ``max_tokens_per_pass`` allows
    max_tokens_per_pass: int = 8192  # rows x token width of one trainer or reference pass (0: no limit)
    gradient_checkpointing: bool = False  # a Hugging Face policy recomputes activations in the backward pass
    max_grad_norm: float = 1.0  # clip the gradient's L2 norm to this (0: no clipping)
    lr_schedule: LrSchedule = "constant"  # constant | cosine (to 0 at ``steps``)
    warmup_steps: int = 0  # linear warm-up of the learning rate from 0
    dtype: TrainDtype = "float32"  # bfloat16: trainer autocast (float32 masters), bf16 generators, reference, updates
    eval_every: int = 10
    checkpoint_every: int = 200
    generator_restarts: int = 3  # a dead generator is restarted at most this often per minute
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

    def device_of(self, role: str) -> str:
        """The device ``role`` runs on."""
        return self.devices.get(role, self.device)

    def hyper(self, name: str) -> float:
        """A hyper-parameter that :func:`pipeline.task.resolve` has filled in."""
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"config.{name} is unset: resolve the config with pipeline.task.resolve first")
        return float(value)
