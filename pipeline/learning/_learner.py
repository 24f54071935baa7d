"""The trainer's half of GRPO, shared by the Trainer actor and the one-process baseline.

A :class:`Learner` owns the policy being trained, its optimiser and the
frozen reference weights (the policy as initialised), applies one update per
batch and evaluates on the task's held-out set. Keeping it out of the actor
means the pipeline and :func:`pipeline.learning.train_one_process` run the
same arithmetic, so their learning curves compare like for like.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from actors.tensors import is_sharded

from ..models import LoraAdapter, compile_blocks, hold_weights, weights_dtype
from ..tasks import LossReport, Task
from . import checkpoint
from ._fully_sharded import FullySharded

if TYPE_CHECKING:
    from ..config import Config
    from ._data_parallel import DataParallel


__all__ = ["Learner", "Update", "lr_factor"]


@dataclass
class Update:
    """One optimiser step's loss terms, gradient norm (before clipping), learning rate and duration."""

    report: LossReport
    grad_norm: float
    seconds: float
    lr: float = 0.0
    entropy_coef: float = 0.0  # the entropy bonus's coefficient after the step (adaptive: as it moved)


def lr_factor(config: Config) -> Callable[[int], float]:
    """The learning rate's multiplier at each optimiser step: linear warm-up, then constant or cosine to 0.

    Warm-up and length are counted in trainer steps (rollouts); a rollout
    takes ``num_iterations`` x ``mini_batches`` optimiser steps, so the schedule is stretched by them.
    """
    iterations = max(1, config.num_iterations) * max(1, config.mini_batches)
    warmup, total = config.warmup_steps * iterations, config.steps * iterations
    cosine = config.lr_schedule == "cosine"

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if not cosine:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


