"""The four GRPO roles, each an actor in its own process, linked by typed ports.

::

    Generator xN --Rollout--> Scorer --ScoredRollout--> RefModel --RefScoredRollout--> Trainer
         ^   ^                                                                            |
         |   +------------ Grant (credits: bounded rollouts in flight) -------------------+
         +---------- update_weights(manifest), fire-and-forget to one chosen generator ---+

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
    host_id,
    send,
)

from . import checkpoint
from .learner import Learner, Update
from .messages import Config, GeneratorTimes, Grant, RefScoredRollout, Rollout, ScoredRollout, StepReport
from .task import Scores, load_task, to_device
from .weight_routes import WeightRoutes

__all__ = ["Generator", "RefModel", "Scorer", "Trainer"]

#: Step reports the trainer gathers before sending them to the controller.
REPORT_BATCH = 10
#: How long a generator waits for the policy version a grant requires.
WEIGHTS_TIMEOUT = 60.0
CPU = torch.device("cpu")


def _role_device(config: Config, role: str) -> torch.device:
    """The role's device, with torch limited to the run's threads (every role is one process of many)."""
    torch.set_num_threads(config.threads)
    return torch.device(config.device_of(role))


class Generator(ReceivesWeights):
    """Samples rollouts with the newest policy it has installed.

    Produces only against credits (``Grant``) from the trainer, so it can
    never run more than ``max_inflight`` rollouts ahead. Hooks registered
    with ``register_pre_collect_hook`` / ``register_post_collect_hook`` run
    in this process around each rollout; their exceptions end ``run``.
    """

    def __init__(self, config: Config, rollouts: Port[Rollout], initial: WeightManifest | None = None) -> None:
        self.config = config
        self.task = load_task(config)
        self.id = current_rank().rank
        self.device = _role_device(config, "generator")
        self.policy = self.task.build_policy().to(self.device).requires_grad_(False).eval()
        self.rollouts = rollouts
        seed = 1_000_003 * (config.seed + 1) + 7_919 * (self.id + 1)
        self.rng = torch.Generator(device=self.device).manual_seed(seed)
        self.grant_port, self.grants = Channel.open(Grant)
        if initial is not None:  # else the first grant brings the policy
            self.weight_inbox.put(initial)
        self.version = -1
        self.credits = 0
        self.produced = 0
        self.stopping = False
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
        manifest = await self.weight_inbox.install_newest_async(self.policy, alias=self.config.install == "alias")
        if manifest is not None:
            self.version = manifest.version
            self.times.install += time.perf_counter() - started
            published = manifest.metadata.get("published_at")
            if isinstance(published, float):
                self.times.delivery = max(0.0, time.time() - published)

    def collect(self) -> Rollout:
        """One rollout drawn with the current policy (its samples sent as CPU tensors)."""
        started = time.perf_counter()
        samples = to_device(self.task.sample(self.policy, self.rng), CPU)
        self.times.generate = time.perf_counter() - started
        tokens, length = self.task.measure(samples)
        return Rollout(self.id, self.produced, self.version, samples, tokens, length, self.times)

    @endpoint
    async def run(self) -> int:
        """Produce rollouts until drained; returns how many were sent."""
        while not self.stopping:
            waiting = time.perf_counter()
            while self.credits == 0 and not self.stopping:
                grant = await self.grants.recv()
                if grant is None or (grant.count == 0 and grant.manifest is None):
                    continue
                self.credits += grant.count
                if grant.manifest is not None:
                    self.weight_inbox.put(grant.manifest)
                await self.reach_version(grant.min_version)
            self.times.wait += time.perf_counter() - waiting
            if self.stopping:
                break
            await self.install_weights()
            for hook in self.pre_collect_hooks:
                hook(self)
            rollout = self.collect()
            for post in self.post_collect_hooks:
                post(self, rollout)
            now = time.perf_counter()
            rollout.times.cycle = now - self._cycle_started
            self.rollouts.send(rollout)
            self._cycle_started, self.times = now, GeneratorTimes()
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
            await self.install_weights()
            if self.version >= version or self.stopping:
                return
            await self.weight_inbox.wait(WEIGHTS_TIMEOUT)

    @endpoint
    async def drain(self) -> None:
        """Stop producing; ``run`` sends the end-of-stream sentinel and returns."""
        self.stopping = True
        self.grant_port.send(Grant(0))  # wake a loop waiting for credits


class Scorer(Actor):
    """Scores each rollout with the task's verifier (or reward model)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.task = load_task(config)
        self.device = _role_device(config, "scorer")
        self.scorer = self.task.build_scorer(self.device)
        self.port, self.inbox = Channel.open(Rollout)

    @endpoint
    async def inlet(self) -> Port[Rollout]:
        return self.port

    def score(self, rollout: Rollout) -> Scores:
        return self.task.score(self.scorer, to_device(rollout.samples, self.device))

    @endpoint
    async def run(self, out: Port[ScoredRollout]) -> int:
        count = 0
        while (rollout := await self.inbox.recv()) is not None:
            scores = self.score(rollout)
            accuracy = None if scores.accuracy is None else scores.accuracy.cpu()
            out.send(ScoredRollout(rollout, scores.rewards.cpu(), accuracy, self.inbox.qsize()))
            count += 1
        out.send(None)
        return count


