"""The launcher: the asynchronous GRPO pipeline end to end (``python -m pipeline.grpo`` runs :func:`main`).

Spawns N generators, a scorer, a reference model and a trainer, each in its
own process, wires them with typed ports, and trains the task (by default a
tiny transformer learning to reverse 6 digits) until its held-out target or
``--steps``. Progress is shown live; the run folder gets ``config.json``,
``metrics.jsonl``, ``learning_curve.png`` (a run that ends normally), ``checkpoint.pt`` (``--resume
DIR`` continues from it, versions included) and, when the ``tensorboard``
package is installed, a TensorBoard log.
A generator that dies is restarted (``--generator-restarts`` per minute)
and installs the newest policy before it produces again. Exit status: 0 on
success, 1 when a role fails (the error names it), 130 on Ctrl-C and 143 on
SIGTERM (both after a final checkpoint, given up to ``Config.stop_grace`` s;
a second interrupt skips it).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

import uvloop

from actors import (
    ActorDied,
    ActorsError,
    Channel,
    HostMesh,
    Port,
    PortReceiver,
    ProcMesh,
    forkserver_preload,
    set_forkserver_preload,
    this_host,
)

from ..config import Config, SettingsError, check_settings
from ..learning import checkpoint
from ..models import check_model
from ..roles import Generator, RefModel, Rollout, Scorer, StepReport, Trainer, TrainerRank, uses_reference
from ..tasks import check_task_settings, load_task, resolve
from ._cli import parse_args
from ._failures import PipelineError, first_failure
from ._metrics import MetricsLog, Progress, plot
from ._placement import check_alias_across_hosts, check_placement
from ._rejoins import Rejoins
from ._run_dir import drop_completions_after, outputs, refuse_earlier_run, remove_earlier_run, write_config
from ._sinks import TrackerError

if TYPE_CHECKING:
    from actors.ray import RayHostMesh

__all__ = ["Roles", "RunResult", "exit_now", "main", "run_pipeline"]


@dataclass
class Roles:
    """The actor classes to run: subclass any of them to change its behaviour."""

    generator: type[Generator] = Generator
    scorer: type[Scorer] = Scorer
    ref: type[RefModel] = RefModel
    trainer: type[Trainer] = Trainer
    trainer_rank: type[TrainerRank] = TrainerRank


@dataclass
class RunResult:
    steps: int
    version: int
    score: float | None  # the task's primary held-out metric at the end
    dropped: int
    seconds: float
    run_dir: str
    evaluation: dict[str, float] = field(default_factory=dict)  # every held-out metric at the end
    target_reached: bool = False
    startup_seconds: float = 0.0
    stop_seconds: float = 0.0
    rollouts: dict[str, int] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)  # generator -> times it was restarted
    weight_routes: list[str] = field(default_factory=list)  # which transport reaches which generators
    trainer_hosts: list[str] = field(default_factory=list)  # the host of each trainer rank (``actors.host_id``)

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds else 0.0


class _RankHosts(NamedTuple):
    """Where trainer ranks 1..N-1 go: the hosts, how many on each, and the GPU offset of each host's first."""

    hosts: HostMesh
    per_host: int
    first_gpu: int  # 1 on the trainer's host (rank 0 holds the trainer's GPU), else 0


