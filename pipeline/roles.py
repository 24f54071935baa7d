"""The four GRPO roles, each an actor in its own process, linked by typed ports.

::

    Generator xN --Rollout--> Scorer --ScoredRollout--> RefModel --RefScoredRollout--> Trainer
         ^   ^                                                                            |
         |   +------------ Grant (credits: bounded rollouts in flight) -------------------+
         +---------- update_weights(manifest), fire-and-forget to one chosen generator ---+

Every role is an ordinary subclassable actor: override ``collect`` (Generator),
``score`` (Scorer), ``reference_logps`` (RefModel) or ``train_step``
(Trainer), or swap the task with ``Config.task``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib
import time
from collections.abc import Callable
from typing import Any

import torch

from actors import (
    Actor,
    ActorDied,
    Channel,
    Port,
    PortClosed,
    ReceivesWeights,
    WeightConsumer,
    WeightManifest,
    WeightPublisher,
    current_rank,
    endpoint,
    send,
)

from . import checkpoint
from .messages import Config, Grant, RefScoredRollout, Rollout, ScoredRollout, StepReport
from .task import BanditTask, grpo_loss

__all__ = ["Generator", "RefModel", "Scorer", "Trainer", "load_task"]

#: Step reports the trainer gathers before sending them to the controller.
REPORT_BATCH = 25
#: How long a generator waits for the policy version a grant requires.
WEIGHTS_TIMEOUT = 60.0


def load_task(config: Config) -> BanditTask:
    """Instantiate ``config.task`` (``"module:Class"``) with the run's seed."""
    module_name, _, qualname = config.task.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    task = obj(config.seed)
    if not isinstance(task, BanditTask):
        raise TypeError(f"{config.task} must derive from pipeline.task.BanditTask")
    return task


