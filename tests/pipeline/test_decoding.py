"""The built-in engine's decoders: a static KV cache (its step captured as a CUDA graph on a GPU) draws exactly what
the model's dynamic cache draws, never synchronises inside the step, and never samples with weights it no longer has."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

import transformers
from pipeline_support import tiny_qwen2

from actors import WeightInbox, WeightPublisher
from pipeline.models import (
    BuiltinEngine,
    DecoderChoice,
    DynamicDecoder,
    ModelCall,
    ModelError,
    SamplingParams,
    StaticDecoder,
    missing_compiler,
    static_refusal,
)
from pipeline.models._decode_choice import SHRINK_AFTER

CHOICE_LOG = "pipeline.models._decode_choice"


class Tokenizer:
    """What the engine needs of a tokenizer: pad and end ids, and a decode."""

    pad_token_id = 0
    eos_token_id = 2

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def qwen2(vocab: int = 500, attention: str = "sdpa", seed: int = 0, **extra: Any) -> Any:
    return tiny_qwen2(vocab, seed=seed, pad_token_id=0, eos_token_id=2, attn_implementation=attention, **extra)


def prompts(vocab: int, lengths: tuple[int, ...] = (5, 17, 1, 9, 30)) -> list[list[int]]:
    rng = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=rng).tolist() for n in lengths]


def draw_with(engine: BuiltinEngine, batch: list[list[int]], params: SamplingParams, seed: int = 7) -> Any:
    return engine.generate(batch, params, torch.Generator(device=engine.model.device).manual_seed(seed))


def assert_same_completions(got: Any, want: Any, atol: float = 1e-5) -> None:
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.mask, want.mask)
    torch.testing.assert_close(got.logps, want.logps, rtol=0, atol=atol)
    assert got.texts == want.texts


# -- the static cache draws what the dynamic cache draws ---------------------------------------------------------


@pytest.mark.parametrize(
    "attention, vocab, params",
    [
        ("sdpa", 500, SamplingParams(24, temperature=1.0, samples=3)),
        ("sdpa", 500, SamplingParams(24, temperature=0.7, top_p=0.8, top_k=20, samples=2)),
        ("eager", 500, SamplingParams(24, temperature=1.3, samples=3)),
        ("sdpa", 500, SamplingParams(12, temperature=0.0)),
        ("sdpa", 151_936, SamplingParams(6, temperature=1.0, samples=2)),  # a real vocabulary, a tiny width
    ],
)
def test_the_static_cache_draws_the_dynamic_caches_tokens_and_log_probs(attention, vocab, params):
    model = qwen2(vocab, attention)
    batch = prompts(vocab)
    dynamic = draw_with(BuiltinEngine(model, Tokenizer(), "dynamic"), batch, params)
    static_engine = BuiltinEngine(model, Tokenizer(), "static")
    static = draw_with(static_engine, batch, params)
    assert static_engine.decoding.path == "static" and static.tokens.shape[0] == len(batch) * params.samples
    assert_same_completions(static, dynamic)
    again = draw_with(static_engine, batch, params)  # the kept cache, emptied and filled afresh
    assert_same_completions(again, static, atol=0)


@pytest.mark.parametrize("queries", [1, 6])
@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
def test_grouped_attention_equals_sdpa_over_repeated_key_value_heads(queries, mask_kind):
    """A group's query heads as rows of one query over the unrepeated heads: transformers' sdpa attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from pipeline.models._grouped_attention import grouped_sdpa

    rng = torch.Generator().manual_seed(3)
    batch, heads, kv_heads, length, width = 3, 6, 2, 11, 8
    query = torch.randn(batch, queries, heads, width, generator=rng).transpose(1, 2)  # as a layer passes it
    key, value = (torch.randn(batch, kv_heads, length, width, generator=rng) for _ in range(2))
    allowed = torch.rand(batch, 1, queries, length, generator=rng) > 0.3
    allowed[..., 0] = True  # no row attends to nothing
    if queries > 1:  # the prompt pass, the only one of several queries: at the cache's first slots, none after
        allowed[..., queries:] = False
    mask = allowed if mask_kind == "bool" else torch.zeros(allowed.shape).masked_fill(~allowed, -1e9)
    layer = torch.nn.Module()
    layer.num_key_value_groups = heads // kv_heads
    want, _ = sdpa_attention_forward(layer, query, key, value, mask, scaling=0.3)
    got, _ = grouped_sdpa(layer, query, key, value, mask, scaling=0.3)
    assert got.shape == (batch, queries, heads, width)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="needs the prepared attention mask"):
        grouped_sdpa(layer, query, key, value, None)
    with pytest.raises(ValueError, match="6 query heads do not group over 4 key/value heads"):
        grouped_sdpa(layer, query, torch.cat([key, key], 1), torch.cat([value, value], 1), mask)