class _Hosts(NamedTuple):
    """Where the roles go."""

    head: HostMesh  # the trainer's, scorer's and reference model's host
    everywhere: HostMesh  # the generators' hosts
    cluster: RayHostMesh | None  # the Ray host mesh, if any
    head_described: str  # the head host in words, for the run's log
    head_index: int = 0  # the head's place among the cluster's hosts

    def for_ranks(self, ranks: int) -> _RankHosts:
        """The hosts of trainer ranks 1..``ranks``-1 and how many per host: the head, or (Ray) every other host, evenly.

        The others must be one run of hosts in Ray's order (the trainer's host
        first or last among them, as it always is with two).
        """
        cluster = self.cluster
        if cluster is None or len(cluster.hosts) == 1:
            return _RankHosts(self.head, ranks - 1, 1)
        count, head = len(cluster.hosts), self.head_index
        if (ranks - 1) % (count - 1):
            raise ValueError(
                f"--trainer-ranks {ranks}: ranks 1..{ranks - 1} spread over the {count - 1} Ray hosts beside the "
                f"trainer's, so {ranks} - 1 must be a multiple of {count - 1}"
            )
        if head not in (0, count - 1):
            raise ValueError(
                f"--trainer-ranks {ranks}: the trainer's host is host {head} of {count}; its ranks go to the hosts "
                "beside it when those follow or precede it (--ray-hosts 2, or run this program on the first node)"
            )
        others = cluster.slice(slice(1, None) if head == 0 else slice(0, count - 1))
        return _RankHosts(others, (ranks - 1) // (count - 1), 0)


async def _hosts(config: Config) -> _Hosts:
    """Where the roles go: the trainer's host, every host for generators, the Ray host mesh if any.

    On a Ray cluster the trainer, scorer and reference model share one host:
    this program's own node when Ray reserved it (so checkpoints land in
    this machine's run directory), else host 0. The generators spread
    evenly over every host.
    """
    if not config.ray:
        return _Hosts(this_host(), this_host(), None, "this host")
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install -e '.[ray]'") from None
    from actors.ray import host_mesh_async

    if not ray.is_initialized():
        await asyncio.to_thread(ray.init, address=config.ray, include_dashboard=False)
    nodes = await asyncio.to_thread(ray.nodes)  # a round trip to Ray's control store: off the loop
    alive = len([node for node in nodes if node.get("Alive")])
    count = config.ray_hosts or alive
    if count > alive:
        raise ValueError(f"--ray-hosts {count}: the cluster at {config.ray} has {alive} live nodes")
    if config.generators % count:
        raise ValueError(f"--generators {config.generators} must be a multiple of the {count} Ray hosts")
    check_alias_across_hosts(config, count)
    cluster = await host_mesh_async(config.ray, hosts=count)
    here = ray.get_runtime_context().get_node_id()
    hosts = cluster.hosts
    head = next((i for i, host in enumerate(hosts) if host["node"] == here), None)
    if head is None:  # Ray reserved other nodes than this one: the checkpoints go to host 0's disk
        return _Hosts(cluster.slice(0), cluster, cluster, f"host 0 ({hosts[0]['ip']}; checkpoints go to its disk)")
    return _Hosts(cluster.slice(head), cluster, cluster, f"host {head} (this node, {hosts[head]['ip']})", head)


#: A guard on a stop on a failure or interrupt, never reached by a stop that runs its course: a process that does
#: not answer it (a loop stuck in a collective with a dead rank, or in synchronous code) is killed 2.5 s in (0.5 s
#: of grace and the runtime's 2 s for an answer); one that answered gets 3 s more to exit, then is killed and seen
#: dead within 2 s (7.5 s in all). Cutting the stop shorter would skip its kill and the removal of its files.
STOP_LIMIT = 10.0


def _take_back_cancel() -> None:
    """A cancel of this task, caught and handled, is taken back (its later waits are not cut short by it)."""
    uncancel = getattr(asyncio.current_task(), "uncancel", None)  # (Python 3.11+)
    if uncancel is not None:
        uncancel()


async def _to_the_end(step: Awaitable[object]) -> None:
    """Await a (bounded) step of the clean-up to its end: a cancel of the run meanwhile (Ctrl-C, SIGTERM) is
    taken back, so it neither cuts the step short nor replaces what the run ends with."""
    future = asyncio.ensure_future(step)
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            if future.cancelled():
                return
            _take_back_cancel()
    with contextlib.suppress(asyncio.CancelledError):
        future.result()


async def _stop_quickly(mesh: ProcMesh) -> None:
    """Stop ``mesh`` on a failure or interrupt: 0.5 s of grace, then a kill; its errors were reported.

    The stop runs to its end here, kill included (a stop left to finish in the background would be
    cancelled with the loop's other tasks as the launcher exits, and the runtime's exit hook would take
    over: SIGTERM, then SIGKILL a second later).
    """
    with contextlib.suppress(ActorsError, asyncio.TimeoutError, asyncio.CancelledError):
        await asyncio.wait_for(mesh.stop(timeout=0.5), STOP_LIMIT)


#: How long a drained generator may take to finish the rollout it is drawing once training ended (s).
DRAIN_GUARD = 120.0
#: How long the scorer and the reference model may then take over the rollouts still on their way (s).
LEFTOVER_GUARD = 10.0


async def _leftovers(
    gens: Generator,
    tasks: dict[str, asyncio.Task[Any]],
    names: list[str],
    producing: set[int],
    rollouts_in: Port[Rollout],
) -> list[int | None]:
    """Drain the generators and let every role finish what is on its way; each generator's rollouts sent.

    A generator restarted during training that is not producing again yet
    (``producing`` lacks its rank: its new process may still be loading its
    model) owes nothing: its rejoin is cancelled, not drained or waited for,
    and its end of stream is sent to the scorer (``rollouts_in``) for it (the
    scorer ends once every generator's stream has ended).

    Training is over, so the run's result stands whatever happens here: a
    role that fails (a reward function raising on a leftover rollout, a
    generator dying) is said on stderr, a generator's count then unknown
    (None), and the roles still busy at their guard (:data:`DRAIN_GUARD`,
    then :data:`LEFTOVER_GUARD`) are stopped with the rest (a large model's
    leftovers may take longer).
    """
    say = functools.partial(print, file=sys.stderr, flush=True)
    roles = [*names, *(role for role in ("scorer", "reference model") if role in tasks)]
    pending = [tasks[role] for role in roles]
    for rank, name in enumerate(names):
        if rank not in producing:
            tasks[name].cancel()
            try:
                rollouts_in.send(None)  # (it sent nothing: its run was never called)
            except ActorsError as exc:  # (the scorer gone since training ended: its task says so below)
                say(f"warning: ending generator {rank}'s stream failed after training ended: {exc}")
    # (a drain lands between rollouts: it answers once each generator's rollout in flight is done)
    draining = asyncio.ensure_future(
        _drained(gens, [rank for rank, name in enumerate(names) if rank in producing and not tasks[name].done()])
    )
    await asyncio.wait([draining, *pending[: len(names)]], timeout=DRAIN_GUARD, return_when=asyncio.ALL_COMPLETED)
    if not draining.done():
        draining.cancel()
    elif not draining.cancelled() and isinstance(draining.exception(), ActorsError):
        error = draining.exception()
        if not isinstance(error, ActorDied):  # (a dead generator: its run task says so below)
            say(f"warning: draining the generators failed after training ended (the run's result stands): {error}")
    producers = [
        task for rank, task in enumerate(pending[: len(names)]) if rank in producing
    ]  # (not a cancelled rejoin)
    if all(task.done() and not task.cancelled() and task.exception() is None for task in producers):
        await asyncio.wait(pending, timeout=LEFTOVER_GUARD)  # (else a stream never ends: nothing to wait for)
    outcomes: dict[str, int | None] = {}
    for role, task in zip(roles, pending, strict=True):
        outcomes[role] = None
        if not task.done():
            task.cancel()
        elif task.cancelled():
            pass
        elif task.exception() is not None:
            say(f"warning: {role} failed after training ended (the run's result stands): {task.exception()}")
        else:
            outcomes[role] = task.result()
    return [outcomes[name] for name in names]


async def _drained(gens: Generator, ranks: list[int]) -> None:
    """Drain the generators of ``ranks``: those still running. One whose run has ended has nothing to drain (its
    process died, and the one restarted in its place may still be loading its model: a drain would wait for that)."""
    await asyncio.gather(*(gens.slice(procs=rank).drain.call_one() for rank in ranks))


async def _written(consumer: asyncio.Future[None], reports: PortReceiver[StepReport]) -> None:
    """Let ``consumer`` write every report already received (those sent before the final checkpoint)."""
    while not consumer.done() and reports.qsize():
        await asyncio.sleep(0)  # (one turn of the loop: the consumer takes what is queued)
    await asyncio.sleep(0)  # (and writes the last one it took)


async def _stopping(
    trainer: Trainer | None,
    trained: asyncio.Future[Any] | None,
    consumer: asyncio.Future[None] | None,
    reports: PortReceiver[StepReport] | None,
    progress: Progress,
    grace: float,
) -> None:
    """A stopping run's last steps: the trainer's final checkpoint, if it is training (a trainer still starting has
    nothing new to save: a resumed sharded one would save its untrained policy over the checkpoint it resumes),
    then every report already received is written."""
    if trainer is not None and trained is not None and not trained.done():
        progress.done()
        if (
            consumer is not None
            and consumer.done()
            and not consumer.cancelled()
            and isinstance(consumer.exception(), PipelineError)
        ):
            # (its rows stopped at the failure: a checkpoint past them would leave steps with no row for good)
            print(
                "stopping: no final checkpoint (the run's rows could not be written): the run folder keeps the "
                "last one",
                file=sys.stderr,
                flush=True,
            )
        else:
            await _final_checkpoint(trainer, grace)
    if consumer is not None and reports is not None:
        await _written(consumer, reports)


async def _final_checkpoint(trainer: Trainer, grace: float) -> None:
    """Ask the trainer for a checkpoint of where it is, waiting up to ``grace`` s; says on stderr how it went.

    A large policy's checkpoint takes seconds (the trainer finishes the step
    it is in first). A second interrupt cancels the wait, and so does the
    grace running out: the run folder then keeps its last checkpoint.
    """
    say = functools.partial(print, file=sys.stderr, flush=True)
    if grace == 0:
        say("stopping: no final checkpoint (--stop-grace 0): the run folder keeps the last one")
        return
    say(f"stopping: writing a final checkpoint (up to {grace:g} s; interrupt again to skip it)")
    try:
        await asyncio.wait_for(trainer.checkpoint.call_one(), grace)
    except asyncio.TimeoutError:
        say(f"final checkpoint not written within {grace:g} s (--stop-grace): the run folder keeps the last one")
    except asyncio.CancelledError:
        say("final checkpoint skipped: the run folder keeps the last one")
        raise
    except Exception as exc:  # whatever it was, the interrupt stands: the run still stops as asked
        say(f"final checkpoint failed: {exc}")
    else:
        say("final checkpoint written")


async def run_pipeline(
    config: Config,
    *,
    resume: bool = False,
    quiet: bool = False,
    roles: Roles | None = None,
    overwrite: bool = False,
) -> RunResult:
    """Run the pipeline described by ``config``; raises PipelineError if a role fails.

    A fresh run (not ``resume``) refuses a run folder holding an earlier run's outputs, unless ``overwrite``
    removes them first (:mod:`._run_dir`).
    """
    roles = roles or Roles()
    check_settings(config)  # before anything starts: settings that cannot train start nothing
    check_task_settings(config)
    check_placement(config)  # nor do roles that cannot be placed
    if not resume and not overwrite:
        refuse_earlier_run(config.run_dir)  # nor does a run that would mix with an earlier one
    config = resolve(config)
    # a task that cannot be built fails here, with its own message, before any process starts
    modules = load_task(config).role_modules
    preloaded = forkserver_preload()  # what the roles all import, imported once by the forkserver that forks them
    set_forkserver_preload(preloaded + tuple(name for name in modules if name not in preloaded))
    if config.trust_remote_code:  # the model's own code imported here first: the roles then find it in the cache
        check_model(config.model, trust_remote_code=True)
    if not resume and overwrite:  # only once the run's settings, task and model are known good
        remove_earlier_run(config.run_dir)
    os.makedirs(config.run_dir, exist_ok=True)
    checkpoint.remove_stale_staging(config.run_dir)  # an earlier run killed while it saved
    if resume and not checkpoint.exists(config.run_dir):
        raise FileNotFoundError(f"no checkpoint in {config.run_dir!r} to resume from")
    if resume:
        done = checkpoint.saved_step(config.run_dir)
        if config.steps <= done:
            raise SettingsError(
                f"--resume {config.run_dir}: its checkpoint is at step {done}, and --steps {config.steps} asks for "
                f"no step more: give --steps above {done}"
            )
        drop_completions_after(config.run_dir, done)  # (the steps past it are evaluated again)
    write_config(config.run_dir, config)

    started = time.perf_counter()
    finished = False  # the run ended normally: only then is the learning curve drawn
    meshes: list[ProcMesh] = []
    log: MetricsLog | None = None
    progress = Progress(config.steps, quiet)
    tasks: dict[str, asyncio.Task[Any]] = {}
    consumer: asyncio.Future[None] | None = None
    reports: PortReceiver[StepReport] | None = None
    trainer = None
    cluster: RayHostMesh | None = None
    try:
        placed = await _hosts(config)
        head, everywhere, cluster, head_described = (
            placed.head,
            placed.everywhere,
            placed.cluster,
            placed.head_described,
        )
        trainer_hosts: list[str] = []  # filled when the ranks join (one trainer: left empty)
        rank_hosts = placed.for_ranks(config.trainer_ranks) if config.trainer_ranks > 1 else None  # refused early
        # torch threads are set where the processes start: a worker with more than one is forked from a fresh
        # forkserver (GNU OpenMP hangs in a child of a process that already ran its thread pool)
        threads = config.threads

        def started_procs(start: Callable[[], ProcMesh]) -> ProcMesh:
            """Start a role's processes; each mesh is listed to stop as soon as it exists (a later start that
            fails leaves none of the earlier ones running)."""
            try:
                mesh = start()
            except RuntimeError as exc:  # (a Ray host lost, a spawn's hand-over timed out)
                raise PipelineError(f"starting the roles' processes failed: {exc}") from exc
            meshes.append(mesh)
            return mesh

        trainer_procs = started_procs(lambda: head.spawn_procs(per_host={"procs": 1}, name="trainer", threads=threads))
        scorer_procs = started_procs(lambda: head.spawn_procs(per_host={"procs": 1}, name="scorer", threads=threads))
        ref_procs = (
            started_procs(lambda: head.spawn_procs(per_host={"procs": 1}, name="ref", threads=threads))
            if uses_reference(config)
            else None
        )
        per_host = config.generators // (len(cluster.hosts) if cluster is not None else 1)
        gen_procs = started_procs(
            lambda: everywhere.spawn_procs(
                per_host={"procs": per_host},
                name="generators",
                threads=threads,
                restart="on-failure" if config.generator_restarts > 0 else "never",
                max_restarts=max(1, config.generator_restarts),
                restart_period=60.0,
            )
        )
        rank_procs = None
        if rank_hosts is not None:
            hosts_for_ranks = rank_hosts
            rank_procs = started_procs(
                lambda: hosts_for_ranks.hosts.spawn_procs(
                    per_host={"procs": hosts_for_ranks.per_host}, name="trainer-ranks", threads=threads
                )
            )
        # stopped in this order at the end: the generators first, which feed the rest
        meshes[:] = [m for m in (gen_procs, scorer_procs, ref_procs, trainer_procs, rank_procs) if m is not None]
        # Only now, with the roles' processes forked from a still single-threaded
        # launcher, the threads of a runtime and of TensorBoard's writer start.
        reports_port, reports = Channel.open(StepReport)
        log = metrics_log = MetricsLog(config.run_dir, config.report_to, config.to_dict())

        trainer = trainer_procs.spawn("trainer", roles.trainer, config, reports_port, resume)
        if rank_procs is not None and rank_hosts is not None:  # rank 0 serves the rendezvous; every rank joins
            spawned_ranks: Any = rank_procs.spawn(
                "trainer-ranks", roles.trainer_rank, config, resume, rank_hosts.first_gpu
            )
            ranks: TrainerRank = spawned_ranks.flatten("procs")  # one dimension however many hosts: sliced by procs
            address = await trainer.rendezvous.call_one(config.trainer_ranks)
            first, joined = await asyncio.gather(
                trainer.join.call_one(ranks, config.trainer_ranks), ranks.join.call(address, config.trainer_ranks)
            )
            trainer_hosts = [first, *(where for _, where in sorted(joined.values()))]
        scorer = scorer_procs.spawn("scorer", roles.scorer, config)
        policy_manifest, ref_manifest = await trainer.initial_manifests.call_one()
        rollouts_in = await scorer.inlet.call_one()
        initial = policy_manifest if cluster is None else None  # across hosts the first grant brings it
        spawned: Any = gen_procs.spawn("generator", roles.generator, config, rollouts_in, initial)
        gens: Generator = spawned.flatten("procs")  # one dimension of ranks, however many hosts
        weight_routes = await trainer.route_weights.call_one(gens)
        if cluster is not None:  # on one host there is nothing to choose: the run's transport reaches all
            progress.note(
                f"placed on {len(cluster.hosts)} Ray hosts: trainer, scorer and reference on {head_described}"
            )
            progress.note("weights: " + "; ".join(weight_routes))
        trainer_in = await trainer.inlet.call_one()
        ref = None
        if ref_procs is not None and ref_manifest is not None:  # β > 0: scorer -> reference model -> trainer
            ref = ref_procs.spawn("ref", roles.ref, config, ref_manifest)
            scored_in = await ref.inlet.call_one()
        else:  # β = 0: the scorer feeds the trainer
            scored_in = trainer_in
        grants = list((await gens.grant_inlet.call()).values())
        startup = time.perf_counter() - started

        generator_names = [f"generator {rank}" for rank in range(config.generators)]
        tasks = {
            **{
                name: asyncio.ensure_future(gens.slice(procs=r).run.call_one())
                for r, name in enumerate(generator_names)
            },
            "scorer": asyncio.ensure_future(scorer.run.call_one(scored_in, config.generators)),
            **({"reference model": asyncio.ensure_future(ref.run.call_one(trainer_in))} if ref is not None else {}),
            "trainer": asyncio.ensure_future(trainer.run.call_one(gens, grants, ref)),
        }
        training_started = time.perf_counter()
        rejoins = Rejoins(gens, gen_procs, trainer, tasks, generator_names, progress)
        gen_procs.add_failure_handler(rejoins.on_failure)

        async def consume_reports() -> None:
            while (report := await reports.recv()) is not None:
                try:
                    row = metrics_log.write(report)
                except Exception as exc:  # this process's own failure (a full disk), not the trainer's
                    raise PipelineError(f"writing the run's metrics failed: {exc}") from exc
                progress.update(row, force=report.step == config.steps)

        consumer = asyncio.ensure_future(consume_reports())
        await first_failure(tasks, consumer)
        summary = await tasks["trainer"]
        seconds = time.perf_counter() - training_started
        progress.done()
        rejoins.end_training()
        stop_started = time.perf_counter()
        try:
            produced = await _leftovers(gens, tasks, generator_names, rejoins.producing, rollouts_in)
            stop_started = time.perf_counter()
            for mesh in meshes:
                await mesh.stop(timeout=2)
        except asyncio.CancelledError:  # Ctrl-C or SIGTERM once training ended: its result stands
            _take_back_cancel()
            produced = [None] * len(generator_names)
            progress.note("interrupted once training had ended: the leftovers are not waited for")
        result = RunResult(
            steps=summary["steps"],
            version=summary["version"],
            score=summary["score"],
            dropped=summary["dropped"],
            seconds=seconds,
            run_dir=config.run_dir,
            evaluation=summary["evaluation"] or {},
            target_reached=config.target_score is not None
            and summary["score"] is not None
            and summary["score"] >= config.target_score,
            startup_seconds=startup,
            stop_seconds=time.perf_counter() - stop_started,
            rollouts={name: count for name, count in zip(generator_names, produced, strict=True) if count is not None},
            restarts=rejoins.restarts,
            weight_routes=weight_routes,
            trainer_hosts=trainer_hosts,
        )
        finished = True
        return result
    except asyncio.CancelledError:  # Ctrl-C or SIGTERM: leave a checkpoint, then stop fast
        await _stopping(trainer, tasks.get("trainer"), consumer, reports, progress, config.stop_grace)
        raise
    except PipelineError as failure:  # a role failed: the trainer, if it lives, leaves a checkpoint first
        try:
            await _stopping(trainer, tasks.get("trainer"), consumer, reports, progress, config.stop_grace)
        except asyncio.CancelledError:  # the interrupt the wait invites skips the checkpoint, not the failure
            raise failure from None
        raise
    except ActorsError as exc:  # a role failed outside the watched tasks (e.g. at startup)
        raise PipelineError(f"a role failed: {exc}") from exc
    finally:
        for task in [*tasks.values(), *([consumer] if consumer is not None else [])]:
            task.cancel()
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: the failure was already reported
        progress.done()
        # An interrupt from here on (a second Ctrl-C while the processes stop) cuts no step of the clean-up
        # short, nor replaces what the run ends with: a role's failure, the interrupt before, or the result.
        # every mesh at once: a process stuck in a collective with a dead rank takes its grace before its kill
        await _to_the_end(asyncio.gather(*(_stop_quickly(mesh) for mesh in meshes)))
        if cluster is not None:
            await _to_the_end(cluster.shutdown_async())
        if log is not None:  # after the roles stop: a tracker's close may take a while (W&B syncs its run)
            try:
                log.close()
            except Exception as exc:  # (the run's own outcome stands: a full disk's failure, or the result)
                print(f"warning: closing the run's metrics failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        if finished:  # a failed or interrupted run stops first (matplotlib takes 0.6-1.5 s): its rows are kept
            with contextlib.suppress(Exception):
                plot(config.run_dir)


async def _until_terminated(run: Coroutine[Any, Any, RunResult]) -> RunResult:
    """Run ``run``; every Ctrl-C and SIGTERM cancels it (a final checkpoint, a clean stop), and one whose run
    ends cancelled by a Ctrl-C first raises :class:`KeyboardInterrupt`.

    Each interrupt is a cancel handled on the loop, never an exception raised wherever the thread is: asyncio's
    own second Ctrl-C raised ``KeyboardInterrupt`` in the middle of the clean-up (the processes' stop, the
    metrics log's close), cutting it short and replacing a role's failure. The clean-up's steps take a cancel
    back (:func:`_to_the_end`); each is bounded.
    """
    task = asyncio.ensure_future(run)
    loop = asyncio.get_running_loop()
    signals: list[int] = []

    def interrupted(signum: int) -> None:
        signals.append(signum)
        task.cancel()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, interrupted, signum)
    try:
        return await task
    except asyncio.CancelledError:
        if task.cancelled() and signals and signals[0] == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


def main(argv: list[str] | None = None) -> int:
    try:
        config, args = parse_args(argv)
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        run = run_pipeline(config, resume=bool(args.resume), quiet=args.quiet, overwrite=args.overwrite)
        result = uvloop.run(_until_terminated(run))
    except KeyboardInterrupt:
        print(f"\ninterrupted; {_resume_hint(config.run_dir)}")
        return 130
    except asyncio.CancelledError:
        print(f"\nterminated; {_resume_hint(config.run_dir)}")
        return 143
    except SettingsError as exc:  # found once the run's folder or task is looked at: nothing started
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except PipelineError as exc:
        print(f"error: {exc}\n{_resume_hint(config.run_dir)}", file=sys.stderr)
        return 1
    except (OSError, ValueError, TrackerError) as exc:  # (a run folder that is a file, or read-only, among them)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    held_out = ", ".join(f"{name} {value:.3f}" for name, value in result.evaluation.items()) or "n/a"
    reached = f" (target {config.target_score} reached)" if result.target_reached else ""
    print(
        f"done: {result.steps} steps in {result.seconds:.1f}s ({result.steps_per_second:.1f} steps/s) after "
        f"{result.startup_seconds:.1f}s starting the roles, held-out {held_out}{reached}; "
        f"{result.dropped} duplicate rollouts dropped, policy version {result.version}\n"
        f"outputs in {result.run_dir}: {', '.join(outputs(result.run_dir))}"
    )
    return 0


def _resume_hint(run_dir: str) -> str:
    """Where a stopped run can continue from: its checkpoint, if it wrote one."""
    if checkpoint.exists(run_dir):
        return f"the last checkpoint is in {run_dir} (resume with --resume {run_dir})"
    return f"no checkpoint was written in {run_dir}: there is nothing to resume"


def exit_now(code: int) -> NoReturn:
    """End the launcher's process once the run has cleaned up after itself.

    The exit hooks (runtime, forkserver: every actor process and segment)
    run first and output is flushed; only the interpreter's teardown of
    torch's and matplotlib's modules (~0.7 s here) is skipped, which keeps
    Ctrl-C and role failures well inside their 2 s bound.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
