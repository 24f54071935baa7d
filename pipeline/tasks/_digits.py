"""Verifiable tasks over digit strings: reverse, sort, add; their prompts, verifier and tokens.

A prompt is ``BOS d1 … dn SEP`` (``add``: ``BOS a PLUS b SEP`` with both
numbers zero-padded to ``n`` digits); the answer is a digit string followed
by ``EOS`` (``add``: the sum zero-padded to ``n + 1`` digits). Every prompt
of a task has the same length, so a batch needs no padding on the left.

The verifier works from the prompt alone: the expected completion is the
answer's ``L`` digits followed by EOS. **Reward, with partial credit**: the
fraction of those ``L + 1`` positions where the completion has the expected
token (1.0 exactly when the answer is right and ends there; each right digit
earns ``1 / (L + 1)``, and so does stopping in the right place, which makes
EOS as learnable as a digit). **Accuracy** (exact match) is 1.0 when all
``L + 1`` positions are right.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BOS", "DIGIT_TASKS", "EOS", "PAD", "PLUS", "SEP", "VOCAB", "DigitProblem", "Verdict", "verify"]

PAD, BOS, SEP, EOS, PLUS = 10, 11, 12, 13, 14
#: Tokens: the digits 0-9, then PAD, BOS, SEP, EOS, PLUS, and one spare.
VOCAB = 16
DIGIT_TASKS = ("reverse", "sort", "add")


@dataclass(frozen=True)
class DigitProblem:
    """One task of the family: its kind and how many digits its inputs have."""

    kind: str = "reverse"
    digits: int = 6

    def __post_init__(self) -> None:
        if self.kind not in DIGIT_TASKS:
            raise ValueError(f"unknown digit task {self.kind!r}; choose one of {', '.join(DIGIT_TASKS)}")
        if not 1 <= self.digits <= 12:
            raise ValueError(f"digits must be between 1 and 12, not {self.digits}")

    @property
    def prompt_length(self) -> int:
        return 2 + (2 * self.digits + 1 if self.kind == "add" else self.digits)

    @property
    def answer_length(self) -> int:
        return self.digits + 1 if self.kind == "add" else self.digits

    @property
    def space(self) -> int:
        """How many distinct prompts the task has."""
        return int(10 ** (2 * self.digits if self.kind == "add" else self.digits))

    def prompts(
        self,
        count: int,
        generator: torch.Generator,
        exclude: set[tuple[int, ...]] | None = None,
        distinct: bool = False,
    ) -> torch.Tensor:
        """``count`` random prompts [count, prompt_length], none of them in ``exclude`` (a held-out set).

        ``distinct`` draws no prompt twice. The caller keeps ``count`` (when
        distinct) and ``exclude`` within :attr:`space`, so the draw ends.
        """
        n = self.digits
        available = self.space - len(exclude or ())
        if available < (count if distinct else 1):
            raise ValueError(f"{self.kind} over {n} digits has {available} prompts left to draw {count} from")
        rows: list[torch.Tensor] = []
        taken = set(exclude or ())
        while len(rows) < count:
            values = torch.randint(
                0, 10, (count, 2 * n if self.kind == "add" else n), generator=generator, device=generator.device
            )
            for row in values:
                key = tuple(row.tolist())
                if key in taken:
                    continue
                if distinct:
                    taken.add(key)
                rows.append(row)
                if len(rows) == count:
                    break
        body = torch.stack(rows)
        if self.kind == "add":
            plus = torch.full((count, 1), PLUS, dtype=torch.int64, device=body.device)
            body = torch.cat([body[:, :n], plus, body[:, n:]], dim=1)
        bos = torch.full((count, 1), BOS, dtype=torch.int64, device=body.device)
        sep = torch.full((count, 1), SEP, dtype=torch.int64, device=body.device)
        return torch.cat([bos, body, sep], dim=1)

    def answers(self, prompts: torch.Tensor) -> torch.Tensor:
        """The expected answer digits [B, answer_length] of each prompt (the verifier's truth)."""
        n = self.digits
        body = prompts[:, 1:-1]
        if self.kind == "reverse":
            return body.flip(1)
        if self.kind == "sort":
            return body.sort(dim=1).values
        weights = 10 ** torch.arange(n - 1, -1, -1, dtype=torch.int64, device=body.device)
        total = (body[:, :n] * weights).sum(1) + (body[:, n + 1 :] * weights).sum(1)
        digits = [(total // 10**k) % 10 for k in range(n, -1, -1)]
        return torch.stack(digits, dim=1)

    @staticmethod
    def key(prompt: torch.Tensor) -> tuple[int, ...]:
        """The prompt's input digits as a set key (PLUS removed), matching what :meth:`prompts` draws."""
        body = prompt[1:-1]
        return tuple(body[body != PLUS].tolist())


@dataclass
class Verdict:
    """Per completion: the partial-credit reward, exact match, and answer length."""

    rewards: torch.Tensor  # [N] float in [0, 1]
    exact: torch.Tensor  # [N] float 0/1
    lengths: torch.Tensor  # [N] float: completion tokens, EOS included


def verify(completions: torch.Tensor, mask: torch.Tensor, answers: torch.Tensor) -> Verdict:
    """Score completions [N, T] (mask [N, T]) against the expected answers [N, L]."""
    count, width = completions.shape
    length = answers.shape[1]
    end = torch.full((count, 1), EOS, dtype=answers.dtype, device=answers.device)
    target = torch.cat([answers, end], dim=1)  # digits, then EOS
    seen = torch.full((count, length + 1), -1, dtype=torch.int64, device=completions.device)
    span = min(width, length + 1)
    seen[:, :span] = torch.where(mask[:, :span] > 0, completions[:, :span], -1)
    correct = (seen == target).float()
    return Verdict(correct.mean(1), correct.min(1).values, mask.sum(1))
