"""The Generator role: draws rollouts with the newest policy it has installed, one per ticket the trainer grants."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import torch

from actors import (
    CallTimeout,
    Channel,
    Port,
    ReceivesWeights,
    WeightManifest,
    current_rank,
    endpoint,
    host_id,
)

from ..config import Config
from ..models import hold_weights, weights_dtype
from ..tasks import load_task, to_device
from ._devices import (
    CPU,
    compact_gpu_allocator,
    peak_gpu_gb,
    reserved_gpu_gb,
    role_device,
    sampling_seed,
)
from ._messages import WAKE, GeneratorTimes, Grant, Rollout

__all__ = ["Generator"]


class Generator(ReceivesWeights):
    """Samples rollouts with the newest policy it has installed.

    Produces only against tickets (``Grant``) from the trainer, one rollout
    each, so it never runs more than ``max_inflight`` rollouts ahead; before
    each it installs at least the policy version its ticket names, so no
    rollout is older than ``max_staleness`` versions when it is trained
    (:mod:`pipeline.roles`). Hooks registered with
    ``register_pre_collect_hook`` / ``register_post_collect_hook`` run in
    this process around each rollout; their exceptions end ``run``.
    """

    def __init__(self, config: Config, rollouts: Port[Rollout], initial: WeightManifest | None = None) -> None:
        self.config = config
        logging.getLogger("pipeline.models").setLevel(logging.INFO)  # the engine says once how it decodes
        self.task = load_task(config)
        self.id = current_rank().rank
        self.device = role_device(config, "generator")
        compact_gpu_allocator(self.device)  # before the weights: every segment of this process can grow in place
        policy = hold_weights(self.task.build_policy(), self.device, weights_dtype(config.dtype))
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
        started, began = time.perf_counter(), time.time()
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
                self.times.delivery = max(0.0, began - published)  # (to the start of the install)

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
            waiting, installing = time.perf_counter(), self.times.install
            grant = await self.next_grant()
            if grant is not None:
                await self.reach_version(grant.min_version)
            # (the installs reach_version made are install time, not waiting)
            self.times.wait += time.perf_counter() - waiting - (self.times.install - installing)
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
        Waits at most ``Config.weights_timeout`` s for each update (a trainer
        that dies is noticed at once: its pidfd on this host, the launcher's
        supervision).
        """
        while self.version < version and not self.stopping:
            await self.install_weights()
            if self.version >= version:
                return
            arrived = asyncio.ensure_future(self.weight_inbox.wait(self.config.weights_timeout))
            stopped = asyncio.ensure_future(self._stopped.wait())
            try:
                await asyncio.wait([arrived, stopped], return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in (arrived, stopped):
                    wait.cancel()  # (a finished one ignores it)
                # Let both unwind. asyncio.wait raises neither one's exception, and a cancel of this task that comes
                # meanwhile (Ctrl-C, a drain's guard) propagates: suppressing around an await would swallow it.
                await asyncio.wait([arrived, stopped])
            failure = arrived.exception() if arrived.done() and not arrived.cancelled() else None
            if isinstance(failure, CallTimeout) and not self.stopping:
                raise CallTimeout(
                    f"generator {self.id} waited {self.config.weights_timeout:g}s for policy version {version} "
                    f"(it has {self.version}) and the trainer published none newer: raise --weights-timeout if "
                    "the trainer's pauses (an evaluation, a checkpoint, a generator's restart) last longer"
                ) from failure
            if failure is not None and not self.stopping:
                raise failure  # a dead publisher (a drain that came with either wins: nothing is lost)

    @endpoint
    async def drain(self) -> None:
        """Stop producing; ``run`` sends the end-of-stream sentinel and returns."""
        self.stopping = True
        self._stopped.set()
        self.grant_port.send(Grant(WAKE))  # wake a loop waiting for a ticket
