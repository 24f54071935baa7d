"""Pipeline roles and tasks the pipeline tests spawn or name (``pipeline_support:WideBandit``)."""

from __future__ import annotations

import asyncio
import math
import os
import resource
import time
from typing import Any

import torch

from actors import Actor, context, current_rank, current_size, endpoint, this_host
from actors.tensors import is_sharded
from pipeline import BanditTask, Config, Generator, Learner, RefModel, Scorer, Trainer, resolve
from pipeline.learning import DataParallel, GroupAddress, RankShare, Rendezvous, group_kind
from pipeline.roles import TrainerRank
from pipeline.tasks import load_task, to_device


class WideBandit(BanditTask):
    """A custom task by subclassing: six actions."""

    action_dim = 6


class SlowExportBandit(BanditTask):
    """The bandit on a slow disk: each checkpoint's export marks that it began (``export-started`` in the run
    folder), then takes ``SLOW_EXPORT_S`` seconds (from the environment, which the workers inherit)."""

    def export(self, policy: torch.nn.Module, run_dir: str) -> str | None:
        if run_dir:
            with open(os.path.join(run_dir, "export-started"), "w"):
                pass
        time.sleep(float(os.environ.get("SLOW_EXPORT_S", "0")))  # the stand-in's slowness, not a synchronisation
        return None


class FullDiskExportBandit(BanditTask):
    """The bandit whose export always fails as a full disk would."""

    def export(self, policy: torch.nn.Module, run_dir: str) -> str | None:
        raise OSError(28, "No space left on device (the export)")


class FailingScorer(Scorer):
    """Raises on its 20th rollout: the run must stop with an error naming the scorer."""

    def score(self, rollout):  # type: ignore[no-untyped-def]
        self.seen = getattr(self, "seen", 0) + 1
        if self.seen == 20:
            raise RuntimeError("scorer exploded on purpose")
        return super().score(rollout)


class ForbiddenRefModel(RefModel):
    """A reference model that fails the run if it is ever built (a run with β = 0 must not build one)."""

    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("a run without a KL term built a reference model")


class SyncRecordingRefModel(RefModel):
    """Appends, for each rollout it scores, the rollout's ticket, the reference version it holds and a checksum of
    its weights to ``ref_syncs.txt`` in the run's folder."""

    def reference_logps(self, rollout):  # type: ignore[no-untyped-def]
        checksum = sum(float(p.double().sum()) for p in self.model.parameters())
        with open(os.path.join(self.config.run_dir, "ref_syncs.txt"), "a") as f:
            f.write(f"{rollout.ticket} {self.version} {checksum!r}\n")
        return super().reference_logps(rollout)


class HookedGenerator(Generator):
    """Counts rollouts with hooks; the post hook raises once ``limit`` is reached."""

    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.seen_pre = 0
        self.register_pre_collect_hook(self._pre)
        self.register_post_collect_hook(self._post)

    def _pre(self, generator):  # type: ignore[no-untyped-def]
        self.seen_pre += 1

    def _post(self, generator, rollout):  # type: ignore[no-untyped-def]
        assert rollout.generator == self.id and rollout.version == self.version
        if self.seen_pre >= self.config.extra.get("hook_limit", 10**9):
            raise ValueError(f"hook stopped generator {self.id} after {self.seen_pre} rollouts")


class ProbeGenerator(Generator):
    """Appends ``rank pid version`` to ``<run_dir>/first_rollouts`` before its first rollout."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.register_pre_collect_hook(self._first)
        self.first = True

    def _first(self, generator) -> None:  # type: ignore[no-untyped-def]
        if self.first:
            self.first = False
            with open(os.path.join(self.config.run_dir, "first_rollouts"), "a") as f:
                f.write(f"{self.id} {os.getpid()} {self.version}\n")


def _note(run_dir: str, line: str) -> None:
    with open(os.path.join(run_dir, "dtypes"), "a") as f:
        f.write(line + "\n")


class DtypeGenerator(Generator):
    """Notes ``generator <dtypes of its weights>`` in ``<run_dir>/dtypes`` before each rollout."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.register_pre_collect_hook(self._note)

    def _note(self, generator) -> None:  # type: ignore[no-untyped-def]
        dtypes = sorted({str(p.dtype) for p in self.policy.state_dict().values() if p.is_floating_point()})
        _note(self.config.run_dir, f"generator {' '.join(dtypes)}")


class DtypeRefModel(RefModel):
    """Notes ``ref <dtypes of its weights>`` in ``<run_dir>/dtypes`` once built."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        dtypes = sorted({str(p.dtype) for p in self.model.state_dict().values() if p.is_floating_point()})
        _note(self.config.run_dir, f"ref {' '.join(dtypes)}")


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor gathered whole if it is a shard (a collective of its group), detached."""
    whole = tensor.full_tensor() if is_sharded(tensor) else tensor  # type: ignore[attr-defined]
    return whole.detach().cpu()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: its shard, or the tensor itself."""
    return tensor.to_local() if is_sharded(tensor) else tensor  # type: ignore[attr-defined]


class RoutedBlock(torch.nn.Module):
    """One block holding two experts (a mixture-of-experts layer): each row goes through the expert it names."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return self.experts[expert](x).sum()


