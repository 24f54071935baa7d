"""A custom task and a custom role, by subclassing, run through the GRPO pipeline.

    python examples/custom_task.py

``ThresholdBandit`` subclasses the built-in bandit task and replaces what
its Scorer scores with: 6 actions, and the reward of action ``a`` is high
when the state's first coordinate falls in the a-th band. A wholly new task
subclasses :class:`pipeline.Task` the same way (``build_policy``, ``sample``,
``score``, ``reference_logps``, ``loss``, ``evaluate``). ``CountingGenerator``
adds instrumentation hooks around each rollout. Classes must live at module
level so the actor processes can import them (``--task module:Class`` on the
command line).
"""

from __future__ import annotations

import asyncio
import tempfile

import torch

from pipeline import BanditTask, Config, Generator, Roles, Rollout, run_pipeline


class ThresholdBandit(BanditTask):
    action_dim = 6

    def build_scorer(self, device: torch.device) -> torch.nn.Module:
        edges = torch.linspace(-2.0, 2.0, self.action_dim + 1)
        centers = ((edges[:-1] + edges[1:]) / 2).to(device)

        class BandReward(torch.nn.Module):
            def forward(self, inputs: torch.Tensor) -> torch.Tensor:
                x, one_hot = inputs[:, :1], inputs[:, -6:]
                return -(x - centers.unsqueeze(0)).abs().mul(one_hot).sum(-1, keepdim=True)

        return BandReward().to(device)


class CountingGenerator(Generator):
    """Counts rollouts per policy version with worker-local hooks."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.per_version: dict[int, int] = {}
        self.register_post_collect_hook(self.count)

    def count(self, generator: Generator, rollout: Rollout) -> None:
        self.per_version[rollout.version] = self.per_version.get(rollout.version, 0) + 1
        if rollout.rollout_id and rollout.rollout_id % 500 == 0:
            print(f"generator {self.id}: {rollout.rollout_id} rollouts over {len(self.per_version)} versions")


async def main() -> None:
    config = Config(
        steps=1500, task=f"{__name__}:ThresholdBandit", group=12, run_dir=tempfile.mkdtemp(prefix="custom-task-")
    )
    result = await run_pipeline(config, quiet=True, roles=Roles(generator=CountingGenerator))
    print(f"custom task: {result.steps} steps, normalized score {result.score:.3f}, outputs in {result.run_dir}")


if __name__ == "__main__":
    asyncio.run(main())
