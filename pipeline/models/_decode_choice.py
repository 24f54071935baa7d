"""Which decoder the built-in engine runs: decided on its first batch, said in one log line, kept per batch shape.

``--decode auto`` (the default) captures the decode step as a CUDA graph
over a static KV cache where the model is on a GPU and can decode so, and
otherwise runs today's dynamic cache; ``dynamic``, ``static`` (eager steps
over the static cache), ``graphs`` and ``compiled`` (the step compiled by
``torch.compile`` over the static cache, and on a GPU replayed as a CUDA
graph) ask for one path, and a model or device that cannot take it is
refused with the reason. Before the static
cache is trusted, one row's prefill and first step are checked against the
dynamic cache's logits: a model that ignores the prepared mask would
otherwise sample from the wrong distribution, silently.
"""

from __future__ import annotations

import logging
from typing import Literal, get_args

import torch

from ._causal_lm import ModelError, first_line
from ._compiler import require_compiler
from ._decoders import Decoder, DynamicDecoder, ModelCall, StaticDecoder, static_refusal

__all__ = ["DECODE_PATHS", "DecodePath", "DecoderChoice"]

_log = logging.getLogger(__name__)

DecodePath = Literal["auto", "dynamic", "static", "graphs", "compiled"]
DECODE_PATHS: tuple[str, ...] = get_args(DecodePath)

#: steps between the host's checks that every row has ended on the graph path (a check stalls the queued replays)
GRAPH_CHECK_EVERY = 8
#: a static cache's length is rounded up to this many tokens, so batches of nearby prompt lengths share a graph
LENGTH_BUCKET = 64
#: static decoders kept, one per row count, the least recently used let go (a rollout's and an evaluation's)
KEPT_SHAPES = 2
#: batches in a row that fill less than half a kept cache before it is rebuilt shorter (one such batch between
#: longer ones, prompt widths alternating, must not rebuild and recapture it every time)
SHRINK_AFTER = 3