class ExpertPolicy(torch.nn.Module):
    """A scale, then a block of experts (one sharded unit, its experts in it: their ``ModuleList`` is the block's)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(4))
        self.blocks = torch.nn.ModuleList([RoutedBlock()])

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        return self.blocks[0](x * self.scale, expert)


class GroupRank(Actor):
    """A rank of a process group on this machine; rank 0 serves the store the others join through."""

    rendezvous: Rendezvous | None = None

    @endpoint
    def serve(self, world: int) -> GroupAddress:
        """Rank 0: the store the others join through."""
        self.rendezvous = Rendezvous("127.0.0.1", world)
        return self.rendezvous.address


class ExpertRank(GroupRank):
    """One rank of a sharded (FSDP2) group over a :class:`RoutedBlock`, each rank's rows routed to its own expert."""

    @endpoint
    def step(self, address: GroupAddress) -> dict[str, torch.Tensor]:
        """This rank's backward through its expert; each parameter's summed gradient, gathered whole."""
        rank = current_rank().rank
        parallel = group_kind("fsdp")(RankShare(rank, 2), address, torch.device("cpu"), rendezvous=self.rendezvous)
        try:
            torch.manual_seed(0)
            policy = ExpertPolicy()
            parallel.shard(policy, policy)
            policy(torch.full((1, 4), float(rank + 1)), rank).backward()
            return {name: _whole(p.grad) for name, p in policy.named_parameters() if p.grad is not None}
        finally:
            parallel.close()


class LearnerRank(GroupRank):
    """One rank of a data-parallel learner on the CPU: joins the group, takes one step, reports its weights."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings

    @endpoint
    def step(
        self,
        address: GroupAddress,
        samples: Any,
        rewards: torch.Tensor,
        ref: torch.Tensor | None,
        shard: str = "ddp",
        folder: str = "",
        device: str = "cpu",
    ) -> dict[str, Any]:
        """One update of this rank's share: the summed gradients and the weights after it (whole), loss, norm, figures.

        With ``folder``, the ranks then save their shards there (a ``{rank}`` in it: each rank its own folder, as
        ranks on hosts without a shared disk do), and ``saved`` says how that went. On ``cuda`` the rank joins over
        NCCL.
        """
        share = RankShare(current_rank().rank, math.prod(current_size().values()))
        parallel = group_kind(shard)(share, address, torch.device(device), rendezvous=self.rendezvous)
        on = parallel.device
        samples, rewards = to_device(samples, on), rewards.to(on)
        ref = None if ref is None else ref.to(on)
        try:
            backend = str(torch.distributed.get_backend())  # read while the group is up: close() tears it down
            learner = Learner(load_task(resolve(Config(**self.settings))), on, stage_on_host=shard == "fsdp")
            learner.share_with(parallel)
            held = sum(_local(p).numel() * p.element_size() for p in learner.policy.parameters())
            slices, rows = learner.task.micro_batches(samples, learner.micro_batch), learner.task.rows(samples)
            passes, idle = parallel.passes(slices, rows), parallel.idle_passes(slices, rows)
            update = learner.update(samples, rewards, ref)
            saved = ""
            if folder:
                try:
                    learner.save_shards(folder.format(rank=f"-{share.rank}" if share.rank else ""))
                    saved = "saved"
                except RuntimeError as exc:
                    saved = str(exc)
            weights = {name: _whole(value) for name, value in learner.policy.state_dict().items()}
            gradients = {name: _whole(p.grad) for name, p in learner.policy.named_parameters() if p.grad is not None}
        finally:
            parallel.close()
        return {
            "weights": weights,
            "gradients": gradients,
            "loss": float(update.report.loss),
            "grad_norm": update.grad_norm,
            "figures": update.report.figures(),
            "passes": [[part.start, part.stop] for part in passes],
            "idle": len(idle),
            "held_bytes": held,  # this rank's parameters: its shards, or the whole policy
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "device": str(on),
            "backend": backend,
            "saved": saved,
            "on_device": sorted({str(_local(p).device) for p in learner.policy.parameters()}),
            "reference_on": sorted({str(value.device) for value in learner.reference_state.values()}),
        }

    @endpoint
    def join(self, address: GroupAddress, world: int, timeout: float) -> str:
        """Join the group at ``address`` as this mesh's rank (rank 0 serves it): "joined", or the error a user sees."""
        rank = context().actor_instance.rank.rank  # (its own rank: it may be called through a slice)
        try:
            group = DataParallel(
                RankShare(rank, world), address, torch.device("cpu"), rendezvous=self.rendezvous, timeout=timeout
            )
        except Exception as exc:  # the test reads what a user would see
            return f"{type(exc).__name__}: {exc}"
        group.close()
        return "joined"


