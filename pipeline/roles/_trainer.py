"""The Trainer role: trains rollouts in ticket order, publishes each new version, grants the next rollouts.

Each step takes the rollout of the next ticket (:mod:`pipeline.roles`),
applies one GRPO update (:class:`~pipeline.learning.Learner`), publishes the
new policy as a manifest, and opens the ticket the trained one's credit
pays for. The new version goes to the generators whose tickets need it (in
their grant, or as a targeted ``update_weights``), and otherwise,
fire-and-forget, to one chosen generator, so every generator keeps drawing
with a recent policy. Reports go to the controller in batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from actors import (
    Actor,
    ActorDied,
    Channel,
    Port,
    PortClosed,
    WeightManifest,
    WeightPublisher,
    bind_host,
    endpoint,
    host_id,
    send,
)

from ..algorithm import group_spread
from ..config import Config
from ..learning import DataParallel, GroupAddress, Learner, RankShare, Rendezvous, Update, checkpoint, group_kind
from ..models import weights_dtype
from ..tasks import load_task, to_device
from ._deaths import first_death
from ._devices import peak_gpu_gb, reserved_gpu_gb, role_device, uses_reference
from ._generator import Generator
from ._messages import Grant, ScoredRollout, StepReport
from ._scorers import RefModel
from ._tickets import Tickets
from ._weight_routes import WeightRoutes

if TYPE_CHECKING:
    from ._trainer_rank import TrainerRank

__all__ = ["Trainer"]

T = TypeVar("T")

#: Step reports the trainer gathers before sending them to the controller.
REPORT_BATCH = 10
#: How long a failed step waits to learn whether a trainer rank died (and name it) before reporting itself.
RANK_FAILURE_GRACE = 2.0


class Trainer(Actor):
    """GRPO on rollouts in ticket order; publishes every new version as a manifest."""

    def __init__(self, config: Config, reports: Port[StepReport], resume: bool = False) -> None:
        self.config = config
        self.task = load_task(config)
        self.device = role_device(config, "trainer")
        self.learner = Learner(self.task, self.device, stage_on_host=config.sharded_trainer)
        self.step = 0
        self.version = 0
        #: Duplicate rollouts dropped since the run began (a restarted generator's ticket, produced twice).
        self.dropped = 0
        self._shards_to_load: str | None = None  # a sharded checkpoint's, loaded once the ranks have sharded
        #: The last held-out metrics and their primary one (carried forward between evaluations).
        self.evaluation: dict[str, float] | None = None
        self.score: float | None = None
        if resume:
            state, self._shards_to_load = self.learner.resume(config.run_dir, shard_later=config.sharded_trainer)
            self.step, self.version = int(state["step"]), int(state["version"])
            self.dropped = int(state.get("dropped", 0))  # (a checkpoint from before it was kept: 0)
            self.evaluation = state.get("evaluation")  # (before it was kept: none until the next evaluation)
            self.score = state.get("score")
        self.reports = reports
        # Rollouts come from the reference model, or straight from the scorer when the run has no KL term.
        self.port, self.inbox = Channel.open(ScoredRollout)
        sync = config.mode == "sync"
        self.tickets: Tickets[ScoredRollout] = Tickets(
            config.generators,
            credits=1 if sync else config.generators * config.max_inflight,
            staleness=0 if sync else config.max_staleness,
            first=self.step,
        )
        on_gpu: dict[str, Any] = {"device": self.device} if config.transport == "cuda-ipc" else {}
        # A slot per version a generator may yet install: it takes one at its next rollout boundary.
        slots = max(config.generators, self.tickets.credits) + 3
        self.routes = WeightRoutes(config.transport, slots, dtype=weights_dtype(config.dtype), **on_gpu)
        if self._shards_to_load is None:  # else published once the shards are loaded (join)
            # fail early: a transport that cannot publish fails before any process waits on it
            self.routes.publish(config.transport, self.learner.published(), self.version, self._metadata())
        self.ref_publisher: WeightPublisher | None = None
        self.ref_manifest: WeightManifest | None = None
        if uses_reference(config):
            # one slot: a sync waits only while the RefModel reads it; an update it had not installed yet is then
            # stale, and it installs the newer one queued behind it (each sync's is queued before its grants)
            self.ref_publisher = WeightPublisher(config.transport, slots=1, dtype=weights_dtype(config.dtype), **on_gpu)
            self.ref_manifest = self.ref_publisher.publish(self.learner.reference_state, 1)
        self.tokens_received = 0
        self._reports: list[StepReport] = []
        #: Held from a step's update to its report: a checkpoint between steps has every report sent before it.
        self._in_step = asyncio.Lock()
        #: A stopping run's final checkpoint was taken: no step is trained after it (its rows end there).
        self._halted = False
        self.grants: list[Port[Grant]] = []
        self.generators: Generator | None = None
        # --trainer-ranks N > 1: this is rank 0; the others train their shares of each step beside it
        self.ranks: TrainerRank | None = None
        self._rendezvous: Rendezvous | None = None
        self._parallel: DataParallel | None = None
        self._weights = asyncio.Lock()  # held while a step runs off the loop: nothing publishes or saves midway
        #: Held while grants go out (taken before ``_weights``): each generator gets its tickets in order, a
        #: restarted one's open tickets before any new one.
        self._granting = asyncio.Lock()
        self._stepping: asyncio.Future[Any] | None = None  # a step left blocked in a collective by a dead rank
        self._saved: tuple[int, str] | None = None  # the step last checkpointed, and where

    @property
    def policy(self) -> torch.nn.Module:
        return self.learner.policy

    def _metadata(self, step: int | None = None) -> dict[str, Any]:
        return {"step": self.step if step is None else step, "published_at": time.time()}

    async def _publish(self, transport: str) -> WeightManifest:
        """The current version on ``transport``: published now, or (a sharded policy) when its step published it.

        A sharded policy is gathered with every rank, so it is published only
        at the end of each step, on every transport in use (:meth:`train`).
        A version already out on ``transport`` is not prepared again: with
        LoRA adapters preparing it merges every adapted layer, off the loop.
        """
        published = self.routes.published(transport, self.version)
        if published is not None:
            return published
        if self.learner.sharded:
            raise RuntimeError(
                f"version {self.version} of the sharded policy was not published on {transport}: it is "
                "published with every rank at the end of its step"
            )
        weights = await asyncio.to_thread(self.learner.published)
        return await self.routes.publish_async(transport, weights, self.version, self._metadata())

    @endpoint
    async def inlet(self) -> Port[ScoredRollout]:
        return self.port

    @endpoint
    async def initial_manifests(self) -> tuple[WeightManifest, WeightManifest | None]:
        """The current policy's manifest on the run's transport (for generators) and the reference's (for RefModel).

        The second is None when the run has no KL term (β = 0): no RefModel runs then.
        """
        return await self._publish(self.config.transport), self.ref_manifest

    @endpoint
    async def route_weights(self, generators: Generator) -> list[str]:
        """Choose each generator's weight transport by where it runs; the routes, in words."""
        hosts = [host for _, host in (await generators.host.call()).items()]
        routes = self.routes.plan(host_id(), hosts)
        if self.learner.sharded:  # the current version on each new transport, gathered with every rank
            missing = [t for t in self.routes.transports() if self.routes.published(t, self.version) is None]
            if missing:
                await self._with_ranks(
                    lambda: self._publish_on(missing), lambda rank: rank.publish.call_one(len(missing))
                )
        return [route.describe() for route in routes]

    def _publish_on(self, transports: list[str], version: int | None = None, step: int | None = None) -> None:
        """Publish the policy (``version``, default the current) on each of ``transports``; off the loop."""
        for transport in transports:
            self.routes.publish(
                transport, self.learner.published(), self.version if version is None else version, self._metadata(step)
            )

    async def manifest_for(self, generator: int) -> WeightManifest:
        """The current policy on the transport that reaches ``generator``."""
        transport = self.routes.transport_of(generator)
        async with self._weights:
            return await self._publish(transport)

    @endpoint
    async def rendezvous(self, world: int) -> GroupAddress:
        """Serve the store through which ``world`` trainer ranks join (this is rank 0), on the session's address."""
        self._rendezvous = Rendezvous(bind_host(), world, self.config.collective_timeout)
        return self._rendezvous.address

    @endpoint
    async def join(self, ranks: TrainerRank, world: int) -> str:
        """Join the group as rank 0 while ``ranks`` (1..world-1) join it too; this host. They share every step from now on."""
        if self._rendezvous is None:
            raise RuntimeError("call rendezvous() first: rank 0 serves the store the others join through")
        rendezvous, config = self._rendezvous, self.config

        def form() -> DataParallel:
            group = group_kind(config.trainer_shard)(
                RankShare(0, world),
                rendezvous.address,
                self.device,
                rendezvous=rendezvous,
                timeout=config.collective_timeout,
            )
            self.learner.share_with(group)  # sharded: every rank shards its copy now
            if self._shards_to_load is not None:  # every rank loads its part, then the policy goes out whole
                self.learner.load_shards(self._shards_to_load)
                self._publish_on([config.transport])
            return group

        self._parallel = await asyncio.to_thread(form)
        self.ranks = ranks
        return host_id()

    async def train(self, item: ScoredRollout) -> tuple[Update, float]:
        """One step: :meth:`train_step` on the loop with one rank; with several, beside the others, off the loop.

        A sharded policy is then published (version + 1) on every transport in
        use, each rank joining the gathers, before the step returns. Returns
        the update and the seconds that publish took (0 otherwise).
        """
        if self.ranks is None:
            async with self._weights:  # (a publish copying the policy off the loop finishes first)
                return self.train_step(item), 0.0
        publishes = self.routes.transports() if self.learner.sharded else []
        version, step = self.version + 1, self.step + 1

        def mine() -> tuple[Update, float]:
            update = self.train_step(item)
            publishing = time.perf_counter()
            self._publish_on(publishes, version, step)
            return update, time.perf_counter() - publishing

        args = (item.rollout.samples, item.rewards, item.ref_logps, len(publishes))
        return await self._with_ranks(mine, lambda rank: rank.train.call_one(*args))

    async def _with_ranks(self, mine: Callable[[], T], theirs: Callable[[TrainerRank], Any]) -> T:
        """``mine()`` off the loop while every other rank runs ``theirs(rank)``: one collective, or its failure.

        Holds the weights lock (nothing publishes or saves midway). A rank that
        dies makes the others' collectives fail within their deadline; the
        failure then names the rank.
        """
        assert self.ranks is not None and self._parallel is not None, "join() sets the group with the ranks"
        ranks, world = self.ranks, self._parallel.share.world
        async with self._weights:  # (the other ranks are asked only now: a save never runs beside a step)
            others = [asyncio.ensure_future(theirs(ranks.slice(procs=r))) for r in range(world - 1)]
            work = asyncio.ensure_future(asyncio.to_thread(mine))
            self._stepping = work
            await asyncio.wait([work, *others], return_when=asyncio.FIRST_EXCEPTION)
            if work.done():
                self._stepping = None  # else a rank failed first and this collective may never finish
        try:
            if work.done() and work.exception() is not None:
                failed: asyncio.Future[Any] | None = work
            else:
                failed = next((other for other in others if other.done() and other.exception() is not None), None)
            if failed is None:
                return work.result()
            cause = failed.exception()
            assert cause is not None
            # a rank's failure, or a collective broken under this one, may be a rank's death: name the rank
            if failed is not work or isinstance(cause, RuntimeError):
                dead = await first_death(others, RANK_FAILURE_GRACE)
                if dead is not None:
                    rank = next(r for r, other in enumerate(others, start=1) if other is dead)
                    raise RuntimeError(
                        f"trainer rank {rank} died during step {self.step + 1}: {dead.exception()}"
                    ) from cause
            raise cause
        finally:
            for other in others:
                if not other.done():
                    other.cancel()

    def train_step(self, item: ScoredRollout) -> Update:
        device = self.device
        samples = to_device(item.rollout.samples, device)
        if uses_reference(self.config) and item.ref_logps is None:
            raise ValueError(
                f"a rollout reached the trainer without reference log-probs, but β = {self.config.kl_coeff}"
            )
        ref_logps = None if item.ref_logps is None else item.ref_logps.to(device)
        return self.learner.update(samples, item.rewards.to(device), ref_logps)

    async def evaluate(self) -> float:
        """Held-out metrics of the current policy; returns the task's primary one (sharded: with every rank)."""
        step = self.step
        if self.learner.sharded:
            self.evaluation = await self._with_ranks(
                lambda: self.learner.evaluate(step), lambda rank: rank.evaluate.call_one(step)
            )
        else:
            self.evaluation = await self.learner.evaluate_async(step)
        self.score = self.evaluation[self.task.primary]
        return self.score

    async def next_rollout(self) -> ScoredRollout:
        """The rollout of the next ticket; others that arrive first wait their turn, duplicates are dropped."""
        tickets = self.tickets
        while (item := tickets.next_ready()) is None:
            arrived = await self.inbox.recv()
            if arrived is None:
                raise RuntimeError("the rollout stream ended before training finished")
            self.tokens_received += arrived.rollout.tokens
            if not tickets.arrived(arrived.rollout.ticket, arrived):
                self.dropped += 1  # a restarted generator's ticket, produced twice
        return item

    @endpoint
    async def run(
        self, generators: Generator, grants: list[Port[Grant]], reference: RefModel | None = None
    ) -> dict[str, Any]:
        """Train until ``config.steps`` (or the target score); returns a summary.

        ``reference`` is the RefModel a synced reference goes to (``--sync-ref-model``).
        """
        self.generators = generators
        self.grants = list(grants)
        if not self.routes.routes:
            self.routes.plan_local(len(self.grants))
        await self.grant_open_tickets()  # the policy comes with the first tickets
        started = time.perf_counter()
        try:
            await self._train_until_done(reference, started)
        except BaseException:  # the steps trained before the failure still reach the run's metrics
            with contextlib.suppress(Exception):
                self.flush_reports()
            raise
        self.flush_reports()
        await self._save_between_steps()
        self.reports.send(None)
        return {
            "steps": self.step,
            "version": self.version,
            "dropped": self.dropped,
            "score": self.score,
            "evaluation": self.evaluation,
        }

    async def _train_until_done(self, reference: RefModel | None, started: float) -> None:
        """Train on each rollout as it comes, until ``config.steps`` or the target score."""
        config = self.config
        waited = 0.0
        while self.step < config.steps and not self._halted:
            waiting = time.perf_counter()
            item = await self.next_rollout()
            waited += time.perf_counter() - waiting
            rollout = item.rollout
            lag = self.version - rollout.version
            if lag > self.tickets.staleness:
                # Only a generator that ignored its ticket's version gets here. Granting the ticket again would put
                # it behind that generator's later tickets, which need it trained first: the run would stall.
                raise RuntimeError(
                    f"generator {rollout.generator} drew ticket {rollout.ticket} with policy version "
                    f"{rollout.version}, but the ticket needs at least {self.tickets.min_version(rollout.ticket)}: "
                    "a generator installs its grant's min_version before drawing (Generator.reach_version)"
                )
            async with self._in_step:  # (a checkpoint asked for meanwhile waits for this step's report)
                if self._halted:  # (the final checkpoint came while this rollout was awaited)
                    return
                update, published = await self.train(item)
                self.step += 1
                self.version += 1
                self.tickets.trained()
                if config.syncs_reference_after(self.step):
                    await self.sync_reference(reference)  # before the grants: every rollout granted now uses it
                publishing = time.perf_counter()  # (the policy's publish: the reference's sync is not counted)
                await self.deliver()
                published += time.perf_counter() - publishing
                final = self.step >= config.steps
                evaluation = None
                if self.step % config.eval_every == 0 or final:
                    await self.evaluate()
                    evaluation = self.evaluation
                self._reports.append(self._report(item, update, lag, waited, published, evaluation, started))
            waited = 0.0
            if len(self._reports) >= REPORT_BATCH or final:
                self.flush_reports()
            if config.checkpoint_every and self.step % config.checkpoint_every == 0:
                await self._save_between_steps()
            if config.target_score is not None and self.score is not None and self.score >= config.target_score:
                break

    async def sync_reference(self, reference: RefModel | None) -> None:
        """Mix the policy into the reference weights and install them in ``reference`` before the next rollout
        it scores (the checkpoint keeps the mixed weights, so a resumed run's RefModel starts from them)."""
        if self.ref_publisher is None or self.ref_manifest is None:
            return  # no KL term: no reference to sync (refused before the run starts)
        async with self._weights:
            await asyncio.to_thread(self.learner.mix_reference, self.config.ref_model_mixup_alpha)
            version = self.ref_manifest.version + 1
            self.ref_manifest = await self.ref_publisher.publish_async(self.learner.reference_state, version)
        if reference is not None:  # queued there before this step's grants: their rollouts are scored with it
            await reference.update_weights.call_one(self.ref_manifest)

    async def deliver(self) -> None:
        """Grant the tickets the trained one's credit opens and get the new version to generators.

        Generators whose tickets need it get it (in the grant, or as an
        update sent to them by name); and one generator chosen by the
        runtime gets it fire-and-forget, so every generator keeps drawing
        with a recent policy, not just one K versions old. On-policy
        (K = 0) the tickets' own deliveries are all there is.
        """
        reached = await self.grant_open_tickets()
        assert self.generators is not None, "run() sets the generators before any delivery"
        for rank in self.tickets.lacking(self.version):
            manifest = await self.manifest_for(rank)
            with contextlib.suppress(ActorDied):  # it is down; its restart brings it the newest weights
                send(self.generators.slice(procs=rank).update_weights, (manifest,))
            self.tickets.sent(rank, self.version)
            reached = True
        if reached and self.tickets.staleness == 0:
            return
        route = self.routes.next_route()
        async with self._weights:  # a restarted generator's rejoin may be publishing (manifest_for) meanwhile
            manifest = await self._publish(route.transport)
        chosen = self.generators.slice(procs=slice(route.first, route.last + 1))
        with contextlib.suppress(ActorDied):  # every generator there is down; a restarted one gets a grant
            send(chosen.update_weights, (manifest,), selection="choose")

    async def grant_open_tickets(self) -> bool:
        """Grant every ticket the credits open now, in order; whether any grant brought the weights."""
        reached = False
        async with self._granting:
            for ticket in self.tickets.grant(limit=self.config.steps):
                reached = await self.send_grant(ticket) or reached
        return reached

    async def send_grant(self, ticket: int) -> bool:
        """Grant ``ticket`` to its generator, with the current weights if it lacks what the ticket needs."""
        tickets = self.tickets
        rank = tickets.owner(ticket)
        manifest = None
        if tickets.needs_weights(ticket, self.version):
            manifest = await self.manifest_for(rank)
            tickets.sent(rank, self.version)
        self.grant(rank, Grant(ticket, tickets.min_version(ticket), manifest))
        return manifest is not None

    def _report(
        self,
        item: ScoredRollout,
        update: Update,
        lag: int,
        waited: float,
        published: float,
        evaluation: dict[str, float] | None,
        started: float,
    ) -> StepReport:
        rollout, loss = item.rollout, update.report
        shown = item.rewards if item.reward_total is None else item.reward_total  # the rewards, not GDPO's signal
        group = self.config.group
        signal = None if item.reward_total is None else item.rewards  # GDPO's: the advantages come from it
        spread = group_spread(shown, group, signal) if shown.numel() % group == 0 else (None, None)
        return StepReport(
            step=self.step,
            time=time.perf_counter() - started,
            version=self.version,
            generator=rollout.generator,
            staleness=lag,
            dropped_stale=self.dropped,
            reward_mean=float(shown.nanmean()),  # (a completion no reward function scored is left out)
            reward_std=float(shown[~shown.isnan()].std(unbiased=False)),
            reward_group_std=spread[0],
            reward_zero_std=spread[1],
            accuracy=None if item.accuracy is None else float(item.accuracy.mean()),
            evaluation=evaluation,
            score=self.score,
            loss=float(loss.loss.detach()),
            policy_loss=loss.policy_loss,
            kl=loss.kl,
            clip_fraction=loss.clip_fraction,
            dual_clip_fraction=loss.dual_clip_fraction,
            logp_diff=loss.logp_diff,
            is_weight=loss.is_weight,
            is_truncated=loss.is_truncated,
            off_policy_masked=loss.off_policy_masked,
            entropy=loss.entropy,
            grad_norm=update.grad_norm,
            lr=update.lr,
            entropy_coef=update.entropy_coef,
            trained_entropy=loss.trained_entropy,
            vespo_weight=loss.vespo_weight,
            response_length=rollout.response_length,
            tokens=rollout.tokens,
            tokens_received=self.tokens_received,
            wait_batch=waited,
            train=update.seconds,
            publish=published,
            update_bytes=self.routes.update_bytes,
            trainer_peak_gpu_gb=peak_gpu_gb(self.device),
            generator_times=rollout.times,
            generator_peak_gpu_gb=rollout.peak_gpu_gb,
            trainer_reserved_gpu_gb=reserved_gpu_gb(self.device),
            generator_reserved_gpu_gb=rollout.reserved_gpu_gb,
            trainer_queue=self.inbox.qsize() + self.tickets.waiting(),
            scorer_queue=item.scorer_queue,
            ref_queue=item.ref_queue,
            reward_components=item.reward_components,
            reward_metrics=item.reward_metrics,
        )

    def grant(self, generator: int, grant: Grant) -> None:
        """Send ``grant``; a generator that died loses it (its restart brings its tickets again)."""
        with contextlib.suppress(PortClosed):
            self.grants[generator].send(grant)

    @endpoint
    async def generator_restarted(self, generator: int, grants: Port[Grant]) -> int:
        """A restarted generator's new grant port: its open tickets again, with the newest policy to install first.

        Returns the policy version it starts from.
        """
        async with self._granting:  # (a new ticket of its waits: a generator takes its grants in ticket order)
            self.grants[generator] = grants
            for ticket in self.tickets.restarted(generator):
                if ticket in self.tickets.open:  # (a late rollout of the old process may have closed it meanwhile)
                    await self.send_grant(ticket)
        return self.version

    def flush_reports(self) -> None:
        """Send the step reports gathered so far (batched: one wake-up of the controller each)."""
        for report in self._reports:
            self.reports.send(report)
        self._reports.clear()

    def save(self) -> str:
        """Write the policy where other tools load it if the task exports one (and a LoRA run's adapter), then the
        checkpoint, which a resume needs: written too when the export fails (a full disk; the failure is raised
        after it: one export failing at every save stopped every checkpoint)."""

        def saved() -> str:
            return checkpoint.save(self.config.run_dir, {**self._counters(), **self.learner.state()})

        try:
            self.task.export(self.learner.exported(), self.config.run_dir)
            if self.learner.adapter is not None and self.config.run_dir:
                self.learner.adapter.save(os.path.join(self.config.run_dir, "adapter"))
        except Exception as failed:
            _saved_despite(failed, saved)
            raise
        return saved()

    def _counters(self) -> dict[str, Any]:
        """What a checkpoint keeps of the run's own count: its step, its policy's version, the duplicates dropped,
        and the last held-out metrics (a resumed run carries its score forward, as the uninterrupted one would)."""
        return {
            "step": self.step,
            "version": self.version,
            "dropped": self.dropped,
            # (plain floats: a task's numpy scalar is no type a weights-only load takes back)
            "evaluation": None if self.evaluation is None else {k: float(v) for k, v in self.evaluation.items()},
            "score": None if self.score is None else float(self.score),
        }

    def save_sharded(self, folder: str) -> str:
        """:meth:`save` of a sharded policy, beside every rank: the shards into ``folder``, then the rest.

        The export gathers the policy whole into this rank's host memory;
        ``checkpoint.pt`` names the folder once it is complete.
        """
        run_dir = self.config.run_dir
        self.learner.save_shards(folder)
        whole = self.learner.whole_policy_state()  # (every rank's collective: not skipped by a failing export)
        small = {**self._counters(), **self.learner.small_state()}
        state = {**small, checkpoint.SHARDS: os.path.basename(folder)}
        try:
            self.task.export(self.learner.whole_policy(whole), run_dir)
        except Exception as failed:  # (as :meth:`save`'s: the checkpoint written all the same)
            _saved_despite(failed, lambda: checkpoint.save(run_dir, state))
            raise
        return checkpoint.save(run_dir, state)

    async def _save(self) -> str:
        """Checkpoint where the run is, after sending every step's report (a resumed run's curve has no gap)."""
        self.flush_reports()
        step = self.step
        if self._saved is not None and self._saved[0] == step:
            return self._saved[1]  # (the last step fell on a periodic checkpoint: nothing changed since)
        if not self.learner.sharded:
            async with self._weights:  # (off the loop: a large policy's export takes seconds, and the loop serves)
                path = await asyncio.to_thread(self.save)
        elif not self.config.run_dir:
            return ""
        else:
            folder = checkpoint.shards_folder(self.config.run_dir, self.step)
            path = await self._with_ranks(lambda: self.save_sharded(folder), lambda rank: rank.save.call_one(folder))
        self._saved = (step, path)
        return path

    @endpoint
    async def checkpoint(self) -> str:
        """A stopping run's final checkpoint: between steps, so the reports sent cover its step, and the last (no
        step is trained after it: one trained while the run stops would leave a later checkpoint, its rows and
        the stop's "final checkpoint written" behind it)."""
        async with self._in_step:
            self._halted = True
            return await self._save()

    async def _save_between_steps(self) -> str:
        """:meth:`_save` holding the step lock: a checkpoint asked for while a periodic one is written finds it
        done (both saving at once wrote the same step twice)."""
        async with self._in_step:
            return await self._save()

    async def __cleanup__(self, exc: BaseException | None) -> None:
        if self._parallel is not None and self._stepping is None:  # leaving the group waits for a step in flight
            self._parallel.close()
        self.routes.close()
        if self.ref_publisher is not None:
            self.ref_publisher.close()


def _saved_despite(failed: Exception, save: Callable[[], str]) -> None:
    """Write the checkpoint of a save whose export failed with ``failed`` (which the caller raises next); a
    checkpoint that fails too raises its own error, from the export's."""
    try:
        save()
    except Exception as also:
        raise also from failed
