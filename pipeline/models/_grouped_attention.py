"""Grouped-query attention that reads each key/value head once: the static decoder's attention.

With a mask, transformers' ``sdpa`` attention repeats every key and value
head for each query head that shares it (``repeat_kv``): on a 0.5 B Qwen2
(14 query heads over 2 key/value heads) each decode step wrote and read the
whole KV cache 7 times over, 28 % of a graphed step's GPU time (H100). Here a group's
query heads become rows of one query instead: ``[B, H, Q, D]`` is viewed as
``[B, H_kv, G * Q, D]`` against the unrepeated ``[B, H_kv, L, D]`` keys and
values — the same attention, with nothing repeated (a step's query is one
position, so its mask row serves every head of the group). The prompt pass,
whose queries are the cache's first ``P`` slots, attends over those ``P``
keys only (``enable_gqa``), not the whole cache with a mask per head.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

#: The name under which :func:`grouped_sdpa` is registered with transformers' attention functions.
GROUPED_SDPA = "pipeline_grouped_sdpa"


def grouped_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of ``query`` [B, H, Q, D] over ``key``/``value`` [B, H_kv, L, D] with ``attention_mask`` [B, 1, Q, L].

    In transformers' attention-function form: the output is [B, Q, H, D]. The
    mask must be given (the static decoder always prepares one): without it,
    causality would have to be rebuilt. A query of several positions (Q > 1)
    must be the prompt pass, at the cache's first Q slots (the static
    decoder's only one).
    """
    if attention_mask is None:
        raise ValueError("grouped_sdpa needs the prepared attention mask the static decoder passes")
    batch, heads, length, width = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    if groups * kv_heads != heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} key/value heads")
    if length > 1:
        # The prompt pass: its queries are the cache's first ``length`` slots, so only those keys can be allowed;
        # grouping would repeat a [length x cache length] mask for each head of a group (GBs at a real batch)
        out = torch.nn.functional.scaled_dot_product_attention(
            query,
            key[:, :, :length],
            value[:, :, :length],
            attn_mask=attention_mask[..., :length],
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=groups > 1,
        )
        return out.transpose(1, 2).contiguous(), None
    grouped = query.reshape(batch, kv_heads, groups * length, width)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(batch, heads, length, width).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def grouped_attention(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, ``model``'s attention layers call :func:`grouped_sdpa` (registered with transformers
    on entry); its own implementation is restored after, so a fallback to the dynamic cache runs unchanged."""
    from transformers import AttentionInterface

    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)  # idempotent: the same name, the same function
    config: Any = model.config
    own = config._attn_implementation
    config._attn_implementation = GROUPED_SDPA
    try:
        yield
    finally:
        config._attn_implementation = own