def test_the_prompt_pass_attends_over_the_prompts_keys_only_with_no_mask_per_head(monkeypatch):
    """The prompt pass grouped its query heads as a step does, repeating a [P x cache length] mask for each head of
    a group: with 7 heads a group, 256 prompts of 1024 tokens and a 2048-token cache, GBs of mask per layer. It
    attends over the P keys written (enable_gqa), with the one [P x P] mask every head shares."""
    sizes: list[tuple[int, ...]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, **kwargs):
        sizes.append(tuple(attn_mask.shape))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    model = qwen2()
    engine = BuiltinEngine(model, Tokenizer(), "static")
    draw_with(engine, prompts(500), SamplingParams(4))
    prompt_passes = [size for size in sizes if size[2] > 1]
    assert prompt_passes and all(size[1] == 1 and size[2] == size[3] for size in prompt_passes), prompt_passes


def test_the_static_cache_attends_with_grouped_heads_and_gives_the_model_its_own_attention_back():
    model = qwen2()
    seen: list[str] = []
    layer = model.model.layers[0].self_attn
    layer.register_forward_hook(lambda module, args, out: seen.append(module.config._attn_implementation))
    engine = BuiltinEngine(model, Tokenizer(), "static")
    draw_with(engine, prompts(500), SamplingParams(4))
    # the prefill and each of the 3 steps after it (the model's own sdpa: the check against the dynamic cache)
    assert seen.count("pipeline_grouped_sdpa") >= 4, seen
    assert model.config._attn_implementation == "sdpa"
    seen.clear()
    draw_with(BuiltinEngine(model, Tokenizer(), "dynamic"), prompts(500), SamplingParams(4))
    assert set(seen) == {"sdpa"}


def test_a_graph_is_keyed_by_the_addresses_a_tied_head_reads_however_it_was_assigned():
    """An aliasing install of a state_dict leaves a tied head as a second parameter over the embedding's storage:
    the same addresses, so the same key (a graph kept for them is replayed, not captured again)."""
    from pipeline.models._decoders import _storage

    model = qwen2()
    key = _storage(model)
    with torch.no_grad():
        model.load_state_dict(dict(model.state_dict()), assign=True)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert _storage(model) == key
    with torch.no_grad():
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    assert _storage(model) != key


def test_the_completions_end_where_every_row_ended_however_seldom_the_host_looks():
    """On the graph path the host looks every few steps whether all rows ended; the steps drawn after that are
    dropped, so the completions are the ones a look every step gives."""
    model, batch = qwen2(), prompts(500)
    with torch.no_grad():  # the end token likelier along the hidden states' mean: rows end at 1 to 37 tokens
        hidden = model.model(input_ids=torch.tensor([batch[1]])).last_hidden_state[0].mean(0)
        model.lm_head.weight[2] += 20 * hidden / hidden.norm() ** 2
    params = SamplingParams(40, samples=4)
    every_step = draw_with(BuiltinEngine(model, Tokenizer(), "static"), batch, params)
    assert every_step.mask.shape[1] == 37 and every_step.mask.sum(1).min() == 1, "the last row ends at 37, not 8k"

    class SeldomLooks(DecoderChoice):
        check_every = 8  # type: ignore[assignment]

    seldom = BuiltinEngine(model, Tokenizer(), "static")
    seldom.decoding = SeldomLooks(model, ModelCall.of(model), "static")
    assert_same_completions(draw_with(seldom, batch, params), every_step, atol=0)

    # one generator across calls (a one-process run's, an evaluation's chunks): the draws past the end, dropped,
    # had moved it on, so every later call drew other tokens than a look every step
    looks, seldom_generator = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    every = BuiltinEngine(model, Tokenizer(), "static")
    for _ in range(2):
        first = every.generate(batch, params, looks)
        second = seldom.generate(batch, params, seldom_generator)
        assert torch.equal(looks.get_state(), seldom_generator.get_state())
        assert_same_completions(second, first, atol=0)


