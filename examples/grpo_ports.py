"""GRPO with direct port messaging, Monarch style, on the ``actors`` runtime.

    python examples/grpo_ports.py

Generators x4 write rollouts into the scorer's port; scorer -> reference
model -> trainer are chained by ports; the trainer publishes each new policy
as a shared-memory manifest and sends it fire-and-forget to one generator
(``send(..., selection="choose")``), whose ``update_weights`` endpoint only
enqueues it for the rollout loop. A once-port tells the controller when
training is done. Only the imports would change to run this on Monarch
(and the weights would travel as state_dicts there).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch

from actors import (
    Actor,
    Channel,
    Port,
    WeightConsumer,
    WeightInbox,
    WeightManifest,
    WeightPublisher,
    current_rank,
    endpoint,
    send,
    this_host,
)

STATE, ACTIONS, HIDDEN, GROUP = 4, 4, 16, 8
GENERATORS, STEPS, CLIP, KL = 4, 60, 0.2, 0.05


def policy_net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(STATE, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, ACTIONS))


def reward_net() -> torch.nn.Module:
    torch.manual_seed(1234)  # the same frozen reward model wherever it is built
    net = torch.nn.Sequential(torch.nn.Linear(STATE + ACTIONS, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return net.requires_grad_(False)


@dataclass
class Rollout:
    state: torch.Tensor
    actions: torch.Tensor
    logps: torch.Tensor
    version: int


@dataclass
class Scored:
    rollout: Rollout
    rewards: torch.Tensor


@dataclass
class RefScored:
    scored: Scored
    ref_logps: torch.Tensor


class Generator(Actor):
    def __init__(self, out: Port[Rollout], initial: WeightManifest) -> None:
        self.out = out
        self.model = policy_net().requires_grad_(False)
        self.inbox = WeightInbox()
        self.inbox.put(initial)
        self.version = -1
        self.task: asyncio.Task[None] | None = None

    @endpoint
    async def start(self) -> None:
        """Run the rollout loop as a background task so other endpoints keep landing."""
        self.task = asyncio.create_task(self.loop())

    async def loop(self) -> None:
        while True:
            if (installed := self.inbox.install_newest(self.model)) is not None:
                self.version = installed.version
            state = torch.randn(STATE)
            with torch.no_grad():
                logps = torch.log_softmax(self.model(state), -1)
            actions = torch.multinomial(logps.exp(), GROUP, replacement=True)
            self.out.send(Rollout(state, actions, logps[actions], self.version))
            await asyncio.sleep(0.01)  # pace: this example has no credit-based backpressure

    @endpoint
    async def update_weights(self, manifest: WeightManifest) -> None:
        self.inbox.put(manifest)  # only enqueue: the loop installs the newest

    @endpoint
    async def drain(self) -> int:
        await self.stop_loop()
        self.out.send(None)
        return current_rank().rank

    async def stop_loop(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def __cleanup__(self, exc: BaseException | None) -> None:
        await self.stop_loop()
        self.inbox.close()


class Scorer(Actor):
    def __init__(self) -> None:
        self.port, self.inbox = Channel.open(Rollout)
        self.net = reward_net()

    @endpoint
    async def inlet(self) -> Port[Rollout]:
        return self.port

    @endpoint
    async def run(self, out: Port[Scored]) -> None:
        while (r := await self.inbox.recv()) is not None:
            one_hot = torch.nn.functional.one_hot(r.actions, ACTIONS).float()
            rewards = self.net(torch.cat([r.state.expand(GROUP, -1), one_hot], -1)).squeeze(-1)
            out.send(Scored(r, rewards))
        out.send(None)


class RefModel(Actor):
    def __init__(self, initial: WeightManifest) -> None:
        self.model = policy_net().requires_grad_(False)
        consumer = WeightConsumer()
        consumer.install(initial, self.model)
        consumer.close()
        self.port, self.inbox = Channel.open(Scored)

    @endpoint
    async def inlet(self) -> Port[Scored]:
        return self.port

    @endpoint
    async def run(self, out: Port[RefScored]) -> None:
        while (s := await self.inbox.recv()) is not None:
            ref = torch.log_softmax(self.model(s.rollout.state), -1)[s.rollout.actions]
            out.send(RefScored(s, ref))
        out.send(None)


class Trainer(Actor):
    def __init__(self, steps: int, done: Port[int]) -> None:
        torch.manual_seed(0)
        self.model = policy_net()
        self.optim = torch.optim.Adam(self.model.parameters(), lr=0.02)
        self.publisher = WeightPublisher("shm", slots=GENERATORS + 2)
        self.port, self.inbox = Channel.open(RefScored)
        self.steps, self.done = steps, done

    @endpoint
    async def inlet(self) -> Port[RefScored]:
        return self.port

    @endpoint
    async def initial_weights(self) -> WeightManifest:
        return self.publisher.publish(self.model, 0)

    @endpoint
    async def run(self, generators: Generator) -> None:
        for step in range(1, self.steps + 1):
            b = await self.inbox.recv()
            assert b is not None
            r, rewards = b.scored.rollout, b.scored.rewards
            adv = (rewards - rewards.mean()) / (rewards.std() + 1e-8)
            logps = torch.log_softmax(self.model(r.state), -1)[r.actions]
            ratio = (logps - r.logps).exp()
            ppo = -torch.min(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv).mean()
            kl = (b.ref_logps - logps).exp().sub(b.ref_logps - logps).sub(1).mean()
            self.optim.zero_grad()
            (ppo + KL * kl).backward()  # type: ignore[no-untyped-call]
            self.optim.step()
            if step % 10 == 0:
                print(f"step {step:3d}  reward {rewards.mean():+.3f}  kl {kl:.4f}  lag {step - 1 - r.version}")
            manifest = self.publisher.publish(self.model, step)
            send(generators.update_weights, args=(manifest,), kwargs={}, selection="choose")
        drained = await generators.drain.call()
        print(f"drained generators {sorted(drained.values())}")
        self.done.send(self.steps)

    async def __cleanup__(self, exc: BaseException | None) -> None:
        self.publisher.close()


async def main() -> None:
    host = this_host()
    gen_procs = host.spawn_procs(per_host={"gpus": GENERATORS})
    scorer_procs, ref_procs, trainer_procs = (host.spawn_procs(per_host={"gpus": 1}) for _ in range(3))
    done_port, done = Channel.open(once=True)

    trainer = trainer_procs.spawn("trainer", Trainer, STEPS, done_port)
    initial = await trainer.initial_weights.call_one()
    scorer = scorer_procs.spawn("scorer", Scorer)
    rollouts_in = await scorer.inlet.call_one()
    generators = gen_procs.spawn("generator", Generator, rollouts_in, initial)
    ref = ref_procs.spawn("ref", RefModel, initial)
    scored_in = await ref.inlet.call_one()
    ref_scored_in = await trainer.inlet.call_one()

    try:
        await generators.start.call()
        scoring = scorer.run.call_one(scored_in)  # each of these is on the wire already
        referencing = ref.run.call_one(ref_scored_in)
        training = trainer.run.call_one(generators)
        await training  # (first: a trainer that fails raises here; its done port would never be sent to)
        print(f"training finished at step {await done.recv()}")
        await scoring
        await referencing
    finally:
        for procs in (gen_procs, scorer_procs, ref_procs, trainer_procs):
            await procs.stop()


if __name__ == "__main__":
    asyncio.run(main())
