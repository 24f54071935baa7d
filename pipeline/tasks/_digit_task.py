"""The digit tasks as a :class:`~pipeline.tasks.Task`: a tiny transformer learns them by GRPO on tokens.

Each rollout is ``prompts`` prompts x ``group`` sampled completions
(:class:`TokenBatch`); the scorer verifies them (:func:`pipeline.tasks.verify`),
the reference model adds per-token log-probabilities, the trainer applies
:func:`pipeline.algorithm.token_grpo_loss`, and evaluation decodes a fixed,
held-out set of prompts greedily and reports exact-match accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..models import PRESETS, TinyTransformer, completion_logps, generate
from ._completion_loss import completion_loss
from ._digits import EOS, PAD, VOCAB, DigitProblem, verify
from ._interface import LossReport, Scores, Task

if TYPE_CHECKING:
    from ..config import Config

__all__ = ["DigitsTask", "TokenBatch"]

#: Seed offset of the held-out evaluation prompts (training prompts never draw them).
EVAL_SEED = 1_000_000


@dataclass
class TokenBatch:
    """One rollout: ``prompts`` [B, P] and ``group`` completions of each, with what the generator knew."""

    prompts: torch.Tensor  # [B, P] int64
    tokens: torch.Tensor  # [B*G, P+T] int64: prompt then completion
    logps: torch.Tensor  # [B*G, T] behaviour log-probabilities of the completion tokens
    mask: torch.Tensor  # [B*G, T] 1 up to and including EOS
    group: int


class DigitsTask(Task):
    """reverse / sort / add over ``config.digits`` digits, learned by a :class:`TinyTransformer`."""

    defaults: ClassVar[dict[str, float]] = {"lr": 1e-3, "kl_coeff": 0.02, "clip": 0.2}
    primary: ClassVar[str] = "accuracy"
    target: ClassVar[float | None] = 0.99

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.problem = DigitProblem(config.task, config.digits)
        preset = PRESETS.get(config.model)
        if preset is None:
            raise ValueError(f"unknown model preset {config.model!r}; choose one of {', '.join(PRESETS)}")
        self.model_config = preset
        self.max_new_tokens = config.max_new_tokens or self.problem.answer_length + 2
        if self.max_new_tokens <= self.problem.answer_length:  # the verifier reads the answer and its end token
            raise ValueError(
                f"--max-new-tokens {self.max_new_tokens}: {config.task}'s answer is {self.problem.answer_length} "
                f"digits and an end token, so a completion needs at least {self.problem.answer_length + 1} tokens "
                "(with fewer, nothing is ever right)"
            )
        if self.problem.prompt_length + self.max_new_tokens > preset.max_len or VOCAB > preset.vocab:
            raise ValueError(f"{config.task} with {config.digits} digits does not fit model preset {config.model!r}")
        space = self.problem.space
        if config.eval_size > space // 2:
            raise ValueError(
                f"--digits {config.digits}: {config.task} has {space} distinct prompts, too few for "
                f"{config.eval_size} held-out ones and as many to train on (--eval-size at most {space // 2}, "
                "or more digits)"
            )
        generator = torch.Generator(device="cpu").manual_seed(EVAL_SEED + config.seed)
        self.eval_prompts = self.problem.prompts(config.eval_size, generator, distinct=True)
        self.held_out = {self.problem.key(prompt) for prompt in self.eval_prompts}

    def build_policy(self) -> torch.nn.Module:
        return TinyTransformer(self.model_config)

    def sample(self, policy: torch.nn.Module, generator: torch.Generator, ticket: int = 0) -> TokenBatch:
        config = self.config
        prompts = self.problem.prompts(config.prompts, _cpu_generator(generator), exclude=self.held_out)
        device = next(policy.parameters()).device
        prompts = prompts.to(device)
        out = generate(
            policy,  # type: ignore[arg-type]
            prompts,
            samples=config.group,
            max_new_tokens=self.max_new_tokens,
            eos=EOS,
            pad=PAD,
            generator=generator,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            min_p=config.min_p,
            repetition_penalty=config.repetition_penalty,
        )
        return TokenBatch(prompts, out.tokens, out.logps, out.mask, config.group)

    def score(self, scorer: Any, samples: TokenBatch) -> Scores:
        answers = self.problem.answers(samples.prompts.cpu()).repeat_interleave(samples.group, dim=0)
        completions = samples.tokens[:, samples.prompts.shape[1] :].cpu()
        verdict = verify(completions, samples.mask.cpu(), answers)
        return Scores(verdict.rewards, verdict.exact)

    def reference_logps(self, reference: torch.nn.Module, samples: TokenBatch) -> torch.Tensor:
        with torch.no_grad():
            logps, _ = completion_logps(
                reference,  # type: ignore[arg-type]
                samples.tokens,
                samples.prompts.shape[1],
                self.config.temperature,
            )
        return logps * samples.mask

    def loss(
        self,
        policy: torch.nn.Module,
        samples: TokenBatch,
        rewards: torch.Tensor,
        ref_logps: torch.Tensor | None,
        rows: slice | None = None,
        batch: slice | None = None,
    ) -> LossReport:
        prompt_length = samples.prompts.shape[1]

        def policy_logps(part: slice) -> tuple[torch.Tensor, torch.Tensor]:
            return completion_logps(policy, samples.tokens[part], prompt_length, self.config.temperature)  # type: ignore[arg-type]

        return completion_loss(
            self.config,
            self.max_new_tokens,
            policy_logps,
            samples.logps,
            ref_logps,
            samples.mask,
            rewards,
            samples.group,
            self.truncated(samples),
            rows,
            batch,
        )

    def rows(self, samples: TokenBatch) -> int:
        return int(samples.tokens.shape[0])

    def row_tokens(self, samples: TokenBatch) -> int:
        return int(samples.tokens.shape[1])

    @staticmethod
    def truncated(samples: TokenBatch) -> torch.Tensor:
        """[N] bool: completions that reached the length limit without their EOS."""
        completions = samples.tokens[:, samples.prompts.shape[1] :]
        return ~((completions == EOS) & (samples.mask > 0)).any(1)

    def evaluate(self, policy: torch.nn.Module) -> dict[str, float]:
        """Greedy exact match and mean reward on the held-out prompts."""
        device = next(policy.parameters()).device
        prompts = self.eval_prompts.to(device)
        was_training = policy.training
        policy.eval()
        out = generate(
            policy,  # type: ignore[arg-type]
            prompts,
            samples=1,
            max_new_tokens=self.max_new_tokens,
            eos=EOS,
            pad=PAD,
            temperature=0.0,
        )
        policy.train(was_training)
        completions = out.tokens[:, prompts.shape[1] :].cpu()
        verdict = verify(completions, out.mask.cpu(), self.problem.answers(self.eval_prompts))
        return {"accuracy": float(verdict.exact.mean()), "reward": float(verdict.rewards.mean())}

    def measure(self, samples: TokenBatch) -> tuple[int, float]:
        tokens = int(samples.mask.sum())
        return tokens, tokens / max(1, samples.mask.shape[0])


def _cpu_generator(generator: torch.Generator) -> torch.Generator:
    """Prompts are drawn on the CPU; a CUDA generator seeds a CPU one from its own stream."""
    if generator.device.type == "cpu":
        return generator
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())
    return torch.Generator(device="cpu").manual_seed(seed)