class NoHostSync(TorchDispatchMode):
    """Fails on any operation that makes the host wait for the device (a CUDA graph cannot capture one)."""

    SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "item", "equal")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.__name__.split(".")[0]
        assert name not in self.SYNCING, f"the step synchronises with the host: {func}"
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_the_step_a_graph_captures_never_waits_for_the_device(attention):
    model = qwen2(attention=attention)
    decoder = StaticDecoder(model, ModelCall.of(model), 2, 16)
    with torch.no_grad():
        logits = decoder.prefill(torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]]))
        with NoHostSync():
            for _ in range(3):
                logits = decoder.step(logits.argmax(-1))
    assert logits.shape == (2, 500) and bool(torch.isfinite(logits).all())


class TakesSlots(torch.nn.Module):
    """A transformers 4.x-shaped forward, which takes the cache slots a pass writes (``cache_position``): records
    them and runs the model."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.inner, self.config, self.slots = model, model.config, []  # type: ignore[var-annotated]

    def forward(  # type: ignore[no-untyped-def]
        self, input_ids, attention_mask, position_ids, use_cache, past_key_values, cache_position=None, **keep
    ):
        self.slots.append(cache_position.tolist())
        inner = ModelCall.of(self.inner)
        if inner.takes_cache_position:  # a transformers 4.x model itself
            keep["cache_position"] = cache_position
        cache = {inner.cache_argument: past_key_values}
        return self.inner(input_ids, attention_mask, position_ids, use_cache=use_cache, **cache, **keep)


def test_a_model_that_takes_the_cache_slots_is_told_them_every_pass():
    """transformers 4.x guesses a static cache's fill from row 0's non-zero keys unless told the slots: a
    left-padded first row whose pad keys are zero then wrote each step one slot too early, sampling from other
    logits than the dynamic cache's (caught by the check before sampling, so 4.x decoded dynamically)."""
    model = TakesSlots(qwen2())
    assert ModelCall.of(model).takes_cache_position
    static = StaticDecoder(model, ModelCall.of(model), 2, 16)
    dynamic = DynamicDecoder(model.inner, ModelCall.of(model.inner))
    ids, mask = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 4]]), torch.tensor([[0, 0, 1, 1], [1] * 4])
    with torch.no_grad():
        got, want = static.prefill(ids, mask), dynamic.prefill(ids, mask)
        for _ in range(3):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            token = want.argmax(-1)
            got, want = static.step(token), dynamic.step(token)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert model.slots == [[0, 1, 2, 3], [4], [5], [6]]


def test_a_full_static_cache_and_a_batch_that_does_not_fit_are_refused():
    model = qwen2()
    decoder = StaticDecoder(model, ModelCall.of(model), 1, 4)
    with torch.no_grad():
        with pytest.raises(ValueError, match="2 prompts of 3 tokens do not fit a decoder of 1 x 4"):
            decoder.prefill(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long))
        decoder.prefill(torch.ones(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long))
        decoder.step(torch.tensor([4]))
        with pytest.raises(ValueError, match="cache of 4 tokens is full"):
            decoder.step(torch.tensor([4]))


# -- which path runs, said once --------------------------------------------------------------------------------


def test_auto_keeps_the_dynamic_cache_on_a_cpu_and_says_so_once(caplog):
    model = qwen2()
    engine = BuiltinEngine(model, Tokenizer())
    with caplog.at_level(logging.INFO, logger=CHOICE_LOG):
        for seed in (1, 2):
            draw_with(engine, prompts(500), SamplingParams(4, samples=2), seed)
    lines = [record.getMessage() for record in caplog.records if record.name == CHOICE_LOG]
    assert lines == ["builtin engine on cpu: decoding over the model's dynamic KV cache (no CUDA graphs on cpu)"]
    assert engine.decoding.path == "dynamic" and engine.decoding.kept is None