class DecoderChoice:
    """The decode path a built-in engine takes, and the static decoder it keeps for its batch shape.

    A decoder is kept per row count (the last :data:`KEPT_SHAPES` used);
    it serves a batch of its rows whose prompt + new tokens fit its length.
    A longer batch builds a longer one (its graph captured anew), and
    :data:`SHRINK_AFTER` batches in a row that fill less than half of it
    a shorter one. Weights that moved to new storage are the decoder's
    :class:`~pipeline.models.StepGraphs`' to follow.
    """

    def __init__(self, model: torch.nn.Module, call: ModelCall, wanted: DecodePath = "auto") -> None:
        if wanted not in DECODE_PATHS:
            raise ValueError(f"decode path {wanted!r}: expected one of {', '.join(DECODE_PATHS)}")
        if wanted == "compiled":  # refused now rather than at the first rollout's compile
            require_compiler(next(model.parameters()).device, "--decode compiled")
        self.model = model
        self.call = call
        self.wanted = wanted
        self.path: str | None = None  # dynamic | static | graphs | compiled, once the first batch decided it
        self._static: dict[int, StaticDecoder] = {}  # by row count, the most recently used last
        self._short: dict[int, int] = {}  # by row count: batches in a row that filled under half of its cache

    @property
    def kept(self) -> StaticDecoder | None:
        """The static decoder the last batch ran on, if the path is static."""
        return next(reversed(self._static.values()), None)

    @property
    def check_every(self) -> int:
        """Steps between the host's checks that every row has ended (1 where a check stalls nothing)."""
        return GRAPH_CHECK_EVERY if self._replays else 1

    @property
    def _replays(self) -> bool:
        """Whether the static decoder's step is a CUDA graph's replay: ``graphs``, or ``compiled`` on a GPU."""
        cuda = next(self.model.parameters()).device.type == "cuda"
        return self.path == "graphs" or (self.path == "compiled" and cuda)

    def decoder(self, ids: torch.Tensor, prompt_mask: torch.Tensor, new_tokens: int) -> Decoder:
        """A decoder for this batch ([rows, P] left-padded prompts, ``new_tokens`` to draw)."""
        if self.path is None:
            self.path = self._decide(ids, prompt_mask)
        if self.path == "dynamic":
            return DynamicDecoder(self.model, self.call)
        rows, need = ids.shape[0], ids.shape[1] + new_tokens
        fitted = -(-need // LENGTH_BUCKET) * LENGTH_BUCKET
        kept = self._static.pop(rows, None)
        if kept is not None:
            # over twice the need, and over the size this need would build anyway (a short batch's bucket is more
            # than twice it: rebuilt each batch, it recaptured its graph every rollout)
            oversized = kept.length > max(2 * need, fitted)
            short = self._short[rows] = self._short.get(rows, 0) + 1 if oversized else 0
            if need > kept.length or short >= SHRINK_AFTER:
                kept.close()
                kept = None
        if kept is None:
            self._short[rows] = 0
            kept = self._build(rows, fitted)
            if kept is None:
                return DynamicDecoder(self.model, self.call)
        self._static[rows] = kept
        while len(self._static) > KEPT_SHAPES:
            oldest = next(iter(self._static))
            self._static.pop(oldest).close()
            self._short.pop(oldest, None)
        return kept

    def close(self) -> None:
        """Release the kept decoders' caches and graphs."""
        for decoder in self._static.values():
            decoder.close()
        self._static.clear()
        self._short.clear()

    def _build(self, rows: int, length: int) -> StaticDecoder | None:
        """A static decoder of this shape (its step captured on the graph path); None if ``auto`` could not
        capture it, the path then dynamic from here on."""
        graphs, compile = self._replays, self.path == "compiled"
        try:
            decoder = StaticDecoder(self.model, self.call, rows, length, graphs=graphs, compile=compile)
        except Exception as exc:
            if compile:
                raise ModelError(
                    f"decode compiled: {type(self.model).__name__}: torch.compile of its step failed: "
                    f"{type(exc).__name__}: {first_line(exc)}"
                ) from exc
            if not graphs or self.wanted == "graphs":
                raise
            self.path = "dynamic"
            self.close()  # (the decoders kept for other shapes are never used again: their caches and graphs go)
            _log.warning("builtin engine: capturing the decode step failed (%s); decoding over a dynamic cache", exc)
            return None
        return decoder

    def _decide(self, ids: torch.Tensor, prompt_mask: torch.Tensor) -> str:
        device = next(self.model.parameters()).device
        wanted = self.wanted
        if wanted == "dynamic":
            return self._chosen("dynamic", device, "as asked")
        refusal = static_refusal(self.model)
        if refusal is not None:
            if wanted != "auto":
                raise ModelError(f"decode {wanted}: {type(self.model).__name__} cannot use a static cache: {refusal}")
            return self._chosen("dynamic", device, f"no static cache: {refusal}")
        if device.type != "cuda":
            if wanted == "graphs":
                raise ModelError(f"decode graphs: CUDA graphs need the model on a CUDA device, not {device}")
            if wanted == "auto":
                return self._chosen("dynamic", device, f"no CUDA graphs on {device.type}")
        try:
            gap = self._static_gap(ids[:1], prompt_mask[:1])
        except Exception as exc:  # a transformers whose static cache works otherwise, say
            if wanted != "auto":
                raise ModelError(
                    f"decode {wanted}: {type(self.model).__name__}: its static cache failed: {exc}"
                ) from exc
            _log.warning(
                "builtin engine: the static cache failed (%s: %s); decoding over a dynamic cache",
                type(exc).__name__,
                exc,
            )
            return self._chosen("dynamic", device, "the static cache failed")
        if gap is not None:
            message = f"the static cache's logits differ from the dynamic cache's by {gap:.3g}"
            if wanted != "auto":
                raise ModelError(f"decode {wanted}: {type(self.model).__name__}: {message}")
            _log.warning("builtin engine: %s; decoding over a dynamic cache", message)
            return self._chosen("dynamic", device, "the static cache did not match")
        if wanted == "compiled":
            return self._chosen("compiled", device, "")
        return self._chosen("graphs" if device.type == "cuda" and wanted != "static" else "static", device, "")

    def _chosen(self, path: str, device: torch.device, why: str) -> str:
        how = {
            "graphs": "replaying a captured CUDA graph per step over a static KV cache",
            "static": "over a static KV cache, each step run eagerly",
            "dynamic": "over the model's dynamic KV cache",
            "compiled": "over a static KV cache, each step compiled by torch.compile"
            + (" and replayed as a captured CUDA graph" if device.type == "cuda" else ""),
        }[path]
        _log.info("builtin engine on %s: decoding %s%s", device, how, f" ({why})" if why else "")
        return path

    def _static_gap(self, ids: torch.Tensor, prompt_mask: torch.Tensor) -> float | None:
        """How far one row's prefill and first step over a static cache are from the dynamic cache's; None if
        within the logits' precision (bfloat16 rounds at 2⁻⁸)."""
        dynamic = DynamicDecoder(self.model, self.call)
        static = StaticDecoder(self.model, self.call, 1, ids.shape[1] + 2)
        try:
            want = [dynamic.prefill(ids, prompt_mask)]
            got = [static.prefill(ids, prompt_mask)]
            token = want[0].argmax(-1)
            want.append(dynamic.step(token))
            got.append(static.step(token))
        finally:
            static.close()
        tolerance = 1e-3 if next(self.model.parameters()).dtype == torch.float32 else 3e-2
        if all(torch.allclose(g, w, rtol=tolerance, atol=tolerance) for g, w in zip(got, want, strict=True)):
            return None
        return max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
