"""``--decode compiled`` over many batch shapes in one process: each (rows, length) shape is compiled once, and no
number of shapes reaches Dynamo's recompile limit (it used to fail the generator at its 5th shape)."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

from pipeline_support import tiny_qwen2

from pipeline.models import ModelCall, StaticDecoder


def test_the_compiled_step_serves_more_shapes_than_the_recompile_limit_compiling_each_once(monkeypatch):
    # Dynamo's graphs run as traced (no C++ build): the recompile bookkeeping is the compiled path's own
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()  # no shape compiled by an earlier test counts here
    try:
        _serve_more_shapes_than_the_limit()
    finally:
        torch._dynamo.reset()  # nor do this test's graphs (of another backend) stay for a later one


def _serve_more_shapes_than_the_limit() -> None:
    from torch._dynamo.utils import counters

    limit = torch._dynamo.config.recompile_limit
    model = tiny_qwen2(500, pad_token_id=0, eos_token_id=2, attn_implementation="sdpa")
    call = ModelCall.of(model)
    rng = torch.Generator().manual_seed(3)
    lengths = [64 * n for n in range(1, limit + 3)]  # more shapes than the limit, even at one graph each
    before = counters["stats"]["unique_graphs"]
    for length in lengths:
        ids = torch.randint(3, 500, (2, 7), generator=rng)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0  # a left-padded row
        with torch.no_grad():  # as the engine decodes
            compiled = StaticDecoder(model, call, 2, length, compile=True)
            eager = StaticDecoder(model, call, 2, length)
            torch.testing.assert_close(compiled.prefill(ids, mask), eager.prefill(ids, mask))
            token = torch.tensor([4, 5])
            for _ in range(2):
                torch.testing.assert_close(compiled.step(token), eager.step(token))
        compiled.close()
        eager.close()
    assert counters["stats"]["unique_graphs"] - before == len(lengths), "each shape is compiled once"
    assert torch._dynamo.config.recompile_limit == limit, "the limit is lifted for the decode step alone"