def ranks_step(
    world: int,
    settings: dict[str, Any],
    samples: Any,
    rewards: torch.Tensor,
    ref: torch.Tensor | None,
    shard: str,
    folder: str = "",
    timeout: float = 120,
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """``world`` :class:`LearnerRank` processes on ``device`` take one step together; each one's report, by rank."""
    mesh = this_host().spawn_procs({"procs": world}, name="learner-ranks")
    try:
        ranks = mesh.spawn("ranks", LearnerRank, settings)
        address = ranks.slice(procs=0).serve.call_one(world).get(timeout=30)
        reports = ranks.step.call(address, samples, rewards, ref, shard, folder, device).get(timeout=timeout)
    finally:
        mesh.stop().get(timeout=30)
    return [report for _, report in reports.items()]


def tiny_qwen2(vocab: int = 300, width: int = 32, heads: int = 4, seed: int = 0, **extra: Any) -> Any:
    """A random two-layer Qwen2 with a tied head (unless ``tie_word_embeddings=False``), built from a config (nothing
    downloaded), in eval mode."""
    import transformers

    torch.manual_seed(seed)
    extra.setdefault("tie_word_embeddings", True)
    config = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        **extra,
    )
    return transformers.Qwen2ForCausalLM(config).eval()


class DrainFailingGenerator(Generator):
    """Generator 0's ``drain`` (training over) raises after draining, or, with ``extra["drain_exit"]``, its process
    dies there (and is restarted: the run's result must stand either way)."""

    @endpoint
    async def drain(self) -> None:
        await super().drain()
        if self.id == 0:
            if self.config.extra.get("drain_exit"):
                os._exit(9)
            raise RuntimeError("drain exploded on purpose")


class StuckStartTrainer(Trainer):
    """A trainer whose start never finishes (its first manifests wait forever): the run is interrupted while it
    starts. Writes ``<run_dir>/starting`` once it is there."""

    @endpoint
    async def initial_manifests(self):  # type: ignore[no-untyped-def]
        with open(os.path.join(self.config.run_dir, "starting"), "w") as f:
            f.write("waiting\n")
        await asyncio.Event().wait()


#: How late :class:`LateJoiningRank` comes to the trainer ranks' group.
LATE_JOIN_S = 4.0


class LateJoiningRank(TrainerRank):
    """A trainer rank that comes to the group late (a slow host): ``--collective-timeout`` bounds the others' wait."""

    @endpoint
    async def join(self, address, world):  # type: ignore[no-untyped-def]
        await asyncio.sleep(LATE_JOIN_S)  # (the fault injected: not a synchronisation)
        return await super().join(address, world)


class DyingOnRejoinTrainer(Trainer):
    """A trainer whose process exits as a restarted generator rejoins (in ``generator_restarted``)."""

    @endpoint
    async def generator_restarted(self, generator, grants):  # type: ignore[no-untyped-def]
        os._exit(3)


class SlowCheckpointTrainer(Trainer):
    """A trainer whose final checkpoint takes minutes: writes ``<run_dir>/saving`` when one is asked for."""

    @endpoint
    async def checkpoint(self) -> str:  # type: ignore[override]
        with open(os.path.join(self.config.run_dir, "saving"), "w") as f:
            f.write("saving\n")
        await asyncio.sleep(600)
        return await super().checkpoint()


class SaveCountingTrainer(Trainer):
    """Appends the step of each checkpoint it writes to ``saves.txt`` in the run's folder."""

    def save(self) -> str:
        with open(os.path.join(self.config.run_dir, "saves.txt"), "a") as f:
            f.write(f"{self.step}\n")
        return super().save()


class OffTheLoopSaveTrainer(SaveCountingTrainer):
    """Refuses to write a checkpoint on its event loop (a large policy's export there stalled every endpoint)."""

    def save(self) -> str:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # a thread of its own: the loop serves meanwhile
            return super().save()
        raise RuntimeError("the checkpoint was written on the trainer's event loop")


class FailsAtStepTrainer(Trainer):
    """Fails training its 13th step (its reports of steps 11 and 12 still buffered, not a batch of 10 yet)."""

    async def train(self, item):  # type: ignore[no-untyped-def]
        if self.step == 12:
            raise RuntimeError("the trainer failed at step 13 on purpose")
        return await super().train(item)


class SlowReferenceSyncTrainer(Trainer):
    """Its reference's sync takes half a second more: not the policy's publish, which must not count it."""

    async def sync_reference(self, reference):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.5)
        await super().sync_reference(reference)


class VersionIgnoringGenerator(Generator):
    """Draws every ticket with whatever policy it holds, never installing the version the ticket needs."""

    async def reach_version(self, version: int) -> None:
        return None