class RefModel(Actor):
    """Adds the frozen initial policy's log-probabilities of each rollout's samples."""

    def __init__(self, config: Config, initial: WeightManifest) -> None:
        self.config = config
        self.task = load_task(config)
        self.device = _role_device(config, "ref")
        self.model = self.task.build_policy().to(self.device).requires_grad_(False).eval()
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
    async def run(self, out: Port[RefScoredRollout]) -> int:
        count = 0
        while (scored := await self.inbox.recv()) is not None:
            ref = self.reference_logps(scored.rollout)
            out.send(
                RefScoredRollout(
                    scored.rollout, scored.rewards, ref, scored.accuracy, scored.scorer_queue, self.inbox.qsize()
                )
            )
            count += 1
        out.send(None)
        return count


class Trainer(Actor):
    """GRPO on each incoming rollout; publishes every new version as a manifest."""

    def __init__(self, config: Config, reports: Port[StepReport], resume: bool = False) -> None:
        self.config = config
        self.task = load_task(config)
        self.device = _role_device(config, "trainer")
        self.learner = Learner(self.task, self.device)
        self.step = 0
        self.version = 0
        if resume:
            state = checkpoint.load(config.run_dir)
            self.learner.load_state(state)
            self.step, self.version = int(state["step"]), int(state["version"])
        self.reports = reports
        self.port, self.inbox = Channel.open(RefScoredRollout)
        on_gpu: dict[str, Any] = {"device": self.device} if config.transport == "cuda-ipc" else {}
        self.routes = WeightRoutes(config.transport, config.generators + 3, **on_gpu)
        self.ref_publisher = WeightPublisher(config.transport, slots=1, **on_gpu)
        self.routes.publish(config.transport, self.learner.policy, self.version, self._metadata())  # fail early
        self.ref_manifest = self.ref_publisher.publish(self.learner.reference_state, 1)
        self.dropped = 0
        self.tokens_received = 0
        self.evaluation: dict[str, float] | None = None
        self.score: float | None = None
        self._reports: list[StepReport] = []
        self.grants: list[Port[Grant]] = []

    @property
    def policy(self) -> torch.nn.Module:
        return self.learner.policy

    def _metadata(self) -> dict[str, Any]:
        return {"step": self.step, "published_at": time.time()}

    @endpoint
    async def inlet(self) -> Port[RefScoredRollout]:
        return self.port

    @endpoint
    async def initial_manifests(self) -> tuple[WeightManifest, WeightManifest]:
        """The current policy's manifest on the run's transport (for generators) and the reference's (for RefModel)."""
        policy = await self.routes.publish_async(
            self.config.transport, self.learner.policy, self.version, self._metadata()
        )
        return policy, self.ref_manifest

    @endpoint
    async def route_weights(self, generators: Generator) -> list[str]:
        """Choose each generator's weight transport by where it runs; the routes, in words."""
        hosts = [host for _, host in (await generators.host.call()).items()]
        routes = self.routes.plan(host_id(), hosts)
        return [route.describe() for route in routes]

    async def manifest_for(self, generator: int) -> WeightManifest:
        """The current policy on the transport that reaches ``generator``."""
        transport = self.routes.transport_of(generator)
        return await self.routes.publish_async(transport, self.learner.policy, self.version, self._metadata())

    def train_step(self, item: RefScoredRollout) -> Update:
        device = self.device
        samples = to_device(item.rollout.samples, device)
        return self.learner.update(samples, item.rewards.to(device), item.ref_logps.to(device))

    def evaluate(self) -> float:
        """Held-out metrics of the current policy; returns the task's primary one."""
        self.evaluation = self.learner.evaluate()
        self.score = self.evaluation[self.task.primary]
        return self.score

    @endpoint
    async def run(self, generators: Generator, grants: list[Port[Grant]]) -> dict[str, Any]:
        """Train until ``config.steps`` (or the target score); returns a summary."""
        config = self.config
        sync = config.mode == "sync"
        self.grants = grants = list(grants)
        if not self.routes.routes:
            self.routes.plan_local(len(grants))
        if sync:
            first = self.step % len(grants)
            grants[first].send(Grant(1, self.version, await self.manifest_for(first)))
        else:
            for rank, port in enumerate(grants):  # the policy comes with the first credits
                port.send(Grant(config.max_inflight, self.version, await self.manifest_for(rank)))
        started = time.perf_counter()
        waited = 0.0
        while self.step < config.steps:
            waiting = time.perf_counter()
            item = await self.inbox.recv()
            waited += time.perf_counter() - waiting
            if item is None:
                raise RuntimeError("the rollout stream ended before training finished")
            rollout = item.rollout
            self.tokens_received += rollout.tokens
            lag = self.version - rollout.version
            if not sync:
                self.grant(rollout.generator, Grant(1))  # consumed: the generator may produce one more
            if lag > config.max_staleness:
                self.dropped += 1
                continue
            update = self.train_step(item)
            self.step += 1
            self.version += 1
            publishing = time.perf_counter()
            if sync:
                turn = self.step % len(grants)
                self.grant(turn, Grant(1, self.version, await self.manifest_for(turn)))
            else:
                route = self.routes.next_route()
                manifest = await self.routes.publish_async(
                    route.transport, self.learner.policy, self.version, self._metadata()
                )
                chosen = generators.slice(procs=slice(route.first, route.last + 1))
                with contextlib.suppress(ActorDied):  # every generator there is down; a restarted one gets a grant
                    send(chosen.update_weights, (manifest,), selection="choose")
            published = time.perf_counter() - publishing
            final = self.step >= config.steps
            evaluation = None
            if self.step % config.eval_every == 0 or final:
                self.evaluate()
                evaluation = self.evaluation
            self._reports.append(self._report(item, update, lag, waited, published, evaluation, started))
            waited = 0.0
            if len(self._reports) >= REPORT_BATCH or final:
                self.flush_reports()
            if config.checkpoint_every and self.step % config.checkpoint_every == 0:
                self.save()
            if config.target_score is not None and self.score is not None and self.score >= config.target_score:
                break
        self.flush_reports()
        self.save()
        self.reports.send(None)
        return {
            "steps": self.step,
            "version": self.version,
            "dropped": self.dropped,
            "score": self.score,
            "evaluation": self.evaluation,
        }

    def _report(
        self,
        item: RefScoredRollout,
        update: Update,
        lag: int,
        waited: float,
        published: float,
        evaluation: dict[str, float] | None,
        started: float,
    ) -> StepReport:
        rollout, loss = item.rollout, update.report
        return StepReport(
            step=self.step,
            time=time.perf_counter() - started,
            version=self.version,
            generator=rollout.generator,
            staleness=lag,
            dropped_stale=self.dropped,
            reward_mean=float(item.rewards.mean()),
            reward_std=float(item.rewards.std(unbiased=False)),
            accuracy=None if item.accuracy is None else float(item.accuracy.mean()),
            evaluation=evaluation,
            score=self.score,
            loss=float(loss.loss.detach()),
            policy_loss=loss.policy_loss,
            kl=loss.kl,
            clip_fraction=loss.clip_fraction,
            entropy=loss.entropy,
            grad_norm=update.grad_norm,
            response_length=rollout.response_length,
            tokens=rollout.tokens,
            tokens_received=self.tokens_received,
            wait_batch=waited,
            train=update.seconds,
            publish=published,
            generator_times=rollout.times,
            trainer_queue=self.inbox.qsize(),
            scorer_queue=item.scorer_queue,
            ref_queue=item.ref_queue,
        )

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
            self.grant(generator, Grant(self.config.max_inflight, self.version, await self.manifest_for(generator)))
        elif self.step % len(self.grants) == generator:  # the lost lock-step grant was its turn
            self.grant(generator, Grant(1, self.version, await self.manifest_for(generator)))
        return self.version

    def flush_reports(self) -> None:
        """Send the step reports gathered so far (batched: one wake-up of the controller each)."""
        for report in self._reports:
            self.reports.send(report)
        self._reports.clear()

    def save(self) -> str:
        return checkpoint.save(
            self.config.run_dir, {"step": self.step, "version": self.version, **self.learner.state()}
        )

    @endpoint
    async def checkpoint(self) -> str:
        return self.save()

    async def __cleanup__(self, exc: BaseException | None) -> None:
        self.routes.close()
        self.ref_publisher.close()
