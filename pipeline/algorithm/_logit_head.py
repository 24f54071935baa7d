"""Log-probabilities of chosen tokens from hidden states, chunk by chunk: memory that does not grow with the vocabulary.

A causal LM's head turns each position's hidden state into logits over the
whole vocabulary: at 151,936 tokens, float32 logits for a 256 x 80 rollout
are 11 GiB, and ``log_softmax`` and the entropy each hold as much again.
GRPO needs one number per position, the log-probability of the token taken
(and, as a metric, the entropy), so :func:`chunked_token_logps` passes the
hidden states through the head a few hundred positions at a time (as TRL's
selective log-softmax does): each chunk's logits live only while that chunk
is computed, and with gradients on, the chunk is recomputed in the backward
pass (:func:`torch.utils.checkpoint.checkpoint`) rather than kept. The
entropy is computed in the same pass, under ``no_grad`` (a metric, no graph)
unless the loss has an entropy bonus: then it is differentiable too, with a
backward written out for the pair (:class:`_EntropyAndLogps`), and
recomputed with the log-probabilities in the backward pass.

The numbers equal :func:`pipeline.algorithm.token_logps` on the full logits
(the same ``log_softmax`` and ``gather``), so the generator's behaviour
log-probabilities and the trainer's agree as before.

With ``compiled`` (``--compile``) a chunk's work is compiled by
``torch.compile``: the cast to float32, the log-softmax, the gather and the
entropy then read the chunk's logits in a few fused passes instead of one
pass (and one temporary) each, forward and backward (measured:
docs/benchmarks.md, "A trainer step"); equal to rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["LOGITS_PER_CHUNK", "chunk_positions", "chunked_token_logps"]

#: Logits (positions x vocabulary) one chunk may hold: 2**25 float32 values are 128 MiB. Not less in host memory
#: either: there each eager temporary this large is mapped afresh (its page faults are a good part of a CPU step's
#: head time), but 16 MiB ones, which glibc's heap serves, fragmented it under autograd's checkpoints (a step's
#: resident memory grew to 21 GB at 256 x 64 positions of a 151,936-token vocabulary; measured, 2026-11-27).
LOGITS_PER_CHUNK = 2**25

Head = Callable[[torch.Tensor], torch.Tensor]


def chunk_positions(vocab: int, budget: int = LOGITS_PER_CHUNK) -> int:
    """How many positions one chunk takes so that its logits stay within ``budget`` values."""
    return max(1, budget // max(1, vocab))


class _EntropyAndLogps(torch.autograd.Function):
    """The log-probabilities [n] of ``targets`` under ``logits`` [n, V] / ``temperature`` and their entropies [n],
    in float32, both differentiable, with the backward written out: d log p_t / dz = onehot_t - p and
    dH / dz = -p (log p + H), so the gradient is ``-p (g_logp + g_H (log p + H)) + g_logp onehot``. Autograd's
    would keep ``p`` and ``log p`` for the entropy's product and fill a zero [n, V] for the gather's backward; this
    keeps ``log p`` alone (measured: 12 % faster, 375 MB less at 151,936 x 128 rows)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        z = logits.float()
        if temperature != 1:
            z = z / temperature  # as the sampler divides: the same numbers as its log-probs
        logp_all = z.log_softmax(-1)
        del z
        logps = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = -logp_all.exp().mul_(logp_all).sum(-1)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logp_all, targets, entropy)
        ctx.temperature, ctx.dtype = temperature, logits.dtype
        return logps, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logps: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, None, None]:
        logp_all, targets, entropy = ctx.saved_tensors
        if grad_entropy is None:
            if grad_logps is None:
                return None, None, None
            weight = grad_logps.unsqueeze(-1)
        else:
            weight = (logp_all + entropy.unsqueeze(-1)).mul_(grad_entropy.unsqueeze(-1))
            if grad_logps is not None:
                weight.add_(grad_logps.unsqueeze(-1))
        grad = logp_all.exp().mul_(weight).neg_()
        del weight
        if grad_logps is not None:
            grad.scatter_add_(-1, targets.unsqueeze(-1), grad_logps.unsqueeze(-1))
        if ctx.temperature != 1:
            grad.div_(ctx.temperature)
        return grad.to(ctx.dtype), None, None


def _chunk_logps(
    hidden: torch.Tensor, targets: torch.Tensor, head: Head, temperature: float, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities [n] of ``targets`` under ``head(hidden)`` [n, V] and the distribution's entropy [n].

    With the entropy's gradient (an entropy bonus), through :class:`_EntropyAndLogps`' written-out backward;
    without it, through autograd's own (its fused log-softmax backward is the faster one there: measured).
    """
    divisor = 1.0 if temperature in (0, 1) else temperature
    if entropy_grad and torch.is_grad_enabled():
        logps, entropy = _EntropyAndLogps.apply(head(hidden), targets, divisor)  # type: ignore[no-untyped-call]
        return logps, entropy
    logits = head(hidden).float()
    if divisor != 1:
        logits = logits / divisor
    logp_all = logits.log_softmax(-1)
    logps = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logps, entropy


def _compiled_chunk_logps() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """:func:`_chunk_logps` compiled for dynamic shapes (a rollout's last chunk is shorter); torch keeps the
    compiled code with the function's, so every caller shares it."""
    compiled: Callable[..., tuple[torch.Tensor, torch.Tensor]] = torch.compile(_chunk_logps, dynamic=True)
    return compiled


def chunked_token_logps(
    hidden: torch.Tensor,
    head: Head,
    targets: torch.Tensor,
    temperature: float,
    vocab: int,
    budget: int = LOGITS_PER_CHUNK,
    *,
    entropy_grad: bool = False,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities [N, T] of ``targets`` [N, T] under ``head`` applied to ``hidden`` [N, T, H], and entropies.

    ``head`` maps hidden states to logits over ``vocab`` tokens; positions
    go through it in chunks of at most ``budget`` logits. While gradients
    are recorded, every chunk but a lone one is checkpointed: the backward
    pass recomputes its logits instead of keeping them. The entropies carry
    a gradient only with ``entropy_grad`` (an entropy bonus in the loss).
    ``compiled``: each chunk's work compiled by ``torch.compile``.
    """
    rows, width = targets.shape
    flat_hidden = hidden.reshape(rows * width, hidden.shape[-1])
    flat_targets = targets.reshape(rows * width)
    size = chunk_positions(vocab, budget)
    chunk = _compiled_chunk_logps() if compiled else _chunk_logps
    if flat_targets.numel() <= size:
        logps, entropy = chunk(flat_hidden, flat_targets, head, temperature, entropy_grad)
        return logps.view(rows, width), entropy.view(rows, width)
    recompute = torch.is_grad_enabled() and flat_hidden.requires_grad
    parts: list[torch.Tensor] = []
    entropies: list[torch.Tensor] = []
    for start in range(0, flat_targets.numel(), size):
        piece, chosen = flat_hidden[start : start + size], flat_targets[start : start + size]
        if recompute:
            logps, entropy = checkpoint(chunk, piece, chosen, head, temperature, entropy_grad, use_reentrant=False)
        else:
            logps, entropy = chunk(piece, chosen, head, temperature, entropy_grad)
        parts.append(logps)
        entropies.append(entropy if entropy_grad else entropy.detach())
    return torch.cat(parts).view(rows, width), torch.cat(entropies).view(rows, width)