class Learner:
    """Policy + Adam (with its schedule) + reference weights for one task on one device.

    With ``parallel`` it is one rank of several: it trains its share of each
    rollout's rows and the ranks' gradients are summed before the step, so
    every rank takes the step one learner would (:mod:`._data_parallel`).
    """

    def __init__(
        self, task: Task, device: torch.device, parallel: DataParallel | None = None, *, stage_on_host: bool = False
    ) -> None:
        """``stage_on_host``: this learner will be sharded (:meth:`share_with` a FullySharded group), so build the
        policy and its reference copy in host memory; sharding moves this rank's shard, one block at a time, to
        ``device``, which never holds the whole model (one that fits the host but not one GPU)."""
        self.task = task
        self.device = device
        self.parallel = parallel
        self._home = torch.device("cpu") if stage_on_host else device  # where the whole policy lives until sharded
        config = task.config
        torch.manual_seed(task.seed)  # every run of a seed starts from the same policy
        self.policy = task.build_policy().to(self._home)
        #: The reference weights (the base: LoRA adapters start at 0), in host memory: read only to publish them,
        #: mix them every N steps and save them, never to compute (the RefModel role does). Empty without a KL term.
        self.reference_state = self._reference_copy(self.policy.state_dict())
        self.adapter = (
            LoraAdapter(self.policy, config.lora_r, config.lora_scale_alpha, config.lora_target_modules)
            if config.lora_r
            else None
        )
        self.optim, self.schedule = self._optimizer()
        self.micro_batch = config.micro_batch
        self.iterations = config.num_iterations
        self.mini_batches = max(1, config.mini_batches)
        if self.mini_batches > 1 and not _takes_batch(task):
            raise ValueError(
                f"--mini-batches {self.mini_batches}: {type(task).__name__}.loss takes no batch= (the rows of one "
                "optimiser step, whose loss it is): add it to train in mini-batches"
            )
        self.max_tokens = config.max_tokens_per_pass
        if config.gradient_checkpointing:
            enable = getattr(self.policy, "gradient_checkpointing_enable", None)
            if enable is None:
                name = type(self.policy).__name__
                raise ValueError(f"--gradient-checkpointing: a {name} cannot recompute its layers")
            enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if config.compile:  # after the adapters and checkpointing: the blocks compiled are the ones trained
            compile_blocks(self.policy)
        self.max_grad_norm = config.max_grad_norm if config.max_grad_norm > 0 else math.inf
        self.compute_dtype = getattr(torch, config.dtype)
        self.entropy = config.entropy_control()

    def _reference_copy(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` copied into host memory (tied tensors staying tied); empty when the run has no KL term."""
        if not self.task.config.hyper("kl_coeff") > 0:
            return {}
        if all(value.device.type == "cpu" for value in state.values()):
            return copy.deepcopy(state)
        return moved_state(state, torch.device("cpu"))

    def _optimizer(self) -> tuple[torch.optim.Adam, torch.optim.lr_scheduler.LambdaLR]:
        config = self.task.config
        trained = [p for p in self.policy.parameters() if p.requires_grad]  # with LoRA, only the adapters
        optim = torch.optim.Adam(trained, lr=config.hyper("lr"))
        return optim, torch.optim.lr_scheduler.LambdaLR(optim, lr_factor(config))

    def share_with(self, parallel: DataParallel) -> None:
        """From now on, train as one rank of ``parallel``'s group (a learner joins one group, once).

        A :class:`FullySharded` group shards the policy here; the optimizer is
        rebuilt over the shards, keeping its state and schedule. Every rank
        but 0 (the only one that publishes, mixes or saves the reference
        weights) drops its reference copy.
        """
        if self.parallel is not None:
            raise RuntimeError("this learner already trains as a rank of a group")
        if isinstance(parallel, FullySharded) and self.task.config.compile:
            raise RuntimeError("a learner with compiled blocks cannot be sharded (FSDP2): --trainer-shard ddp")
        self.parallel = parallel
        if parallel.share.rank != 0:
            self.reference_state = {}  # rank 0 alone publishes, mixes and saves it
        if not isinstance(parallel, FullySharded):
            return
        from . import _sharded_state

        moments = _sharded_state.moments(self.policy, self.optim) if self.optim.state else None
        schedule = self.schedule.state_dict()
        parallel.shard(self.policy, self.task.forward_module(self.policy), self.compute_dtype)
        self.optim, self.schedule = self._optimizer()
        if moments is not None:
            _sharded_state.restore_moments(self.policy, self.optim, moments)
        self.schedule.load_state_dict(schedule)
        self._rate_from_schedule()

    def _rate_from_schedule(self) -> None:
        """Set the optimizer's rate to this run's schedule at the step it is at. A checkpoint's optimizer brings
        the rate the saved run's schedule set; resumed with another ``--steps`` (or schedule), the first step
        trained at that rate (a cosine run resumed to twice its steps took a step at lr 0)."""
        factor = self.schedule.lr_lambdas[0](self.schedule.last_epoch)
        for group, base in zip(self.optim.param_groups, self.schedule.base_lrs, strict=True):
            group["lr"] = base * factor

    @property
    def sharded(self) -> bool:
        """Whether this learner holds a shard of the policy (every call that reads it whole is a collective)."""
        return isinstance(self.parallel, FullySharded)

    def _precision(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast to the run's compute dtype (nothing for float32): the parameters stay in their own.

        Sharded, FSDP2 computes in that dtype itself (:meth:`FullySharded.shard`): no autocast.
        """
        if self.compute_dtype == torch.float32 or self.sharded:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _casts_kept(self) -> contextlib.ExitStack:
        """One optimiser step's scope for autocast's casts: each weight is cast to the compute dtype once a step.

        Autocast keeps a weight's cast until its outermost context closes, so a
        step whose passes each opened their own cast every weight again each
        pass (on an H100, 38 ms of the 0.5 B shape's 530 ms update). Inside this
        scope autocast is open but off: each pass's forward turns it on
        (:meth:`_precision`, nested, so the casts stay), and its backward runs
        with it off, as outside any autocast. The weights do not change between
        the passes of one step, so each pass computes exactly what it did.
        """
        stack = contextlib.ExitStack()
        if self.compute_dtype != torch.float32 and not self.sharded:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.compute_dtype))
            stack.enter_context(torch.autocast(self.device.type, enabled=False))
        return stack

    def update(self, samples: Any, rewards: torch.Tensor, ref_logps: torch.Tensor | None) -> Update:
        """One GRPO step on ``samples`` (already on this device): ``num_iterations`` x ``mini_batches`` optimiser
        steps on them.

        Each iteration takes one optimiser step on each mini-batch in turn (the
        whole rollout, unless ``--mini-batches`` splits it), every ratio to the
        behaviour log-probs: after the first step the policy has moved and the
        clip bounds how far. The report's figures are the steps' means, but
        ``logp_diff`` is the first's (the trainer against the behaviour policy
        before this rollout's update); ``lr`` is the last step's rate.
        """
        started = time.perf_counter()
        torch.manual_seed(self._step_seed())
        batches = self._mini_batches(samples)
        done = [
            self._iterate(samples, rewards, ref_logps, batch)
            for _ in range(max(1, self.iterations))
            for batch in batches
        ]
        reports, norms, rates = zip(*done, strict=True)
        report = reports[0]
        if len(reports) > 1:
            figures = [sum(column) / len(reports) for column in zip(*(r.figures() for r in reports), strict=True)]
            report = LossReport.from_figures(torch.stack([r.loss for r in reports]).mean(), figures)
            report.logp_diff = reports[0].logp_diff
        seconds = time.perf_counter() - started
        return Update(report, sum(norms) / len(norms), seconds, rates[-1], self.entropy.coef)

    def _step_seed(self) -> int:
        """The seed of this update's randomness (dropout kept, a task's own draws): the run's seed, the optimiser
        steps taken so far (a checkpoint restores them, with the schedule) and this rank. A resumed run draws what
        the uninterrupted one would; the random state itself is in no checkpoint (nor the same on every rank)."""
        rank = self.parallel.share.rank if self.parallel is not None else 0
        steps = int(self.schedule.last_epoch)
        return ((self.task.seed * 1_000_003 + steps) * 65_537 + rank) % 2**63

    def _mini_batches(self, samples: Any) -> list[slice | None]:
        """The rows of each optimiser step of an iteration: the whole rollout, or ``mini_batches`` equal parts."""
        if self.mini_batches == 1:
            return [None]
        name = type(self.task).__name__
        rows = self.task.rows(samples)
        if rows is None or rows % self.mini_batches:
            raise ValueError(
                f"--mini-batches {self.mini_batches}: {name}'s rollout of {rows} rows does not split evenly"
            )
        size = rows // self.mini_batches
        return [slice(start, start + size) for start in range(0, rows, size)]

    def _passes(self, samples: Any, batch: slice | None) -> list[slice]:
        """The forward/backward passes of one optimiser step: the task's micro-batches, or (a mini-batch) its rows
        in passes no larger than the task's."""
        passes = self.task.micro_batches(samples, self.micro_batch, self.max_tokens)
        if batch is None:
            return passes
        rows = self.task.rows(samples)
        assert rows is not None  # _mini_batches split them
        size = max(len(range(*part.indices(rows))) for part in passes)
        first, last, _ = batch.indices(rows)
        return [slice(start, min(start + size, last)) for start in range(first, last, size)]

    def _loss(
        self, samples: Any, rewards: torch.Tensor, ref_logps: torch.Tensor | None, rows: slice, batch: slice | None
    ) -> LossReport:
        """The task's loss of ``rows`` (of the mini-batch ``batch``), less the entropy bonus where the run has one."""
        with self._precision():
            if batch is None:  # a task written before mini-batches takes no batch
                report = self.task.loss(self.policy, samples, rewards, ref_logps, rows)
            else:
                report = self.task.loss(self.policy, samples, rewards, ref_logps, rows, batch=batch)
        if not self.entropy.active:
            return report
        if report.entropy_bonus is None:
            raise ValueError(
                f"--entropy-coef: {type(self.task).__name__}.loss reported no entropy_bonus (the trained tokens' mean "
                "entropy, with its gradient)"
            )
        return report.with_entropy_bonus(self.entropy.applied())

    def _iterate(
        self, samples: Any, rewards: torch.Tensor, ref_logps: torch.Tensor | None, batch: slice | None
    ) -> tuple[LossReport, float, float]:
        """One optimiser step on ``samples`` (its mini-batch ``batch``, or all), in micro-batches if the run asks
        for them: its report, gradient norm (before clipping) and learning rate."""
        self.optim.zero_grad()
        total: LossReport | None = None
        passes = self._passes(samples, batch)
        idle: list[slice] = []
        if self.parallel is not None:
            count = self.task.rows(samples)
            passes, idle = (
                self.parallel.passes(passes, count, batch),
                self.parallel.idle_passes(passes, count, batch),
            )
        with self._casts_kept():
            for rows in passes:
                report = self._loss(samples, rewards, ref_logps, rows, batch)
                report.loss.backward()  # type: ignore[no-untyped-call]
                report = report.backpropagated()
                total = report if total is None else total.add(report)
            for rows in idle:  # in step with busier ranks: the same collectives, nothing learnt
                report = self._loss(samples, rewards, ref_logps, rows, batch)
                (report.loss * 0.0).backward()  # type: ignore[no-untyped-call]
        if self.parallel is not None:
            self.parallel.sum_gradients(self.policy)
            total = self.parallel.sum_report(total)
        if total is None:
            raise ValueError(f"{type(self.task).__name__}.micro_batches gave no rows to train on")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
        if is_sharded(grad_norm):  # the norm over every rank's shards
            grad_norm = grad_norm.full_tensor()  # type: ignore[attr-defined]
        lr = self.optim.param_groups[0]["lr"]
        self.optim.step()
        self.schedule.step()
        self.entropy.observe(total.trained_entropy)  # every rank the same: the summed report's
        return total, float(grad_norm), float(lr)

    def mix_reference(self, alpha: float) -> None:
        """The reference weights become ``alpha`` x the policy + (1 - ``alpha``) x themselves (TRL's ref sync).

        In place, each storage once (a tied head shares its embedding's);
        integer buffers are left as they are. An unsharded learner only.
        """
        if self.sharded:
            raise RuntimeError("a sharded learner's policy is in shards; its reference is whole: mix unsharded")
        policy = self.policy.state_dict()
        mixed: set[int] = set()
        with torch.no_grad():
            for name, reference in self.reference_state.items():
                if not reference.is_floating_point() or reference.data_ptr() in mixed:
                    continue
                mixed.add(reference.data_ptr())
                reference.mul_(1.0 - alpha).add_(policy[name].to(reference.device, reference.dtype), alpha=alpha)

    def evaluate(self, step: int = -1) -> dict[str, float]:
        """The task's held-out metrics for the current policy after ``step`` updates (sharded: a collective every
        rank runs)."""
        whole = self.parallel.whole_root() if self.parallel is not None else contextlib.nullcontext()
        with whole, self._eager():
            return self._with_primary(self.task.evaluate_at(self.policy, step))

    async def evaluate_async(self, step: int = -1) -> dict[str, float]:
        """:meth:`evaluate` on an event loop (the task's reward functions are awaited); a replica's only."""
        if self.sharded:
            raise RuntimeError("a sharded learner evaluates with every rank at once: call evaluate() off the loop")
        with self._eager():
            return self._with_primary(await self.task.evaluate_at_async(self.policy, step))

    def _eager(self) -> contextlib.AbstractContextManager[Any]:
        """With ``--compile``, the evaluation's decoding runs the blocks eagerly: compiling them again for a KV
        cache's passes (other graphs, every evaluation's shapes) would cost more than it saves."""
        if not self.task.config.compile:
            return contextlib.nullcontext()
        return torch.compiler.set_stance("force_eager")  # type: ignore[no-any-return]

    def _with_primary(self, metrics: dict[str, float]) -> dict[str, float]:
        """The task's held-out metrics as plain floats (a numpy scalar or a one-element tensor is taken: the rows'
        JSON, the trackers and the checkpoint keep floats), its primary one among them."""
        name = type(self.task).__name__
        if not isinstance(metrics, dict):
            raise TypeError(
                f"{name}.evaluate must return a dict of metric name -> number, got {type(metrics).__name__}"
            )
        if self.task.primary not in metrics:
            raise KeyError(f"{name}.evaluate must report {self.task.primary!r}")
        plain: dict[str, float] = {}
        for key, value in metrics.items():
            try:
                if isinstance(value, (bool, str, bytes)) or not isinstance(key, str):
                    raise TypeError
                plain[key] = float(value)
            except (TypeError, ValueError, RuntimeError):  # (RuntimeError: a tensor of several elements)
                raise TypeError(
                    f"{name}.evaluate's metric {key!r} must be a number under a str name, got {type(value).__name__}"
                ) from None
        return plain

    def reference(self) -> torch.nn.Module:
        """A frozen copy of the initial policy (the one-process baseline's RefModel), its weights in the run's dtype
        as the RefModel role holds them."""
        model = self.task.build_policy().to(self.device)
        model.load_state_dict(self.reference_state)
        return hold_weights(model, self.device, weights_dtype(self.task.config.dtype)).requires_grad_(False).eval()

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of an unsharded learner, whole.

        A sharded learner saves its shards instead (:meth:`save_shards`, :meth:`small_state`).
        """
        if self.sharded:
            raise RuntimeError("a sharded learner's checkpoint is its shards: save_shards() and small_state()")
        return {"policy": self.policy.state_dict(), "optimizer": self.optim.state_dict(), **self.small_state()}

    def small_state(self) -> dict[str, Any]:
        """The part of a checkpoint that is not the policy or its optimizer: the schedule, the reference weights,
        the entropy bonus's coefficient."""
        return {"schedule": self.schedule.state_dict(), "ref": self.reference_state, "entropy": self.entropy.state()}

    def save_shards(self, folder: str) -> None:
        """Write the policy and optimizer into ``folder`` with ``torch.distributed.checkpoint``: every rank its shards.

        A collective of a sharded group (each rank writes only what it holds);
        unsharded, this process writes them whole. Rank 0 then checks that
        every rank's file is in ``folder`` (ranks on other hosts need it shared)
        and every rank raises if one is not (rank 0 alone raising left the
        others waiting in the next collective until its timeout).
        """
        from . import _sharded_state

        _sharded_state.save_shards(self.policy, self.optim, folder)
        missing = _sharded_state.missing_files(folder) if not self.parallel or self.parallel.share.rank == 0 else []
        fix = "give --run-dir a folder every trainer host shares, or --trainer-shard ddp"
        if missing:
            if self.parallel is not None:
                self.parallel.any_rank(True)
            raise RuntimeError(
                f"the checkpoint's shards {', '.join(missing)} are not in {folder}: ranks on other hosts wrote them "
                f"to their own disks; {fix}"
            )
        if self.parallel is not None and self.parallel.any_rank(False):
            raise RuntimeError(
                f"rank 0 found the checkpoint's shards missing from its {folder}: the ranks wrote them to disks of "
                f"their own; {fix}"
            )

    def load_shards(self, folder: str) -> None:
        """Load the policy and optimizer :meth:`save_shards` wrote, whatever the number of ranks that wrote them.

        Sharded, every rank reads the parts of the shards that fall in its own;
        unsharded (before any group forms), this process reads them whole.
        """
        from . import _sharded_state

        _sharded_state.load_shards(self.policy, self.optim, folder)
        self._rate_from_schedule()

    def whole_policy_state(self) -> dict[str, torch.Tensor]:
        """The policy's tensors whole (sharded: gathered into rank 0's host memory, every rank calling)."""
        if not self.sharded:
            return self.policy.state_dict()
        from . import _sharded_state

        return _sharded_state.whole_policy_state(self.policy)

    def published(self) -> torch.nn.Module | dict[str, torch.Tensor]:
        """What generators install: the policy, or with LoRA adapters its merged weights under the plain names."""
        return self.policy if self.adapter is None else self.adapter.merged_state()

    def exported(self) -> torch.nn.Module:
        """The policy as transformers loads it: itself, or with LoRA a plain copy holding the merged weights."""
        return self.policy if self.adapter is None else self.whole_policy(self.adapter.merged_state())

    def whole_policy(self, policy_state: dict[str, torch.Tensor]) -> torch.nn.Module:
        """A host copy of the policy built from :meth:`whole_policy_state`'s tensors, for a sharded learner's export."""
        model = self.task.build_policy()
        model.load_state_dict(policy_state)
        return model

    def resume(self, run_dir: str, *, shard_later: bool = False) -> tuple[dict[str, Any], str | None]:
        """Load ``run_dir``'s checkpoint; its state (step, version, ...) and the shards still to load, if any.

        A sharded checkpoint's policy and optimizer are loaded here, unless
        ``shard_later`` (this learner will join a sharded group): then the
        caller loads them with :meth:`load_shards` after :meth:`share_with`,
        every rank at once.
        """
        state = checkpoint.load(run_dir)
        self.load_state(state)
        shards = checkpoint.shards_of(run_dir, state)
        if shards is not None and not shard_later:
            self.load_shards(shards)
            shards = None
        return state, shards

    def load_state(self, state: dict[str, Any]) -> None:
        """Load a checkpoint's state into this (unsharded) learner: any number of ranks may have saved it.

        A sharded checkpoint's ``checkpoint.pt`` holds only the small state;
        its policy and optimizer come from :meth:`load_shards`.
        """
        if self.sharded:
            raise RuntimeError("load a checkpoint before the learner joins a sharded group")
        if "policy" in state:
            self.policy.load_state_dict(state["policy"])
            self.optim.load_state_dict(state["optimizer"])
        if "schedule" in state:  # checkpoints from before schedules had none: constant
            self.schedule.load_state_dict(state["schedule"])
        self._rate_from_schedule()
        if "entropy" in state and self.entropy.adaptive:  # a fixed coefficient is the run's setting, not state
            self.entropy.load(state["entropy"])
        self.reference_state = self._reference_copy(state.get("ref") or self.policy.state_dict())


def moved_state(state: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``state`` on ``device``, a tensor that several names share (a tied embedding and head) moved once and
    still shared: moved name by name it became two copies (545 MB more for a 0.5 B Qwen2's embedding)."""
    moved: dict[tuple[Any, ...], torch.Tensor] = {}
    out = {}
    for name, tensor in state.items():
        key = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
        if key not in moved or tensor.numel() == 0:
            moved[key] = tensor.to(device)
        out[name] = moved[key]
    return out


def _takes_batch(task: Task) -> bool:
    """Whether ``task.loss`` accepts ``batch=`` (the rows of one optimiser step), by name or as a keyword catch-all."""
    parameters = inspect.signature(task.loss).parameters.values()
    return any(p.name == "batch" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
