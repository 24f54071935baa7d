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
tasks (``reverse``, ``sort``, ``add``; :mod:`pipeline.tasks`) and the
contextual ``bandit`` (:mod:`pipeline.tasks`). A user task is a subclass
named ``module:Class``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..algorithm import TokenLoss

if TYPE_CHECKING:
    from ..config import Config
    from ..models import Engine

__all__ = [
    "LossReport",
    "Scores",
    "Task",
    "to_device",
]


@dataclass
class Scores:
    """The verifier's verdict on one rollout's samples: a reward each, and exact correctness if it has one."""

    rewards: torch.Tensor  # [N]: what the advantages come from
    accuracy: torch.Tensor | None = None  # [N] in {0, 1}
    components: dict[str, float] | None = None  # each reward function's mean, logged as reward/<name>
    total: torch.Tensor | None = None  # [N] the weighted sum logged as reward/mean, where ``rewards`` is not it
    metrics: dict[str, float] | None = None  # what the reward functions logged (TRL's log_metric), by name


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
    is_weight: float = 1.0  # --is-correction: the mean token weight
    is_truncated: float = 0.0  # --is-correction: tokens whose weight was outside [--is-min, --is-cap]
    off_policy_masked: float = 0.0  # --off-policy-mask-threshold: tokens taken out of the policy term
    trained_entropy: float = 0.0  # the mean entropy of the tokens the policy term trains (the entropy bonus's H)
    vespo_weight: float = 0.0  # --loss vespo: the mean weight phi(w) over the tokens (0 for the other losses)
    #: that H as this part's share, with its gradient (--entropy-coef)
    entropy_bonus: torch.Tensor | None = dataclasses.field(default=None, kw_only=True)

    @classmethod
    def of(cls, out: TokenLoss) -> LossReport:
        """The report of a token loss (:func:`pipeline.algorithm.token_grpo_loss`)."""
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
            out.off_policy_masked,
            out.trained_entropy,
            out.vespo_weight,
            entropy_bonus=out.entropy_bonus,
        )

    @classmethod
    def nothing(cls, device: torch.device) -> LossReport:
        """The report of no rows: every share zero (what a rank with no rows of a rollout adds)."""
        return cls(torch.zeros((), device=device), *(0.0 for _ in _SHARES))

    def figures(self) -> list[float]:
        """The shares that add up across a batch's parts, in a fixed order (the loss aside)."""
        return [float(getattr(self, name)) for name in _SHARES]

    @classmethod
    def from_figures(cls, loss: torch.Tensor, figures: list[float]) -> LossReport:
        """A report of ``loss`` and the shares :meth:`figures` lists."""
        if len(figures) != len(_SHARES):
            raise ValueError(f"a report has {len(_SHARES)} shares besides its loss, not {len(figures)}")
        return cls(loss, *figures)

    def add(self, other: LossReport) -> LossReport:
        """The report of this part and ``other`` together (the loss detached: each part was backpropagated)."""
        return LossReport(
            self.loss.detach() + other.loss.detach(),
            *(getattr(self, name) + getattr(other, name) for name in _SHARES),
        )

    def backpropagated(self) -> LossReport:
        """This report once its loss has been backpropagated: the figures, no graph (neither the loss's nor the
        entropy term's, which a loss without a bonus never traverses)."""
        return dataclasses.replace(self, loss=self.loss.detach(), entropy_bonus=None)

    def with_entropy_bonus(self, coef: float) -> LossReport:
        """This report with ``coef`` x its entropy term taken off the loss (the loss to minimise, and log)."""
        if self.entropy_bonus is None:
            raise ValueError("the loss reported no entropy_bonus (the trained tokens' mean entropy, differentiable)")
        return dataclasses.replace(self, loss=self.loss - coef * self.entropy_bonus)


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
    "off_policy_masked",
    "trained_entropy",
    "vespo_weight",
)


class Task:
    """What the pipeline learns; subclass it to train something else."""

    #: Hyper-parameters this task learns well with, used wherever the run does not set them.
    defaults: ClassVar[dict[str, float]] = {"lr": 2e-3, "kl_coeff": 0.02, "clip": 0.2}
    #: The evaluation metric the progress line shows and ``--target-score`` stops at.
    primary: ClassVar[str] = "accuracy"
    #: ``python -m pipeline.grpo`` stops once :attr:`primary` reaches this (None: run every step).
    target: ClassVar[float | None] = None
    #: Modules every role of this task imports (its model library): the launcher has the actors forkserver import
    #: them once, before it forks the roles (``actors.set_forkserver_preload``), so no role imports them itself.
    role_modules: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: Config) -> None:
        self.config = config
        self.seed = config.seed

    def build_policy(self) -> torch.nn.Module:
        """A freshly initialised policy (the trainer seeds torch first; every role builds the same one)."""
        raise NotImplementedError

    def forward_module(self, policy: torch.nn.Module) -> torch.nn.Module:
        """The module whose forward :meth:`loss` runs ``policy`` through: the root a sharded trainer shards under.

        ``policy`` itself unless the loss calls its parts apart; then a module
        holding it whose forward is what the loss calls.
        """
        return policy

    def sample(self, policy: torch.nn.Module, generator: torch.Generator, ticket: int = 0) -> Any:
        """One rollout's samples, drawn with ``policy``: a dataclass of tensors (behaviour log-probs included).

        ``ticket`` is the trainer step the rollout is for (a dataset's
        position: :meth:`pipeline.tasks.PromptData.rows_for`).
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
        batch: slice | None = None,
    ) -> LossReport:
        """The GRPO loss of one rollout for ``policy`` (``ref_logps`` None: no KL term, β = 0).

        ``rows`` (one of :meth:`micro_batches`) asks for those samples' share
        of the whole rollout's loss: normalisers and advantages come from
        every sample, so the shares' gradients add up to the whole's.
        ``batch`` (``--mini-batches``: the rows of one optimiser step, holding
        ``rows``) makes the loss that of those rows alone: normalisers over
        them, advantages still over the whole rollout.
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

    def evaluate_at(self, policy: torch.nn.Module, step: int) -> dict[str, float]:
        """:meth:`evaluate` after ``step`` updates: what the trainer calls. A task whose evaluation names the step
        (its reward functions' ``trainer_state``, its logs) overrides this; by default the step is not used."""
        return self.evaluate(policy)

    async def evaluate_at_async(self, policy: torch.nn.Module, step: int) -> dict[str, float]:
        """:meth:`evaluate_at` for the Trainer's event loop."""
        return await self.evaluate_async(policy)

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