def _logps(policy: torch.nn.Module, state: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(policy(state), dim=-1)[actions]


class Generator(ReceivesWeights):
    """Samples GRPO groups with the newest policy it has installed.

    Produces only against credits (``Grant``) from the trainer, so it can
    never run more than ``max_inflight`` rollouts ahead. Hooks registered
    with ``register_pre_collect_hook`` / ``register_post_collect_hook`` run
    in this process around each rollout; their exceptions end ``run``.
    """

    def __init__(self, config: Config, rollouts: Port[Rollout], initial: WeightManifest) -> None:
        self.config = config
        self.task = load_task(config)
        self.id = current_rank().rank
        self.device = torch.device(config.device_of("generator"))
        self.policy = self.task.build_policy().to(self.device).requires_grad_(False)
        self.rollouts = rollouts
        seed = 1_000_003 * (config.seed + 1) + 7_919 * (self.id + 1)
        self.rng = torch.Generator(device=self.device).manual_seed(seed)
        self.grant_port, self.grants = Channel.open(Grant)
        self.weight_inbox.put(initial)
        self.version = -1
        self.credits = 0
        self.produced = 0
        self.stopping = False
        self.pre_collect_hooks: list[Callable[[Generator], None]] = []
        self.post_collect_hooks: list[Callable[[Generator, Rollout], None]] = []

    def register_pre_collect_hook(self, hook: Callable[[Generator], None]) -> None:
        self.pre_collect_hooks.append(hook)

    def register_post_collect_hook(self, hook: Callable[[Generator, Rollout], None]) -> None:
        self.post_collect_hooks.append(hook)

    @endpoint
    async def grant_inlet(self) -> Port[Grant]:
        return self.grant_port

    def install_weights(self) -> None:
        manifest = self.weight_inbox.install_newest(self.policy, alias=self.config.install == "alias")
        if manifest is not None:
            self.version = manifest.version

    def collect(self) -> Rollout:
        """One group: a state and G actions sampled from the current policy (sent as CPU tensors)."""
        state = self.task.sample_state(self.rng)
        actions, logps = self.task.sample_group(self.policy, state, self.rng)
        return Rollout(self.id, self.produced, self.version, state.cpu(), actions.cpu(), logps.cpu())

    @endpoint
    async def run(self) -> int:
        """Produce rollouts until drained; returns how many were sent."""
        while not self.stopping:
            while self.credits == 0 and not self.stopping:
                grant = await self.grants.recv()
                if grant is None or (grant.count == 0 and grant.manifest is None):
                    continue
                self.credits += grant.count
                if grant.manifest is not None:
                    self.weight_inbox.put(grant.manifest)
                await self.reach_version(grant.min_version)
            if self.stopping:
                break
            self.install_weights()
            for hook in self.pre_collect_hooks:
                hook(self)
            rollout = self.collect()
            for post in self.post_collect_hooks:
                post(self, rollout)
            self.rollouts.send(rollout)
            self.credits -= 1
            self.produced += 1
            await asyncio.sleep(0)  # let update_weights and drain land between rollouts
        self.rollouts.send(None)
        return self.produced

    async def reach_version(self, version: int) -> None:
        """Install weights until the policy is at least ``version`` (a grant's condition).

        The granted update may already be stale (its slot reused by newer
        versions); the trainer sends those newer versions to generators too,
        so the next one to arrive here is installed instead.
        """
        while self.version < version:
            self.install_weights()
            if self.version >= version or self.stopping:
                return
            await self.weight_inbox.wait(WEIGHTS_TIMEOUT)

    @endpoint
    async def drain(self) -> None:
        """Stop producing; ``run`` sends the end-of-stream sentinel and returns."""
        self.stopping = True
        self.grant_port.send(Grant(0))  # wake a loop waiting for credits


class Scorer(Actor):
    """Scores each rollout with the task's frozen reward model."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.task = load_task(config)
        self.device = torch.device(config.device_of("scorer"))
        self.reward_net = self.task.build_reward().to(self.device)
        self.port, self.inbox = Channel.open(Rollout)

    @endpoint
    async def inlet(self) -> Port[Rollout]:
        return self.port

    def score(self, rollout: Rollout) -> torch.Tensor:
        state, actions = rollout.state.to(self.device), rollout.actions.to(self.device)
        return self.task.rewards(self.reward_net, state, actions).cpu()

    @endpoint
    async def run(self, out: Port[ScoredRollout]) -> int:
        count = 0
        while (rollout := await self.inbox.recv()) is not None:
            out.send(ScoredRollout(rollout, self.score(rollout), self.inbox.qsize()))
            count += 1
        out.send(None)
        return count


class RefModel(Actor):
    """Adds log-probs of the sampled actions under the frozen initial policy."""

    def __init__(self, config: Config, initial: WeightManifest) -> None:
        self.config = config
        self.task = load_task(config)
        self.device = torch.device(config.device_of("ref"))
        self.model = self.task.build_policy().to(self.device).requires_grad_(False).eval()
        consumer = WeightConsumer()
        consumer.install(initial, self.model)
        consumer.close()
        self.port, self.inbox = Channel.open(ScoredRollout)

    @endpoint
    async def inlet(self) -> Port[ScoredRollout]:
        return self.port

    def reference_logps(self, rollout: Rollout) -> torch.Tensor:
        with torch.no_grad():
            return _logps(self.model, rollout.state.to(self.device), rollout.actions.to(self.device)).cpu()

    @endpoint
    async def run(self, out: Port[RefScoredRollout]) -> int:
        count = 0
        while (scored := await self.inbox.recv()) is not None:
            ref = self.reference_logps(scored.rollout)
            out.send(RefScoredRollout(scored.rollout, scored.rewards, ref, scored.scorer_queue, self.inbox.qsize()))
            count += 1
        out.send(None)
        return count


class Trainer(Actor):
    """GRPO on each incoming group; publishes every new version as a manifest."""

    def __init__(self, config: Config, reports: Port[StepReport], resume: bool = False) -> None:
        self.config = config
        self.task = load_task(config)
        self.device = torch.device(config.device_of("trainer"))
        torch.manual_seed(config.seed)
        self.policy = self.task.build_policy().to(self.device)
        self.optim = torch.optim.Adam(self.policy.parameters(), lr=config.lr)
        self.ref_state = copy.deepcopy(self.policy.state_dict())
        self.step = 0
        self.version = 0
        if resume:
            state = checkpoint.load(config.run_dir)
            self.policy.load_state_dict(state["policy"])
            self.optim.load_state_dict(state["optimizer"])
            self.ref_state = state["ref"]
            self.step, self.version = int(state["step"]), int(state["version"])
        self.reports = reports
        self.port, self.inbox = Channel.open(RefScoredRollout)
        self.reward_net = self.task.build_reward().to(self.device)
        states = self.task.eval_states(config.eval_states).to(self.device)
        self.eval_table = self.task.reward_table(self.reward_net, states)
        self.eval_inputs = states
        on_gpu: dict[str, Any] = {"device": self.device} if config.transport == "cuda-ipc" else {}
        self.publisher = WeightPublisher(config.transport, slots=config.generators + 3, **on_gpu)
        self.ref_publisher = WeightPublisher(config.transport, slots=1, **on_gpu)
        self.manifest = self.publisher.publish(self.policy, self.version, {"step": self.step})
        self.ref_manifest = self.ref_publisher.publish(self.ref_state, 1)
        self.dropped = 0
        self.score: float | None = None
        self._reports: list[StepReport] = []
        self.grants: list[Port[Grant]] = []

    @endpoint
    async def inlet(self) -> Port[RefScoredRollout]:
        return self.port

    @endpoint
    async def initial_manifests(self) -> tuple[WeightManifest, WeightManifest]:
        """The current policy's manifest (for generators) and the reference's (for RefModel)."""
        return self.manifest, self.ref_manifest

    def evaluate(self) -> float:
        """Normalized score on the fixed evaluation states (1 optimal, 0 random)."""
        return self.task.score(self.policy, self.eval_inputs, self.eval_table)

    def train_step(self, item: RefScoredRollout) -> tuple[float, float]:
        r, device = item.rollout, self.device
        out = grpo_loss(
            self.policy,
            r.state.to(device),
            r.actions.to(device),
            r.logps.to(device),
            item.rewards.to(device),
            item.ref_logps.to(device),
            self.config.clip,
            self.config.kl_coeff,
        )
        self.optim.zero_grad()
        out.loss.backward()  # type: ignore[no-untyped-call]
        self.optim.step()
        return float(out.loss.detach()), out.kl

    @endpoint
    async def run(self, generators: Generator, grants: list[Port[Grant]]) -> dict[str, Any]:
        """Train until ``config.steps`` (or the target score); returns a summary."""
        config = self.config
        sync = config.mode == "sync"
        self.grants = grants = list(grants)
        if sync:
            grants[self.step % len(grants)].send(Grant(1, self.version, self.manifest))
        else:
            for port in grants:
                port.send(Grant(config.max_inflight))
        started = time.perf_counter()
        while self.step < config.steps:
            item = await self.inbox.recv()
            if item is None:
                raise RuntimeError("the rollout stream ended before training finished")
            rollout = item.rollout
            lag = self.version - rollout.version
            if not sync:
                self.grant(rollout.generator, Grant(1))  # consumed: the generator may produce one more
            if lag > config.max_staleness:
                self.dropped += 1
                continue
            loss, kl = self.train_step(item)
            self.step += 1
            self.version += 1
            t0 = time.perf_counter()
            self.manifest = await self.publisher.publish_async(self.policy, self.version, {"step": self.step})
            if sync:
                self.grant(self.step % len(grants), Grant(1, self.version, self.manifest))
            else:
                with contextlib.suppress(ActorDied):  # every generator is down; a restarted one gets a grant
                    send(generators.update_weights, (self.manifest,), selection="choose")
            sync_ms = (time.perf_counter() - t0) * 1000
            final = self.step >= config.steps
            if self.step % config.eval_every == 0 or final:
                self.score = self.evaluate()
            self._reports.append(
                StepReport(
                    self.step,
                    time.perf_counter() - started,
                    self.version,
                    float(item.rewards.mean()),
                    self.score,
                    loss,
                    kl,
                    lag,
                    self.dropped,
                    self.inbox.qsize(),
                    item.scorer_queue,
                    item.ref_queue,
                    sync_ms,
                    rollout.generator,
                )
            )
            if len(self._reports) >= REPORT_BATCH or final:
                self.flush_reports()
            if config.checkpoint_every and self.step % config.checkpoint_every == 0:
                self.save()
            if config.target_score is not None and self.score is not None and self.score >= config.target_score:
                break
        self.flush_reports()
        self.save()
        self.reports.send(None)
        return {"steps": self.step, "version": self.version, "dropped": self.dropped, "score": self.score}

    def grant(self, generator: int, grant: Grant) -> None:
        """Send ``grant``; a generator that died loses it (its restart brings a fresh grant)."""
        with contextlib.suppress(PortClosed):
            self.grants[generator].send(grant)

    @endpoint
    async def generator_restarted(self, generator: int, grants: Port[Grant]) -> int:
        """A restarted generator's new grant port: its credits, with the newest policy to install first.

        Returns the policy version it must reach before producing.
        """
        self.grants[generator] = grants
        sync = self.config.mode == "sync"
        if not sync:
            self.grant(generator, Grant(self.config.max_inflight, self.version, self.manifest))
        elif self.step % len(self.grants) == generator:  # the lost lock-step grant was its turn
            self.grant(generator, Grant(1, self.version, self.manifest))
        return self.version

    def flush_reports(self) -> None:
        """Send the step reports gathered so far (batched: one wake-up of the controller each)."""
        for report in self._reports:
            self.reports.send(report)
        self._reports.clear()

    def save(self) -> str:
        return checkpoint.save(
            self.config.run_dir,
            {
                "step": self.step,
                "version": self.version,
                "policy": self.policy.state_dict(),
                "optimizer": self.optim.state_dict(),
                "ref": self.ref_state,
            },
        )

    @endpoint
    async def checkpoint(self) -> str:
        return self.save()

    async def __cleanup__(self, exc: BaseException | None) -> None:
        self.publisher.close()
        self.ref_publisher.close()
