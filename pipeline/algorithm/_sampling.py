"""One sampling step and teacher-forced log-probabilities, shared by every generator and trainer.

The built-in transformer's :func:`pipeline.models.generate`, the Hugging Face
engine (:class:`pipeline.models.BuiltinEngine`) and both models' teacher-forced
log-probabilities use these, so the behaviour log-probability a generator
records is computed exactly as the trainer computes it: under the whole
temperature-scaled distribution, whatever top-k, top-p or min-p cut the sampler
or a repetition penalty bent it.
"""

from __future__ import annotations

import math

import torch

__all__ = ["RepeatPenalty", "draw", "filter_logits", "token_logps"]


class RepeatPenalty:
    """The tokens each row has seen (its prompt's and those drawn so far) and the penalty on their logits, as
    transformers' ``repetition_penalty``: a positive logit divided by it, a negative one multiplied."""

    def __init__(self, seen: torch.Tensor, penalty: float) -> None:
        self.seen = seen  # [N, V] bool
        self.penalty = penalty

    @classmethod
    def of(cls, ids: torch.Tensor, mask: torch.Tensor, vocab: int, penalty: float) -> RepeatPenalty | None:
        """The penalty for prompts ``ids`` [N, P] (``mask`` 1 on real tokens, not padding), or None at 1 (off)."""
        if penalty == 1.0:
            return None
        seen = torch.zeros(ids.shape[0], vocab, dtype=torch.bool, device=ids.device)
        rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1).expand_as(ids)
        real = mask.bool()
        seen[rows[real], ids[real]] = True
        return cls(seen, penalty)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [N, V] with the seen tokens' made less likely."""
        bent = torch.where(logits > 0, logits / self.penalty, logits * self.penalty)
        return torch.where(self.seen, bent, logits)

    def add(self, token: torch.Tensor) -> None:
        """Each row has now seen its drawn ``token`` [N]."""
        self.seen[torch.arange(token.shape[0], device=token.device), token] = True


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """``logits`` with the tokens outside the top ``top_k``, outside the smallest set of cumulative probability
    ``top_p``, and less likely than ``min_p`` times the likeliest token masked, in that order (transformers'
    order; ``top_k`` 0, ``top_p`` 1 and ``min_p`` 0 are off)."""
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1.0:  # as transformers' TopPLogitsWarper (and vLLM): least likely first, a tie's exact sum dropped
        ordered, order = logits.sort(dim=-1, descending=False)
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[..., -1:] = False  # the likeliest token always stays
        ordered = ordered.masked_fill(drop, -math.inf)
        logits = torch.full_like(logits, -math.inf).scatter(-1, order, ordered)
    if min_p > 0.0:  # p >= min_p * p_max, in log space: logit >= max logit + log(min_p)
        floor = logits.max(-1, keepdim=True).values + math.log(min_p)
        logits = logits.masked_fill(logits < floor, -math.inf)
    return logits


def draw(
    step_logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repeats: RepeatPenalty | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``step_logits`` [N, V] and the log-probability [N, V] it was drawn under.

    ``temperature`` 0 is greedy. The returned log-probabilities are the
    whole temperature-scaled distribution's (the policy's), not the
    filtered one the token was sampled from (the sampler's): ``repeats``
    bends the logits before the temperature and the cuts, as transformers
    does, for the draw only. The drawn tokens are added to ``repeats``.
    """
    logp = (step_logits / temperature if temperature not in (0, 1) else step_logits).log_softmax(-1)
    cut = temperature != 0 and (top_k > 0 or top_p < 1.0 or min_p > 0.0)  # no cut moves the greedy token
    if repeats is None and not cut:
        sampler = logp  # nothing bends or cuts the policy's distribution
    else:
        bent = step_logits if repeats is None else repeats.apply(step_logits)
        scaled = bent / temperature if temperature not in (0, 1) else bent
        sampler = (filter_logits(scaled, top_k, top_p, min_p) if cut else scaled).log_softmax(-1)
    if temperature == 0:
        token = sampler.argmax(-1)
    else:
        token = torch.multinomial(sampler.exp(), 1, generator=generator).squeeze(-1)
    if repeats is not None:
        repeats.add(token)
    return token, logp


def token_logps(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``targets`` [N, T] under ``logits`` [N, T, V] scaled by ``temperature``, and the
    per-position entropy of that distribution."""
    if temperature not in (0, 1):
        logits = logits / temperature
    logp_all = logits.log_softmax(-1)
    logps = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logps, entropy
