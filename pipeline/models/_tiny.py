"""A small decoder-only transformer in plain torch, with KV-cached sampling.

The policy of the token tasks: token and learned position embeddings, pre-norm
blocks of causal multi-head attention and a GELU MLP, a final norm and an
output head. :func:`generate` samples completions for a batch of prompts of
equal length (``G`` samples each) with a per-layer key/value cache, so each
new token costs one position, not the whole prefix; it returns the tokens,
their log-probabilities under the policy that drew them (the behaviour
log-probabilities GRPO's ratio needs) and the completion mask.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..algorithm import RepeatPenalty, draw, token_logps

__all__ = ["PRESETS", "Generation", "ModelConfig", "TinyTransformer", "completion_logps", "generate"]


@dataclass(frozen=True)
class ModelConfig:
    """The transformer's shape."""

    vocab: int = 16
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    max_len: int = 32

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


#: Named sizes: ``tiny`` learns the digit tasks in seconds on 2 CPU cores; ``gpu-300m`` is for a GPU.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    "small": ModelConfig(d_model=256, n_layers=4, n_heads=8, d_ff=1024),
    "gpu-300m": ModelConfig(d_model=1024, n_layers=24, n_heads=16, d_ff=4096, max_len=64),
}


class _Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.norm1 = nn.LayerNorm(config.d_model)
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.out = nn.Linear(config.d_model, config.d_model)
        self.norm2 = nn.LayerNorm(config.d_model)
        self.up = nn.Linear(config.d_model, config.d_ff)
        self.down = nn.Linear(config.d_ff, config.d_model)

    def forward(
        self, x: torch.Tensor, cache: list[torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``x`` [B, T, D]; ``cache`` holds this layer's keys and values so far (appended to)."""
        batch, length, width = x.shape
        heads = self.n_heads
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q = q.view(batch, length, heads, -1).transpose(1, 2)
        k = k.view(batch, length, heads, -1).transpose(1, 2)
        v = v.view(batch, length, heads, -1).transpose(1, 2)
        if cache:
            k = torch.cat([cache[0], k], dim=2)
            v = torch.cat([cache[1], v], dim=2)
        # causal within the new positions; every cached position is in the past
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=not cache and length > 1)
        x = x + self.out(attn.transpose(1, 2).reshape(batch, length, width))
        x = x + self.down(F.gelu(self.up(self.norm2(x))))
        return x, [k, v]


class TinyTransformer(nn.Module):
    """A GPT-style causal language model."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.d_model)
        self.position = nn.Embedding(config.max_len, config.d_model)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(
        self, tokens: torch.Tensor, cache: list[list[torch.Tensor]] | None = None, start: int = 0
    ) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """Logits [B, T, V] for ``tokens`` [B, T] at positions ``start``..; the updated cache."""
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        new_cache = []
        for i, block in enumerate(self.blocks):
            x, layer_cache = block(x, cache[i] if cache else None)
            new_cache.append(layer_cache)
        return self.head(self.norm(x)), new_cache

    @property
    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())


@dataclass
class Generation:
    """Sampled completions: ``tokens`` [N, P + T] (prompt then completion), per-token behaviour
    log-probabilities and completion mask [N, T] (1 up to and including EOS)."""

    tokens: torch.Tensor
    logps: torch.Tensor
    mask: torch.Tensor


@torch.no_grad()
def generate(
    model: TinyTransformer,
    prompts: torch.Tensor,
    *,
    samples: int,
    max_new_tokens: int,
    eos: int,
    pad: int,
    generator: torch.Generator | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
) -> Generation:
    """``samples`` completions of each prompt (prompts [B, P], all of one length), batched.

    ``temperature`` 0 is greedy. Tokens are drawn from the temperature-scaled
    distribution bent by the repetition penalty and cut by top-k, top-p and
    min-p, but the behaviour log-probability
    recorded for each is under the whole temperature-scaled distribution:
    the one :func:`completion_logps` computes, so the trainer's ratio is 1
    for the policy that sampled, whatever ``top_p`` (the nucleus is part of
    the sampler, as in TRL and verl, not of the policy being trained).
    A completion ends at EOS; later positions hold ``pad`` with mask 0.
    """
    if prompts.shape[1] + max_new_tokens > model.config.max_len:
        raise ValueError(f"prompt ({prompts.shape[1]}) + max_new_tokens ({max_new_tokens}) exceed max_len")
    tokens = prompts.repeat_interleave(samples, dim=0)
    count = tokens.shape[0]
    logits, cache = model(tokens)
    step_logits = logits[:, -1].float()  # a bfloat16 policy samples from float32 log-probs
    repeats = RepeatPenalty.of(tokens, torch.ones_like(tokens), step_logits.shape[-1], repetition_penalty)
    done = torch.zeros(count, dtype=torch.bool, device=tokens.device)
    out_tokens, out_logps, out_mask = [], [], []
    position = tokens.shape[1]
    for _ in range(max_new_tokens):
        token, logp = draw(step_logits, temperature, generator, top_k, top_p, min_p, repeats)
        token = token.masked_fill(done, pad)
        out_tokens.append(token)
        out_logps.append(logp.gather(-1, token.unsqueeze(-1)).squeeze(-1).masked_fill(done, 0.0))
        out_mask.append(~done)
        done = done | (token == eos)
        if bool(done.all()):
            break
        logits, cache = model(token.unsqueeze(-1), cache, start=position)
        step_logits = logits[:, -1].float()
        position += 1
    completion = torch.stack(out_tokens, dim=1)
    return Generation(
        torch.cat([tokens, completion], dim=1),
        torch.stack(out_logps, dim=1),
        torch.stack(out_mask, dim=1).to(torch.float32),
    )


def completion_logps(
    model: TinyTransformer, tokens: torch.Tensor, prompt_length: int, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probabilities [N, T] of the completion part of ``tokens`` under ``model``,
    and the per-token entropy of its distribution (teacher forcing, one forward pass)."""
    logits, _ = model(tokens[:, :-1])
    return token_logps(logits[:, prompt_length - 1 :].float(), tokens[:, prompt_length:], temperature)
