"""The task interface: everything the roles need to know about what is being learned.

Each role builds one :class:`Task` from the run's config (``load_task``) and
calls only these methods, so a task is the single place that knows the
policy, the samples, the reward and the loss:

============  ======================================================
role          calls
============  ======================================================
Generator     ``build_policy``, ``sample``
Scorer        ``build_scorer``, ``score`` (the verifier)
RefModel      ``build_policy``, ``reference_logps``
Trainer       ``build_policy``, ``loss``, ``evaluate``
============  ======================================================

Samples travel between processes as a dataclass of CPU tensors; each role
moves them to its own device with :func:`to_device`. Built in: the digit
tasks (``reverse``, ``sort``, ``add``; :mod:`pipeline.token_task`) and the
contextual ``bandit`` (:mod:`pipeline.bandit`). A user task is a subclass
named ``module:Class``.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .token_loss import LossSpec, TokenLoss, group_advantages, token_grpo_loss, token_weights

if TYPE_CHECKING:
    from .engines import Engine
    from .messages import Config

__all__ = [
    "LossReport",
    "Scores",
    "Task",
    "completion_loss",
    "load_task",
    "loss_spec",
    "resolve",
    "task_class",
    "to_device",
]


@dataclass
class Scores:
    """The verifier's verdict on one rollout's samples: a reward each, and exact correctness if it has one."""

    rewards: torch.Tensor  # [N]
    accuracy: torch.Tensor | None = None  # [N] in {0, 1}
    components: dict[str, float] | None = None  # each reward function's mean, logged as reward/<name>


@dataclass
class LossReport:
    """One update's loss and the quantities RL users watch (token means over the whole batch).

    A micro-batch's report holds its share of each: the reports of a batch's
    micro-batches add up (:meth:`add`) to the batch's.
    """

    loss: torch.Tensor
    policy_loss: float
    kl: float
    clip_fraction: float = 0.0
    entropy: float = 0.0
    dual_clip_fraction: float = 0.0
    logp_diff: float = 0.0  # mean |log π_trainer - log π_behaviour| before the update
    is_weight: float = 1.0  # --is-correction tis: the mean token weight
    is_truncated: float = 0.0  # --is-correction tis: tokens whose weight hit --is-cap

    @classmethod
    def of(cls, out: TokenLoss) -> LossReport:
        """The report of a token loss (:func:`pipeline.token_loss.token_grpo_loss`)."""
        return cls(
            out.loss,
            out.policy_loss,
            out.kl,
            out.clip_fraction,
            out.entropy,
            out.dual_clip_fraction,
            out.logp_diff,
            out.is_weight,
            out.is_truncated,
        )

    def add(self, other: LossReport) -> LossReport:
        """The report of this part and ``other`` together (the loss detached: each part was backpropagated)."""
        return LossReport(
            self.loss.detach() + other.loss.detach(),
            *(getattr(self, name) + getattr(other, name) for name in _SHARES),
        )


#: The report's figures that are shares of the batch's token means: a batch's parts add up to them.
_SHARES = (
    "policy_loss",
    "kl",
    "clip_fraction",
    "entropy",
    "dual_clip_fraction",
    "logp_diff",
    "is_weight",
    "is_truncated",
)


class Task:
    """What the pipeline learns; subclass it to train something else."""

    #: Hyper-parameters this task learns well with, used wherever the run does not set them.
    defaults: ClassVar[dict[str, float]] = {"lr": 2e-3, "kl_coeff": 0.02, "clip": 0.2}
    #: The evaluation metric the progress line shows and ``--target-score`` stops at.
    primary: ClassVar[str] = "accuracy"
    #: ``python -m pipeline.grpo`` stops once :attr:`primary` reaches this (None: run every step).
    target: ClassVar[float | None] = None

    def __init__(self, config: Config) -> None:
        self.config = config
        self.seed = config.seed

    def build_policy(self) -> torch.nn.Module:
        """A freshly initialised policy (the trainer seeds torch first; every role builds the same one)."""
        raise NotImplementedError

    def sample(self, policy: torch.nn.Module, generator: torch.Generator, ticket: int = 0) -> Any:
        """One rollout's samples, drawn with ``policy``: a dataclass of tensors (behaviour log-probs included).

        ``ticket`` is the trainer step the rollout is for (a dataset's
        position: :meth:`pipeline.data.PromptData.rows_for`).
        """
        raise NotImplementedError

    def build_engine(self, policy: torch.nn.Module) -> Engine | None:
        """The generation engine a generator samples ``policy`` with, and installs weights through.

        None (the default): :meth:`sample` samples the module itself and the
        generator installs updates straight into it.
        """
        return None

    def build_scorer(self, device: torch.device) -> Any:
        """What :meth:`score` needs besides the samples (a reward model, say); None for a verifier."""
        return None

    def score(self, scorer: Any, samples: Any) -> Scores:
        """The reward of each sample."""
        raise NotImplementedError

    async def score_async(self, scorer: Any, samples: Any) -> Scores:
        """:meth:`score` for the Scorer's event loop; a task whose rewards wait on I/O or threads overrides it."""
        return self.score(scorer, samples)

    def reference_logps(self, reference: torch.nn.Module, samples: Any) -> torch.Tensor:
        """Log-probabilities of the sampled choices under the frozen reference policy."""
        raise NotImplementedError

    def loss(
        self,
        policy: torch.nn.Module,
        samples: Any,
        rewards: torch.Tensor,
        ref_logps: torch.Tensor | None,
        rows: slice | None = None,
    ) -> LossReport:
        """The GRPO loss of one rollout for ``policy`` (``ref_logps`` None: no KL term, β = 0).

        ``rows`` (one of :meth:`micro_batches`) asks for those samples' share
        of the whole rollout's loss: normalisers and advantages come from
        every sample, so the shares' gradients add up to the whole's.
        """
        raise NotImplementedError

    def rows(self, samples: Any) -> int | None:
        """How many samples ``samples`` holds along the dimension micro-batches split (None: not splittable)."""
        return None

    def row_tokens(self, samples: Any) -> int | None:
        """Tokens one sample of ``samples`` takes through a pass (its padded width); None: not counted in tokens."""
        return None

    def micro_batches(self, samples: Any, size: int, max_tokens: int = 0) -> list[slice]:
        """Row ranges of ``samples`` taking one forward and backward pass each.

        ``size`` rows each; ``size`` 0 takes as many rows as fit in ``max_tokens``
        (:meth:`row_tokens` each), or all of them when that is 0 too.
        """
        rows = self.rows(samples)
        if size <= 0 and max_tokens > 0:
            width = self.row_tokens(samples)
            size = max(1, max_tokens // width) if width else 0
        if size <= 0 or rows is None or rows <= size:
            return [slice(None)]
        return [slice(start, min(start + size, rows)) for start in range(0, rows, size)]

    def evaluate(self, policy: torch.nn.Module) -> dict[str, float]:
        """Held-out metrics of ``policy``; must include :attr:`primary`."""
        raise NotImplementedError

    async def evaluate_async(self, policy: torch.nn.Module) -> dict[str, float]:
        """:meth:`evaluate` for the Trainer's event loop (reward functions awaited, not blocked on)."""
        return self.evaluate(policy)

    def export(self, policy: torch.nn.Module, run_dir: str) -> str | None:
        """Write ``policy`` where other tools load it (a Hugging Face folder); the path, or None if the task has none."""
        return None

    def measure(self, samples: Any) -> tuple[int, float]:
        """(tokens generated, mean response length) of one rollout's samples."""
        return 0, 0.0


def to_device(samples: Any, device: torch.device) -> Any:
    """``samples`` (a dataclass of tensors) with every tensor on ``device``."""
    if isinstance(samples, torch.Tensor):
        return samples.to(device)
    if dataclasses.is_dataclass(samples) and not isinstance(samples, type):
        changes = {f.name: to_device(getattr(samples, f.name), device) for f in dataclasses.fields(samples) if f.init}
        return dataclasses.replace(samples, **changes)
    return samples


def task_class(name: str) -> type[Task]:
    """The task class a ``--task`` value names: a built-in name or ``module:Class``."""
    from .bandit import BanditTask
    from .digits import DIGIT_TASKS
    from .token_task import DigitsTask

    if name == "bandit":
        return BanditTask
    if name == "hf":
        from .hf_task import HFTask

        return HFTask
    if name in DIGIT_TASKS:
        return DigitsTask
    module_name, sep, qualname = name.partition(":")
    if not sep:
        raise ValueError(f"unknown task {name!r}: use bandit, {', '.join(DIGIT_TASKS)}, hf, or module:Class")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, Task)):
        raise TypeError(f"{name} must be a subclass of pipeline.task.Task")
    return obj


