"""The decode loop's model side: a prompt's prefill, then one token per row per step, over a KV cache.

:class:`BuiltinEngine <pipeline.models.BuiltinEngine>` samples; a decoder
turns the tokens it drew into the next step's logits. Two keep the cache:

- :class:`DynamicDecoder` — the model's own cache, growing a column a step,
  every kernel launched from Python each token (any model, any device);
- :class:`StaticDecoder` — a cache pre-allocated for one batch shape (rows x
  longest prompt + new tokens) and the step's inputs in fixed buffers, so
  every step runs the same kernels on the same addresses: on CUDA the step
  is captured once as a graph and replayed. A decode step reads all the
  weights to make one token a row; launching its hundreds of kernels from
  Python costs far more than that read on a GPU, and a replay costs one launch.
  With ``compile`` the step is first compiled by ``torch.compile`` (inductor,
  one graph, static shapes), which fuses each layer's norms, rotary
  embedding and residual adds into a few kernels: a replay then runs fewer,
  larger kernels.

Both give the same logits for the same weights (the static cache's extra
slots are masked, each row attends to what the dynamic cache holds). The
static decoder needs an attention implementation that takes a prepared mask
(``sdpa`` or ``eager``) and only full-attention layers
(:func:`static_refusal` says why not); over ``sdpa`` it attends with
:func:`grouped_sdpa <pipeline.models._grouped_attention.grouped_sdpa>`,
which reads a grouped-query model's key/value heads once instead of once
per query head.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ._causal_lm import logits_to_keep_argument, positions, require_transformers
from ._grouped_attention import grouped_attention

__all__ = [
    "Decoder",
    "DynamicDecoder",
    "ModelCall",
    "StaticDecoder",
    "StepGraphs",
    "static_refusal",
]

#: attention implementations that use a prepared 4-D mask as given (True / 0.0 attend)
_MASKED_ATTENTION = ("sdpa", "eager")


@dataclass(frozen=True)
class ModelCall:
    """How a causal LM is called in a decode loop: its KV cache's keyword, asking for the last position's logits
    only (the prompt's pass then makes [rows, vocabulary], not [rows, prompt, vocabulary]), and whether it takes
    the cache slots to write (transformers 4.x's ``cache_position``: without it a static cache guesses its fill
    from row 0's non-zero keys, which a left-padded row with zero pad keys gets wrong)."""

    cache_argument: str
    last_only: dict[str, int]
    takes_cache_position: bool = False

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelCall:
        forward = inspect.signature(model.forward).parameters
        # transformers 5 names the KV cache ``cache`` in some models, ``past_key_values`` in others (and 4.x)
        cache_argument = "cache" if "cache" in forward else "past_key_values"
        keep = logits_to_keep_argument(model)
        return cls(cache_argument, {} if keep is None else {keep: 1}, "cache_position" in forward)


class Decoder(Protocol):
    """A batch's decode state: ``prefill`` once, then ``step`` with each drawn token; both give [rows, V] float32
    logits for the next token."""

    def prefill(self, ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor: ...

    def step(self, token: torch.Tensor) -> torch.Tensor: ...


class DynamicDecoder:
    """The model's own KV cache, grown by the model each step; the attention mask grows with it."""

    def __init__(self, model: torch.nn.Module, call: ModelCall) -> None:
        self.model = model
        self.call = call
        self._cache: Any = None
        self._attention = torch.empty(0, 0, dtype=torch.long, device="cpu")
        self._position = torch.empty(0, 1, dtype=torch.long, device="cpu")

    def prefill(self, ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
        position = positions(prompt_mask)
        out = self.model(
            input_ids=ids, attention_mask=prompt_mask, position_ids=position, use_cache=True, **self.call.last_only
        )
        self._cache = getattr(out, self.call.cache_argument)
        self._attention = prompt_mask
        self._position = position[:, -1:]
        return _next_logits(out)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        rows = token.shape[0]
        self._attention = torch.cat(
            [self._attention, torch.ones(rows, 1, dtype=self._attention.dtype, device=token.device)], dim=1
        )
        self._position = self._position + 1
        out = self.model(
            input_ids=token.unsqueeze(-1),
            attention_mask=self._attention,
            position_ids=self._position,
            use_cache=True,
            **{self.call.cache_argument: self._cache},
        )
        self._cache = getattr(out, self.call.cache_argument)
        return _next_logits(out)


def static_refusal(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot decode over a static cache, or None if it can."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        return "not a Hugging Face model"
    attention = getattr(config, "_attn_implementation", None)
    if attention not in _MASKED_ATTENTION:
        return f"its attention ({attention}) does not take a prepared mask (sdpa and eager do)"
    layer_types = getattr(config.get_text_config(decoder=True), "layer_types", None) or []
    other = sorted({kind for kind in layer_types if kind != "full_attention"})
    if other:
        return f"it has layers other than full attention ({', '.join(other)})"
    if any(type(parameter).__name__ == "DTensor" for parameter in model.parameters()):
        return "its parameters are sharded (a graph cannot hold a gathered shard's storage)"
    return None


class StepGraphs:
    """CUDA graphs of one step function, one per storage of the model's weights (the ``keep`` latest), one pool.

    A graph reads the addresses it was captured with, the parameters'
    among them. A weight install that copies into the parameters keeps
    those; one that assigns the update's tensors (an aliasing install)
    moves them, and :meth:`select` then captures a graph for the new
    storage — or finds the one kept for it, since a publisher's slots recur.
    Never is a graph replayed over storage the model no longer holds.
    """

    def __init__(self, model: torch.nn.Module, step: Callable[[], torch.Tensor], keep: int = 4) -> None:
        self.model = model
        self.step = step
        self.keep = keep
        self.captures = 0
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: OrderedDict[tuple[int, ...], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = OrderedDict()
        self._current: tuple[torch.cuda.CUDAGraph, torch.Tensor] | None = None

    def select(self) -> None:
        """Make the graph over the weights' present storage the one :meth:`replay` runs (captured if new).

        Capturing runs the step: whatever state it advances must be reset afterwards.
        """
        key = _storage(self.model)
        found = self._graphs.get(key)
        if found is None:
            found = self._graphs[key] = self._capture()
            if len(self._graphs) > self.keep:
                self._graphs.popitem(last=False)[1][0].reset()
        self._graphs.move_to_end(key)
        self._current = found

    def replay(self) -> torch.Tensor:
        """Run the selected graph; its output (a buffer the next replay overwrites)."""
        assert self._current is not None, "select() a graph first"
        graph, out = self._current
        graph.replay()
        return out

    def close(self) -> None:
        """Release every graph's memory."""
        for graph, _ in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._current = None

    def _capture(self) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm the step up on a side stream (lazy allocations, kernel choices), then capture it, with the model's
        GPU current throughout (the capture stream is the current GPU's: a model on ``cuda:1`` of a process whose
        current GPU is 0 ran its kernels outside the capture)."""
        device = next(self.model.parameters()).device
        with torch.cuda.device(device):
            side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.step()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA work (a weight transfer, say) does not break the capture
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self.step()
        self.captures += 1
        return graph, out


class StaticDecoder:
    """A KV cache pre-allocated for ``rows`` sequences of up to ``length`` tokens, and the one-token step over it.

    The step reads its token, position and attention mask from buffers
    written in place before it runs, and the cache advances itself (its
    fill counter lives on the device), so with ``graphs`` (CUDA) the step is
    captured (:class:`StepGraphs`) and each step of a batch is one replay.
    A decoder serves any batch of its rows whose prompt + new tokens fit
    ``length``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        call: ModelCall,
        rows: int,
        length: int,
        *,
        graphs: bool = False,
        compile: bool = False,
    ) -> None:
        """``graphs``: capture the step as a CUDA graph (the model on a GPU); ``compile``: compile it with
        ``torch.compile`` first (compiled here, by a warm-up step: a model it cannot compile fails now)."""
        transformers = require_transformers()
        self.model = model
        self.call = call
        self.rows = rows
        self.length = length
        parameter = next(model.parameters())
        device, dtype = parameter.device, parameter.dtype
        if graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, not {device}")
        self._bool_mask = model.config._attn_implementation == "sdpa"  # type: ignore[union-attr]
        self._blocked = False if self._bool_mask else torch.finfo(dtype).min
        self._open = True if self._bool_mask else 0.0
        self._mask_dtype = torch.bool if self._bool_mask else dtype
        self.cache: Any = transformers.StaticCache(config=model.config, max_cache_len=length)
        self._token = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self._position = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self._mask = torch.full((rows, 1, 1, length), self._blocked, dtype=self._mask_dtype, device=device)
        self._slot = torch.zeros(1, dtype=torch.long, device=device)  # the cache slot the next step writes
        self._filled = 0
        self._step_logits: _Logits = _compiled_logits() if compile else _logits
        self.graphs: StepGraphs | None = None
        if compile:
            # the cache allocates its tensors at its first write: done by an eager step, so the compiled step never
            # traces that allocation (a guard on it cost a second graph per shape, and the recompile limit sooner)
            self._pass(_logits, self._token, self._mask, self._position, self._slot)
            if not graphs:  # compiled now; the prefill empties what the warm-up step wrote
                self._forward()
        if graphs:
            self.graphs = StepGraphs(model, self._forward)
            self.graphs.select()  # captured now: a model that cannot be captured fails here, not mid-batch

    def prefill(self, ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
        """Run the prompts ([rows, P], left-padded) into a fresh cache; the next token's logits."""
        rows, width = ids.shape
        if rows != self.rows or width >= self.length:
            raise ValueError(f"{rows} prompts of {width} tokens do not fit a decoder of {self.rows} x {self.length}")
        if self.graphs is not None:  # a capture's warm-up writes two steps into the cache: emptied before and after
            self.cache.reset()
            self.graphs.select()
        self.cache.reset()
        valid = prompt_mask.bool()
        causal = torch.ones(width, width, dtype=torch.bool, device=ids.device).tril()
        itself = torch.eye(width, dtype=torch.bool, device=ids.device)  # a pad attends to itself: no empty row
        allowed = torch.zeros(rows, 1, width, self.length, dtype=torch.bool, device=ids.device)
        allowed[:, 0, :, :width] = (causal & valid[:, None, :]) | itself
        position = positions(prompt_mask)
        slots = torch.arange(width, device=ids.device)
        logits = self._pass(_logits, ids, self._as_mask(allowed), position, slots)
        self._mask.fill_(self._blocked)
        self._mask[:, 0, 0, :width] = self._as_mask(valid)
        self._position.copy_(position[:, -1:])
        self._slot.fill_(width - 1)
        self._filled = width
        return logits

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Append ``token`` [rows] to every row; the next token's logits (a buffer the next step overwrites)."""
        if self._filled >= self.length:
            raise ValueError(f"the decoder's cache of {self.length} tokens is full")
        self._token.copy_(token.unsqueeze(-1))
        self._position.add_(1)
        self._slot.add_(1)
        self._mask[:, 0, 0, self._filled] = self._open
        self._filled += 1
        if self.graphs is not None:
            return self.graphs.replay()
        return self._forward()

    def close(self) -> None:
        """Release the captured graphs' memory and the cache."""
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        self.cache = None

    def _forward(self) -> torch.Tensor:
        return self._pass(self._step_logits, self._token, self._mask, self._position, self._slot)

    def _pass(
        self, run: _Logits, ids: torch.Tensor, mask: torch.Tensor, position: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """The model over the cache (``run``: :func:`_logits`, or it compiled): a prefill's prompts or a step's
        tokens, writing cache ``slots``; the next token's logits.

        Over sdpa it attends without repeated key/value heads
        (:mod:`pipeline.models._grouped_attention`); over eager as it is (its
        additive mask is the model's own arithmetic, kept bit for bit).
        """
        attention = grouped_attention(self.model) if self._bool_mask else contextlib.nullcontext()
        with attention:
            return run(self.model, self.call, self.cache, ids, mask, position, slots)

    def _as_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """``allowed`` (True: attend) in the attention implementation's form: itself for sdpa, additive for eager."""
        if self._bool_mask:
            return allowed
        return torch.zeros(allowed.shape, dtype=self._mask_dtype, device=allowed.device).masked_fill(
            ~allowed, self._blocked
        )


def _storage(model: torch.nn.Module) -> tuple[int, ...]:
    """Where the model's parameters and buffers live (a captured graph reads those addresses), by name.

    Duplicates are kept: a tied head counts once per name whether it is the
    embedding's very parameter or another one over the same storage (as an
    aliasing install of a state_dict leaves it), so equal addresses give equal keys.
    """
    named = (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))
    return tuple(tensor.data_ptr() for _, tensor in named)


_Logits = Callable[
    [torch.nn.Module, ModelCall, Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


def _logits(
    model: torch.nn.Module,
    call: ModelCall,
    cache: Any,
    ids: torch.Tensor,
    mask: torch.Tensor,
    position: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """``model``'s next-token logits [rows, V] for ``ids`` over ``cache``, writing its ``slots``.

    A function of its arguments alone (no decoder in it), so that compiled
    it is traced once per batch shape, whichever decoder calls it.
    """
    written = {"cache_position": slots} if call.takes_cache_position else {}  # transformers 4.x takes the slots
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=position,
        use_cache=True,
        **{call.cache_argument: cache},
        **written,
        **call.last_only,
    )
    return _next_logits(out)


def _compiled_logits() -> _Logits:
    """:func:`_logits` compiled by ``torch.compile``: one graph (a break is an error, not a slow step) for
    static shapes; torch keeps the compiled code per shape with the function's code, shared by every decoder.

    Dynamo counts a function's compiled graphs against its recompile limit
    (8 by default), and with ``fullgraph`` the next shape past it fails. A
    decode step's graphs are one per batch shape (rows x cache length, in
    :data:`LENGTH_BUCKET <pipeline.models._decode_choice.LENGTH_BUCKET>`-token
    steps), a number the run's batches bound, not 8: its calls run with the
    limits lifted (:func:`_unlimited_recompiles`), for this step alone.
    """
    compiled: _Logits = torch.compile(_logits, fullgraph=True, dynamic=False)

    def step(*args: Any) -> torch.Tensor:  # (the arguments of :func:`_logits`)
        with _unlimited_recompiles():
            return compiled(*args)

    return step


def _unlimited_recompiles() -> contextlib.AbstractContextManager[None]:
    """Dynamo's recompile limits (per function, and accumulated) lifted while in it: ``config.patch`` restores them
    on leaving (and from torch 2.13 a patch holds for the calling thread alone). ``cache_size_limit`` and
    ``accumulated_cache_size_limit`` are the names torch before 2.6 gives them."""
    config = torch._dynamo.config
    names = ("recompile_limit", "accumulated_recompile_limit")
    if not hasattr(config, names[0]):
        names = ("cache_size_limit", "accumulated_cache_size_limit")
    lifted = {name: sys.maxsize for name in names if hasattr(config, name)}
    patch: contextlib.AbstractContextManager[None] = config.patch(lifted)
    return patch


def _next_logits(out: Any) -> torch.Tensor:
    """The last position's logits of a model's output, in float32 for sampling."""
    logits: torch.Tensor = out.logits[:, -1]
    return logits.float()
