"""The rollout side of GRPO: Generator, Scorer and RefModel, each an actor in its own process.

::

    Generator xN --Rollout--> Scorer --ScoredRollout--> RefModel --ScoredRollout (+ ref_logps)--> Trainer
         ^   ^                   (β = 0: no RefModel; the scorer feeds the trainer)                |
         |   +------------ Grant: a ticket for one rollout, with its oldest allowed version -----+
         +---------- update_weights(manifest), fire-and-forget ------------------------------------+

The :class:`~pipeline.trainer.Trainer` lives in :mod:`pipeline.trainer`.
Each role asks the run's :class:`~pipeline.task.Task` what to do (sample,
verify, score against the reference, compute the loss), so the roles know
only about messages, timing and weights. Every role is an ordinary
subclassable actor: override ``collect`` (Generator), ``score`` (Scorer),
``reference_logps`` (RefModel) or ``train_step`` (Trainer), or swap the
task with ``Config.task``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import Callable

import torch

from actors import (
    Actor,
    Channel,
    Port,
    ReceivesWeights,
    WeightConsumer,
    WeightManifest,
    current_rank,
    endpoint,
    host_id,
)

from .messages import WAKE, Config, GeneratorTimes, Grant, Rollout, ScoredRollout
from .task import Scores, load_task, to_device

__all__ = [
    "Generator",
    "RefModel",
    "Scorer",
    "compact_gpu_allocator",
    "hold_weights",
    "peak_gpu_gb",
    "reserved_gpu_gb",
    "role_device",
    "sampling_seed",
    "uses_reference",
    "weights_dtype",
]

#: How long a generator waits for the policy version a grant requires.
WEIGHTS_TIMEOUT = 60.0
CPU = torch.device("cpu")


def sampling_seed(seed: int, ticket: int) -> int:
    """The seed of rollout ``ticket``'s sampling: the same whichever generator draws it, and when."""
    return (1_000_003 * (seed + 1) + 7_919 * (ticket + 1)) % (2**63)


def uses_reference(config: Config) -> bool:
    """Whether the run has a KL term, so a RefModel (β = 0: no reference process, no reference pass)."""
    return config.hyper("kl_coeff") > 0


def weights_dtype(config: Config) -> torch.dtype:
    """The dtype generators and the reference hold, and updates carry: the run's (the trainer keeps float32)."""
    return torch.bfloat16 if config.dtype == "bfloat16" else torch.float32