def test_a_model_or_device_that_cannot_take_the_path_asked_for_is_refused_with_the_reason(caplog):
    sliding = qwen2(use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert static_refusal(sliding) == "it has layers other than full attention (sliding_attention)"
    with pytest.raises(ModelError, match="decode static: Qwen2ForCausalLM cannot use a static cache: it has layers"):
        draw_with(BuiltinEngine(sliding, Tokenizer(), "static"), prompts(500), SamplingParams(4))
    flex = qwen2(attention="flex_attention")
    assert static_refusal(flex) == "its attention (flex_attention) does not take a prepared mask (sdpa and eager do)"
    with pytest.raises(ModelError, match="decode graphs: CUDA graphs need the model on a CUDA device, not cpu"):
        draw_with(BuiltinEngine(qwen2(), Tokenizer(), "graphs"), prompts(500), SamplingParams(4))
    with pytest.raises(ValueError, match="decode path 'fast': expected one of auto, dynamic, static, graphs"):
        BuiltinEngine(qwen2(), Tokenizer(), "fast")  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger=CHOICE_LOG):
        engine = BuiltinEngine(sliding, Tokenizer())
        draw_with(engine, prompts(500), SamplingParams(4))
    assert engine.decoding.path == "dynamic"
    assert "no static cache: it has layers other than full attention" in caplog.text


class IgnoresPreparedMasks(transformers.Qwen2ForCausalLM):  # type: ignore[misc]
    """A model that lets every query see every cache slot when handed a prepared mask."""

    def forward(self, *args: Any, attention_mask: Any = None, **kwargs: Any) -> Any:
        if attention_mask is not None and attention_mask.dim() == 4:
            attention_mask = torch.ones_like(attention_mask)
        return super().forward(*args, attention_mask=attention_mask, **kwargs)


def test_a_model_whose_static_cache_gives_other_logits_is_caught_before_it_samples():
    model = IgnoresPreparedMasks(qwen2().config).eval()
    with pytest.raises(ModelError, match="the static cache's logits differ from the dynamic cache's"):
        draw_with(BuiltinEngine(model, Tokenizer(), "static"), prompts(500), SamplingParams(4))


# -- the kept decoder and the weights it reads -----------------------------------------------------------------


def test_the_kept_cache_serves_batches_of_its_shape_and_is_rebuilt_for_another():
    model = qwen2()
    engine = BuiltinEngine(model, Tokenizer(), "static")
    params = SamplingParams(8, samples=2)
    draw_with(engine, prompts(500, (5, 30)), params)
    kept = engine.decoding.kept
    assert kept is not None and (kept.rows, kept.length) == (4, 64)  # 30 + 8 tokens, rounded up to 64
    draw_with(engine, prompts(500, (25, 3)), params)
    assert engine.decoding.kept is kept, "a batch of the same rows within the length reuses the cache"
    draw_with(engine, prompts(500, (5, 60)), params)
    longer = engine.decoding.kept
    assert longer is not kept and longer is not None and longer.length == 128
    for _ in range(SHRINK_AFTER - 1):
        draw_with(engine, prompts(500, (5, 25)), params)
        assert engine.decoding.kept is longer, "one batch under half of it is no reason to rebuild"
    draw_with(engine, prompts(500, (5, 25)), params)
    shorter = engine.decoding.kept
    assert shorter is not longer and shorter is not None and shorter.length == 64, "more than twice the need, again"
    draw_with(engine, prompts(500, (5, 6, 7)), params)
    assert engine.decoding.kept is not None and engine.decoding.kept.rows == 6
    short = engine.decoding.kept
    draw_with(engine, prompts(500, (5, 6, 7)), params)  # 7 + 8 tokens: its bucket (64) is over twice the need
    assert engine.decoding.kept is short, "a short batch's own bucket is reused, not rebuilt (recaptured) each time"