def load_task(config: Config) -> Task:
    """The task of the run, built for this role."""
    return task_class(config.task)(config)


def resolve(config: Config) -> Config:
    """``config`` with every setting it leaves unset filled in: the task's defaults, then those that follow.

    The clip's upper bound defaults to the lower one; the reward scaling to
    none for ``dr_grpo`` (the paper drops the std) and to the group's std
    otherwise.
    """
    defaults = task_class(config.task).defaults
    changes: dict[str, Any] = {
        name: defaults[name] for name in ("lr", "clip", "kl_coeff") if getattr(config, name) is None
    }
    if config.epsilon_high is None:
        changes["epsilon_high"] = changes.get("clip", config.clip)
    if config.scale_rewards is None:
        changes["scale_rewards"] = "none" if config.loss == "dr_grpo" else "group"
    return dataclasses.replace(config, **changes) if changes else config


def loss_spec(config: Config, max_length: int = 0) -> LossSpec:
    """The GRPO variant a resolved ``config`` names; ``max_length`` is the completion limit (``dr_grpo``'s L)."""
    return LossSpec(
        kind=config.loss,
        clip_low=config.hyper("clip"),
        clip_high=config.hyper("epsilon_high"),
        dual_clip=config.dual_clip,
        kl_coeff=config.hyper("kl_coeff"),
        max_length=max_length,
        is_cap=config.is_cap if config.is_correction == "tis" else 0.0,
    )