def hold_weights(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` on ``device`` with its weights in ``dtype``: parameters and saved buffers, nothing else.

    Buffers a model does not save (a rotary embedding's inverse frequencies)
    are derived constants it keeps in float32 whatever its weights' dtype, as
    ``from_pretrained(dtype=...)`` leaves them: in bfloat16 they would shift
    every position's angle, more the longer the sequence.
    """
    model = model.to(device)
    if dtype == torch.float32:
        return model
    saved = set(model.state_dict())
    for parameter in model.parameters():
        if parameter.is_floating_point():
            parameter.data = parameter.data.to(dtype)
    for module_name, module in model.named_modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            full = f"{module_name}.{name}" if module_name else name
            if buffer is not None and buffer.is_floating_point() and full in saved:
                setattr(module, name, buffer.to(dtype))
    return model


def peak_gpu_gb(device: torch.device) -> float | None:
    """The most GPU memory torch's allocator has held for tensors on ``device`` in this process (GiB); None on a CPU."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def reserved_gpu_gb(device: torch.device) -> float | None:
    """The most GPU memory torch's caching allocator has reserved from the driver on ``device`` (GiB); None on a CPU.

    What processes sharing a GPU compete for: it includes freed blocks the
    allocator keeps cached, which no other process can use.
    """
    return torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None


#: The variables torch reads its allocator's settings from (the second is the older name).
ALLOCATOR_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def compact_gpu_allocator(device: torch.device) -> bool:
    """Have torch's caching allocator on ``device`` grow its segments in place (``expandable_segments``).

    Without it a KV cache that grows a token at a time asks for a new segment
    at each size and keeps the smaller ones cached: a 256 x 256-token rollout
    of a 0.5 B model reserved 29 GB for about 2 GB of tensors, and the trainer
    sharing the GPU ran out of memory (H100, 2026-11-26). Only for processes
    that export no CUDA IPC memory (generators, the reference): the trainer's
    published slots keep ordinary segments. Leaves a user's own setting of
    either allocator variable alone; returns whether it changed anything.
    """
    if device.type != "cuda" or any(os.environ.get(name) for name in ALLOCATOR_VARIABLES):
        return False
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch before the accelerator-wide allocator settings
        setter = torch.cuda.memory._set_allocator_settings
    setter("expandable_segments:True")
    return True


def role_device(config: Config, role: str) -> torch.device:
    """The role's device, with torch limited to the run's threads (every role is one process of many)."""
    torch.set_num_threads(config.threads)
    return torch.device(config.device_of(role))


class Generator(ReceivesWeights):
    """Samples rollouts with the newest policy it has installed.

    Produces only against tickets (``Grant``) from the trainer, one rollout
    each, so it never runs more than ``max_inflight`` rollouts ahead; before
    each it installs at least the policy version its ticket names, so no
    rollout is older than ``max_staleness`` versions when it is trained
    (:mod:`pipeline.tickets`). Hooks registered with
    ``register_pre_collect_hook`` / ``register_post_collect_hook`` run in
    this process around each rollout; their exceptions end ``run``.
    """

    def __init__(self, config: Config, rollouts: Port[Rollout], initial: WeightManifest | None = None) -> None:
        self.config = config
        self.task = load_task(config)
        self.id = current_rank().rank
        self.device = role_device(config, "generator")
        compact_gpu_allocator(self.device)  # before the weights: every segment of this process can grow in place
        policy = hold_weights(self.task.build_policy(), self.device, weights_dtype(config))
        self.policy = policy.requires_grad_(False).eval()
        self.engine = self.task.build_engine(self.policy)
        self.rollouts = rollouts
        seed = 1_000_003 * (config.seed + 1) + 7_919 * (self.id + 1)
        self.rng = torch.Generator(device=self.device).manual_seed(seed)
        self.grant_port, self.grants = Channel.open(Grant)
        if initial is not None:  # else the first grant brings the policy
            self.weight_inbox.put(initial)
        self.version = -1
        self.produced = 0
        self.stopping = False
        self._stopped = asyncio.Event()
        self.times = GeneratorTimes()
        self._cycle_started = time.perf_counter()
        self.pre_collect_hooks: list[Callable[[Generator], None]] = []
        self.post_collect_hooks: list[Callable[[Generator, Rollout], None]] = []

    def register_pre_collect_hook(self, hook: Callable[[Generator], None]) -> None:
        self.pre_collect_hooks.append(hook)

    def register_post_collect_hook(self, hook: Callable[[Generator, Rollout], None]) -> None:
        self.post_collect_hooks.append(hook)

    @endpoint
    async def grant_inlet(self) -> Port[Grant]:
        return self.grant_port

    @endpoint
    async def host(self) -> str:
        """This generator's host (:func:`actors.host_id`): the trainer picks the weight transport by it."""
        return host_id()

    async def install_weights(self) -> None:
        """Install the newest update waiting in the inbox, if any, and time it (a ``tcp`` fetch is awaited)."""
        started = time.perf_counter()
        alias = self.config.install == "alias"
        if self.engine is not None:  # the engine decides how an update reaches the parameters it samples with
            manifest = await self.engine.load_weights(self.weight_inbox, alias=alias)
        else:
            manifest = await self.weight_inbox.install_newest_async(self.policy, alias=alias)
        if manifest is not None:
            self.version = manifest.version
            self.times.install += time.perf_counter() - started
            published = manifest.metadata.get("published_at")
            if isinstance(published, float):
                self.times.delivery = max(0.0, time.time() - published)

    def collect(self, ticket: int = -1) -> Rollout:
        """One rollout drawn with the current policy for ``ticket`` (its samples sent as CPU tensors)."""
        started = time.perf_counter()
        if ticket >= 0:  # a rollout's randomness follows its ticket: restarts and resumed runs draw it again alike
            self.rng.manual_seed(sampling_seed(self.config.seed, ticket))
        samples = to_device(self.task.sample(self.policy, self.rng, ticket=ticket), CPU)
        self.times.generate = time.perf_counter() - started
        tokens, length = self.task.measure(samples)
        return Rollout(
            self.id,
            self.produced,
            self.version,
            samples,
            tokens,
            length,
            self.times,
            ticket,
            peak_gpu_gb(self.device),
            reserved_gpu_gb(self.device),
        )

    @endpoint
    async def run(self) -> int:
        """Produce a rollout per ticket until drained; returns how many were sent."""
        while not self.stopping:
            waiting = time.perf_counter()
            grant = await self.next_grant()
            if grant is not None:
                await self.reach_version(grant.min_version)
            self.times.wait += time.perf_counter() - waiting
            if grant is None or self.stopping:
                break
            await self.install_weights()
            for hook in self.pre_collect_hooks:
                hook(self)
            rollout = self.collect(grant.ticket)
            for post in self.post_collect_hooks:
                post(self, rollout)
            now = time.perf_counter()
            rollout.times.cycle = now - self._cycle_started
            self.rollouts.send(rollout)
            self._cycle_started, self.times = now, GeneratorTimes()
            self.produced += 1
            await asyncio.sleep(0)  # let update_weights and drain land between rollouts
        self.rollouts.send(None)
        return self.produced

    async def next_grant(self) -> Grant | None:
        """The next ticket, its weights (if it brings some) put in the inbox; None once draining."""
        while not self.stopping:
            grant = await self.grants.recv()
            if grant is None or grant.ticket < 0:  # a wake-up (drain)
                continue
            if grant.manifest is not None:
                self.weight_inbox.put(grant.manifest)
            return grant
        return None

    async def reach_version(self, version: int) -> None:
        """Install weights until the policy is at least ``version`` (a ticket's condition), or until drained.

        The trainer sends every generator the versions its tickets need, as
        soon as they are published; if one is stale by the time it is
        installed (its slot reused by newer versions), a newer one follows.
        Waits at most ``WEIGHTS_TIMEOUT`` s for each update.
        """
        while self.version < version and not self.stopping:
            await self.install_weights()
            if self.version >= version:
                return
            arrived = asyncio.ensure_future(self.weight_inbox.wait(WEIGHTS_TIMEOUT))
            stopped = asyncio.ensure_future(self._stopped.wait())
            try:
                await asyncio.wait([arrived, stopped], return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopped.cancel()
                if not arrived.done():
                    arrived.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await stopped
                with contextlib.suppress(asyncio.CancelledError):
                    await arrived
            if arrived.done() and not arrived.cancelled():
                arrived.result()  # a timeout or a dead publisher is raised here

    @endpoint
    async def drain(self) -> None:
        """Stop producing; ``run`` sends the end-of-stream sentinel and returns."""
        self.stopping = True
        self._stopped.set()
        self.grant_port.send(Grant(WAKE))  # wake a loop waiting for a ticket


class Scorer(Actor):
    """Scores each rollout with the task's verifier (or reward model)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.task = load_task(config)
        self.device = role_device(config, "scorer")
        self.scorer = self.task.build_scorer(self.device)
        self.port, self.inbox = Channel.open(Rollout)

    @endpoint
    async def inlet(self) -> Port[Rollout]:
        return self.port

    async def score(self, rollout: Rollout) -> Scores:
        return await self.task.score_async(self.scorer, to_device(rollout.samples, self.device))

    @endpoint
    async def run(self, out: Port[ScoredRollout]) -> int:
        count = 0
        while (rollout := await self.inbox.recv()) is not None:
            scores = await self.score(rollout)
            accuracy = None if scores.accuracy is None else scores.accuracy.cpu()
            components = scores.components or {}
            out.send(
                ScoredRollout(rollout, scores.rewards.cpu(), accuracy, self.inbox.qsize(), reward_components=components)
            )
            count += 1
        out.send(None)
        return count


class RefModel(Actor):
    """Adds the frozen initial policy's log-probabilities of each rollout's samples."""

    def __init__(self, config: Config, initial: WeightManifest) -> None:
        self.config = config
        self.task = load_task(config)
        self.device = role_device(config, "ref")
        compact_gpu_allocator(self.device)
        model = hold_weights(self.task.build_policy(), self.device, weights_dtype(config))
        self.model = model.requires_grad_(False).eval()
        consumer = WeightConsumer()
        consumer.install(initial, self.model)
        consumer.close()
        self.port, self.inbox = Channel.open(ScoredRollout)

    @endpoint
    async def inlet(self) -> Port[ScoredRollout]:
        return self.port

    def reference_logps(self, rollout: Rollout) -> torch.Tensor:
        return self.task.reference_logps(self.model, to_device(rollout.samples, self.device)).cpu()

    @endpoint
    async def run(self, out: Port[ScoredRollout]) -> int:
        count = 0
        while (scored := await self.inbox.recv()) is not None:
            ref = self.reference_logps(scored.rollout)
            out.send(dataclasses.replace(scored, ref_logps=ref, ref_queue=self.inbox.qsize()))
            count += 1
        out.send(None)
        return count