def test_alternating_prompt_widths_and_row_counts_reuse_their_kept_caches(monkeypatch):
    """Before, prompt widths alternating short and long rebuilt the cache (and recaptured its graph) every batch: a
    long batch grew it, the short one after it shrank it back. An evaluation's row count between rollouts did too."""
    built: list[tuple[int, int]] = []
    build = StaticDecoder.__init__

    def counted(self: StaticDecoder, model: Any, call: Any, rows: int, length: int, **options: Any) -> None:
        built.append((rows, length))
        build(self, model, call, rows, length, **options)

    engine = BuiltinEngine(qwen2(), Tokenizer(), "static")
    draw_with(engine, prompts(500, (5,)), SamplingParams(4))  # (the path is decided: its check builds one too)
    monkeypatch.setattr(StaticDecoder, "__init__", counted)
    built.clear()
    params = SamplingParams(8)
    for _ in range(3):
        draw_with(engine, prompts(500, (10, 4)), params)  # 18 tokens: a 64-token cache
        draw_with(engine, prompts(500, (100, 4)), params)  # 108 tokens: 128
        draw_with(engine, prompts(500, (10, 4, 6)), params)  # another row count (an evaluation's chunk)
    assert built == [(2, 64), (2, 128), (3, 64)], "each shape built once, and kept"


@pytest.mark.parametrize("alias", [False, True])
async def test_a_weight_update_reaches_the_cache_the_engine_decodes_with(alias):
    """The kept static cache holds no weights: whether the update is copied into the parameters or aliased (its
    tensors assigned), the next batch draws what the trained model draws (on a GPU: the graphs' test below)."""
    model, trained = qwen2(seed=0), qwen2(seed=1)
    engine = BuiltinEngine(model, Tokenizer(), "static")
    batch, params = prompts(500), SamplingParams(10, samples=2)
    draw_with(engine, batch, params)
    kept = engine.decoding.kept
    publisher, inbox = WeightPublisher("shm", slots=3), WeightInbox()
    try:
        inbox.put(publisher.publish(trained, 1))
        assert await engine.load_weights(inbox, alias=alias) is not None
        got = draw_with(engine, batch, params)
        assert kept is not None and engine.decoding.kept is kept
        assert_same_completions(got, draw_with(BuiltinEngine(trained, Tokenizer(), "dynamic"), batch, params))
    finally:
        engine.decoding.close()
        inbox.close()
        publisher.close()


# -- the compiled step ------------------------------------------------------------------------------------------

needs_a_compiler = pytest.mark.skipif(
    missing_compiler(torch.device("cpu")) is not None, reason="torch.compile on a CPU builds C++: no compiler here"
)


@needs_a_compiler
def test_the_compiled_step_draws_the_dynamic_caches_tokens_and_is_compiled_once_per_shape(caplog):
    from torch._dynamo.utils import counters

    model, batch = qwen2(), prompts(500)
    params = SamplingParams(12, temperature=0.8, top_k=50, samples=2)
    engine = BuiltinEngine(model, Tokenizer(), "compiled")
    with caplog.at_level(logging.INFO, logger=CHOICE_LOG):
        compiled = draw_with(engine, batch, params)
    assert engine.decoding.path == "compiled" and engine.decoding.check_every == 1  # no graph replays on a CPU
    assert "decoding over a static KV cache, each step compiled by torch.compile" in caplog.text
    assert_same_completions(compiled, draw_with(BuiltinEngine(model, Tokenizer(), "dynamic"), batch, params))
    graphs = counters["stats"]["unique_graphs"]
    again = BuiltinEngine(model, Tokenizer(), "compiled")  # another engine, another decoder: the same compiled step
    assert_same_completions(draw_with(again, batch, params), compiled, atol=0)
    assert counters["stats"]["unique_graphs"] == graphs, "a batch of a shape compiled before compiled again"


@needs_a_compiler
@pytest.mark.parametrize("alias", [False, True])
async def test_a_weight_update_reaches_the_compiled_step(alias):
    """The compiled step reads the parameters as inputs: copied into or assigned anew, the update is what it uses."""
    model, trained = qwen2(seed=0), qwen2(seed=1)
    engine = BuiltinEngine(model, Tokenizer(), "compiled")
    batch, params = prompts(500), SamplingParams(10, samples=2)
    before = draw_with(engine, batch, params)
    publisher, inbox = WeightPublisher("shm", slots=3), WeightInbox()
    try:
        inbox.put(publisher.publish(trained, 1))
        assert await engine.load_weights(inbox, alias=alias) is not None
        got = draw_with(engine, batch, params)
        assert_same_completions(got, draw_with(BuiltinEngine(trained, Tokenizer(), "dynamic"), batch, params))
        assert not torch.equal(got.tokens, before.tokens)
    finally:
        engine.decoding.close()
        inbox.close()
        publisher.close()