def completion_loss(
    config: Config,
    max_length: int,
    policy_logps: Callable[[slice], tuple[torch.Tensor, torch.Tensor]],
    behaviour: torch.Tensor,
    ref_logps: torch.Tensor | None,
    mask: torch.Tensor,
    rewards: torch.Tensor,
    group: int,
    truncated: torch.Tensor,
    rows: slice | None,
) -> LossReport:
    """The GRPO loss of the completions in ``rows`` of one rollout of token completions.

    ``policy_logps(part)`` gives the policy's log-probabilities and entropies
    [n, T] of those rows; ``behaviour``, ``ref_logps`` and ``mask`` [N, T],
    ``rewards`` and ``truncated`` [N] are the whole rollout's, so advantages
    and normalisers are the whole batch's whatever the micro-batch.
    """
    spec = loss_spec(config, max_length)
    if config.mask_truncated:  # a completion cut off at the limit has no verdict on its end: it does not train
        mask = mask * (~truncated).to(mask.dtype).unsqueeze(1)
    part = slice(None) if rows is None else rows
    advantages = group_advantages(rewards, group, config.scale_rewards or "group")
    weights = token_weights(mask, spec.kind, spec.max_length)
    logps, entropy = policy_logps(part)
    out = token_grpo_loss(
        logps,
        behaviour[part],
        None if ref_logps is None else ref_logps[part],
        mask[part],
        advantages[part],
        spec,
        entropy=entropy,
        weights=weights[part],
        tokens=float(mask.sum().clamp_min(1.0)),
    )
    return LossReport.of(out)