@needs_a_compiler
def test_a_step_that_does_not_compile_is_refused_with_the_reason():
    model = qwen2()
    # a layer torch.compile cannot trace as one graph (outside a compile, graph_break does nothing)
    model.model.norm.register_forward_hook(lambda module, args, out: torch._dynamo.graph_break())
    with pytest.raises(ModelError, match=r"decode compiled: Qwen2ForCausalLM: torch.compile of its step failed: "):
        draw_with(BuiltinEngine(model, Tokenizer(), "compiled"), prompts(500), SamplingParams(4))


# -- on a GPU: the captured graph ------------------------------------------------------------------------------


def _on_gpu(model: Any) -> Any:
    return model.to("cuda")


@pytest.mark.gpu
def test_on_a_gpu_auto_replays_a_captured_graph_that_draws_the_dynamic_caches_tokens(caplog):
    model = _on_gpu(qwen2(5_000))
    batch = prompts(5_000)
    params = SamplingParams(24, temperature=0.9, top_p=0.95, samples=4)
    engine = BuiltinEngine(model, Tokenizer())
    with caplog.at_level(logging.INFO, logger=CHOICE_LOG):
        graphed = draw_with(engine, batch, params)
    kept = engine.decoding.kept
    assert engine.decoding.path == "graphs" and kept is not None and kept.graphs is not None
    assert kept.graphs.captures == 1
    assert "replaying a captured CUDA graph per step over a static KV cache" in caplog.text
    assert_same_completions(graphed, draw_with(BuiltinEngine(model, Tokenizer(), "dynamic"), batch, params), 1e-4)
    assert_same_completions(draw_with(engine, batch, params), graphed, atol=0)  # replayed, not captured again
    assert kept.graphs.captures == 1
    engine.decoding.close()


@pytest.mark.gpu
@pytest.mark.parametrize("alias", [False, True])
@pytest.mark.parametrize("path", ["graphs", "compiled"])
def test_on_a_gpu_a_weight_update_reaches_the_captured_graph(path, alias):
    """As the weight consumer installs: a copy into the parameters, or (alias) the update's tensors assigned — a
    graph is captured for the new storage, and the first one replayed again when the first storage comes back.
    The compiled step (``--decode compiled``) is captured and replayed the same way."""
    model, trained = _on_gpu(qwen2(seed=0)), _on_gpu(qwen2(seed=1))
    engine = BuiltinEngine(model, Tokenizer(), path)  # type: ignore[arg-type]
    batch, params = prompts(500), SamplingParams(10, samples=2)
    before = draw_with(engine, batch, params)
    assert engine.decoding.check_every > 1, "the host looks every few replays"
    if path == "compiled":
        assert_same_completions(before, draw_with(BuiltinEngine(model, Tokenizer(), "dynamic"), batch, params), 1e-4)
    first = dict(model.state_dict())
    update = {name: tensor.clone() for name, tensor in trained.state_dict().items()}
    with torch.no_grad():
        if alias:
            model.load_state_dict(update, assign=True)
        else:
            for name, tensor in model.state_dict().items():
                tensor.copy_(update[name])
    got = draw_with(engine, batch, params)
    kept = engine.decoding.kept
    assert kept is not None and kept.graphs is not None and kept.graphs.captures == (2 if alias else 1)
    assert_same_completions(got, draw_with(BuiltinEngine(trained, Tokenizer(), "dynamic"), batch, params), 1e-4)
    assert not torch.equal(got.tokens, before.tokens)
    if alias:  # the first storage again (a publisher's slots recur): its graph is replayed, none captured
        with torch.no_grad():
            model.load_state_dict(first, assign=True)
        assert_same_completions(draw_with(engine, batch, params), before, atol=0)
        assert kept.graphs.captures == 2
    engine.decoding.close()


class BreaksOnStaticCaches(transformers.Qwen2ForCausalLM):  # type: ignore[misc]
    """A model (or a transformers release) whose forward fails over a static cache."""

    def forward(self, *args: Any, past_key_values: Any = None, **kwargs: Any) -> Any:
        if isinstance(past_key_values, transformers.StaticCache):
            raise TypeError("this model's layers cannot update a StaticCache")
        return super().forward(*args, past_key_values=past_key_values, **kwargs)


def test_a_static_cache_that_fails_is_refused_with_the_reason_when_asked_for():
    model = BreaksOnStaticCaches(qwen2().config).eval()
    with pytest.raises(ModelError, match="decode static: BreaksOnStaticCaches: its static cache failed: this model"):
        draw_with(BuiltinEngine(model, Tokenizer(), "static"), prompts(500), SamplingParams(4))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "model_class, said",
    [(IgnoresPreparedMasks, "the static cache's logits differ"), (BreaksOnStaticCaches, "the static cache failed (")],
    ids=["logits-differ", "static-cache-fails"],
)
def test_on_a_gpu_auto_decodes_over_the_dynamic_cache_when_the_static_one_does_not_fit(caplog, model_class, said):
    model = _on_gpu(model_class(qwen2().config).eval())
    engine = BuiltinEngine(model, Tokenizer())
    with caplog.at_level(logging.INFO, logger=CHOICE_LOG):
        got = draw_with(engine, prompts(500), SamplingParams(4))
    assert engine.decoding.path == "dynamic" and said in caplog.text
    want = draw_with(BuiltinEngine(model, Tokenizer(), "dynamic"), prompts(500), SamplingParams(4))
    assert_same_completions(got, want)


def test_a_step_is_captured_with_the_models_gpu_current(monkeypatch):
    """A generator on ``cuda:1`` of a process whose current GPU is 0: the warm-up ran on the model's GPU but the
    capture on a stream of the current one, so its kernels were not captured (an empty graph replayed the same
    logits every step) or the capture failed. The whole capture runs with the model's GPU current now. (CUDA is
    stood in for: this machine has none, and a GPU machine here has one GPU.)"""
    import contextlib
    import types

    from pipeline.models import _decoders

    current = ["cuda:0"]
    captured_on: list[str] = []

    @contextlib.contextmanager
    def device(which: Any) -> Any:
        before, current[0] = current[0], str(which)
        try:
            yield
        finally:
            current[0] = before

    @contextlib.contextmanager
    def graph(graph: Any, pool: Any = None, stream: Any = None, capture_error_mode: str = "global") -> Any:
        captured_on.append(current[0] if stream is None else str(stream.device))
        yield

    def stream_on(which: Any = None) -> Any:
        return types.SimpleNamespace(device=current[0] if which is None else str(which), wait_stream=lambda s: None)

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "Stream", stream_on)
    monkeypatch.setattr(torch.cuda, "current_stream", stream_on)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: types.SimpleNamespace(reset=lambda: None))
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 0))
    on_gpu_1 = types.SimpleNamespace(parameters=lambda: iter([types.SimpleNamespace(device=torch.device("cuda", 1))]))
    graphs = _decoders.StepGraphs(on_gpu_1, lambda: torch.zeros(1))  # type: ignore[arg-type]
    graphs._capture()
    assert captured_on == ["cuda:1"]


def test_a_failed_capture_that_turns_auto_dynamic_releases_the_static_decoders_kept(caplog):
    """``auto`` on a GPU kept a static decoder (its KV cache, its graphs) for one batch shape; a capture for another
    shape then failed (no memory left for it) and the path turned dynamic: the kept decoder was never used or
    closed again, and held its GPU memory for the generator's life, beside the dynamic cache that replaced it."""
    import types

    model = qwen2()
    closed: list[int] = []
    choice = DecoderChoice(model, lambda *args, **kwargs: None)  # type: ignore[arg-type,return-value]
    choice.path = "graphs"  # (as a GPU's auto decided; capturing fails on this machine, as on a full GPU)
    choice._static[8] = types.SimpleNamespace(close=lambda: closed.append(8), length=64)  # type: ignore[assignment]
    ids, mask = torch.ones(4, 5, dtype=torch.long), torch.ones(4, 5, dtype=torch.long)
    with caplog.at_level(logging.WARNING):
        choice.decoder(ids, mask, 4)
    assert choice.path == "dynamic" and "capturing the decode step failed" in caplog.text
    assert closed == [8] and not choice._static
