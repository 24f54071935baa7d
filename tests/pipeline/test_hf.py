"""The user's model, prompts and rewards: a tiny random Hugging Face model built here, nothing downloaded."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import logging
import math
import os

import pytest
import torch
from harness import ROOT, run_python
from pipeline_support import tiny_qwen2

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
pytest.importorskip("datasets", reason="needs the hf extra: pip install -e '.[hf]'")

from actors import forkserver_preload, set_forkserver_preload
from pipeline import Config, PipelineError, resolve, run_pipeline
from pipeline.algorithm import group_advantages, group_spread, high_entropy_tokens
from pipeline.config import SettingsError
from pipeline.grpo import main
from pipeline.learning import FullySharded, Learner, Update
from pipeline.models import (
    BuiltinEngine,
    GenerateEngine,
    ModelError,
    SamplingParams,
    causal_logps,
    compile_blocks,
    load_model,
    load_tokenizer,
    missing_compiler,
)
from pipeline.run import read_rows
from pipeline.tasks import DataError, HFTask, PromptData, RewardError, RewardLog, RewardSet, load_reward, load_rows


def _example():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("tiny_hf_model", os.path.join(ROOT, "examples", "tiny_hf_model.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flags", [["--digits", "3"], ["--digits", "0"], ["--rows", "0"]])
def test_the_example_refuses_more_rows_than_its_digits_can_make(tmp_path, capsys, flags):
    """``--digits 3`` with the default 2,000 rows: there are 1,000 three-digit numbers, and it drew numbers for
    good at full CPU, saying nothing. A usage error now, before any model is built."""
    with pytest.raises(SystemExit) as caught:
        _example().main([str(tmp_path), *flags])
    assert caught.value.code == 2 and "give 1 to 10**digits rows" in capsys.readouterr().err
    assert not (tmp_path / "model").exists()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A folder with model/ (Qwen2-style, random), train.jsonl, chat.jsonl and rewards.py."""
    folder = tmp_path_factory.mktemp("tiny-hf")
    example = _example()
    assert example.main([str(folder), "--rows", "200"]) == 0
    chat = folder / "chat"  # the same kind of prompts, as chat messages
    chat.mkdir()
    example.write_task(str(chat), 50, 4, True, 0)
    return folder


#: The own-code model's chat template asks for this variable (TRL's chat_template_kwargs) and fails without it.
HINTED_TEMPLATE = "{% if hint is not defined %}{{ raise_exception('the template needs hint') }}{% endif %}{{ hint }}"


@pytest.fixture(scope="module")
def own_code(tiny, tmp_path_factory):  # type: ignore[no-untyped-def]
    """The tiny model as one that brings its own code (a Qwen2 subclass named in ``auto_map``), with a chat
    template that needs a variable."""
    import shutil

    folder = tmp_path_factory.mktemp("own-code") / "model"
    shutil.copytree(tiny / "model", folder)
    (folder / "configuration_hinted.py").write_text(
        "from transformers import Qwen2Config\n\n\nclass HintedConfig(Qwen2Config):\n    model_type = 'hinted_qwen2'\n"
    )
    (folder / "modeling_hinted.py").write_text(
        "from transformers import Qwen2ForCausalLM\n\nfrom .configuration_hinted import HintedConfig\n\n\n"
        "class HintedForCausalLM(Qwen2ForCausalLM):\n    config_class = HintedConfig\n"
    )
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="hinted_qwen2",
        architectures=["HintedForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_hinted.HintedConfig",
            "AutoModelForCausalLM": "modeling_hinted.HintedForCausalLM",
        },
    )
    (folder / "config.json").write_text(json.dumps(config))
    template = folder / "chat_template.jinja"
    template.write_text(HINTED_TEMPLATE + template.read_text())
    return folder


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny):  # type: ignore[no-untyped-def]
    return load_model(str(tiny / "model")).eval(), load_tokenizer(str(tiny / "model"))


# -- generation ------------------------------------------------------------------------------------------------


ENGINES = [BuiltinEngine, GenerateEngine]  # --engine builtin, --engine hf (vLLM: test_vllm.py)


@pytest.mark.parametrize("engine_class", ENGINES)
@pytest.mark.parametrize(
    "temperature, top_p, top_k, min_p", [(1.0, 1.0, 0, 0.0), (0.7, 0.8, 0, 0.0), (1.3, 0.5, 5, 0.0), (0.8, 1.0, 0, 0.1)]
)
def test_behaviour_logps_equal_the_trainers_at_lag_0_across_mixed_prompt_lengths(
    model_and_tokenizer, temperature, top_p, top_k, min_p, engine_class
):
    model, tokenizer = model_and_tokenizer
    prompts = [tokenizer(text)["input_ids"] for text in ("reverse:1234=", "ab=", "reverse:98765432=", "x")]
    engine = engine_class(model, tokenizer)
    params = SamplingParams(8, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, samples=3)
    out = engine.generate(prompts, params, torch.Generator().manual_seed(0))
    assert out.tokens.shape[0] == 12 and out.prompt_mask.shape == (12, 17)
    assert [int(out.prompt_mask[row].sum()) for row in (0, 3, 6, 9)] == [13, 3, 17, 1]  # left padding
    with torch.no_grad():
        logps, _ = causal_logps(model, out.tokens, out.prompt_mask, temperature)
    gap = ((logps - out.logps) * out.mask).abs().max().item()
    assert gap < 1e-4, gap


def test_the_generate_engine_keeps_one_steps_distribution_not_every_steps_logits(model_and_tokenizer, monkeypatch):
    """``generate(output_logits=True)`` keeps a float32 [N, V] copy of every step until it returns ([T, N, V]: 40 GB
    for 256 x 256 tokens at a 151,936-token vocabulary): the engine asks for none, and at most two steps'
    log-probabilities are alive at once."""
    model, tokenizer = model_and_tokenizer
    engine = GenerateEngine(model, tokenizer)
    asked: list[dict] = []
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda **kwargs: asked.append(kwargs) or generate(**kwargs))
    from pipeline.models import _engines

    alive, most = [0], [0]
    on_forward = _engines._StepLogps.on_forward

    def counting(self, module, args, output):  # type: ignore[no-untyped-def]
        on_forward(self, module, args, output)
        alive[0] = sum(t is not None for t in (self.latest, self.pending))
        most[0] = max(most[0], alive[0])

    monkeypatch.setattr(_engines._StepLogps, "on_forward", counting)
    prompts = [tokenizer(text)["input_ids"] for text in ("reverse:1234=", "ab=")]
    out = engine.generate(prompts, SamplingParams(8, samples=3), torch.Generator().manual_seed(0))
    (kwargs,) = asked
    assert not kwargs.get("output_logits") and not kwargs.get("output_scores")
    assert most[0] <= 2 and out.logps.shape == out.mask.shape == (6, out.tokens.shape[1] - 13)


def test_generate_steps_that_do_not_match_the_tokens_are_refused_not_misaligned():
    """A decoding strategy that runs the model other than once per token (assisted decoding, a wrapper that calls
    another module) would pair log-probabilities with the wrong tokens: refused, naming the counts."""
    from pipeline.models import _engines

    steps = _engines._StepLogps(1.0)
    steps.pending = torch.zeros(2, 5, device="cpu").log_softmax(-1)
    steps.gather(torch.tensor([[1], [2]], device="cpu"))  # one model step was seen
    with pytest.raises(RuntimeError, match="generate ran 1 model steps for 3 tokens"):
        steps.finish(torch.tensor([[1, 2, 3], [2, 3, 4]], device="cpu"))


@pytest.mark.parametrize("engine_class", ENGINES)
def test_min_p_and_top_k_reach_each_engines_sampler(model_and_tokenizer, engine_class):
    """A cut to the likeliest token makes sampling greedy: every sample of a prompt is then the same."""
    model, tokenizer = model_and_tokenizer
    engine = engine_class(model, tokenizer)
    prompts = [tokenizer(text)["input_ids"] for text in ("reverse:1234=", "ab=")]
    for cut in ({"min_p": 0.999}, {"top_k": 1}):
        out = engine.generate(prompts, SamplingParams(6, samples=4, **cut), torch.Generator().manual_seed(0))
        rows = out.tokens.view(2, 4, -1)
        assert (rows == rows[:, :1]).all(), cut
    free = engine.generate(prompts, SamplingParams(6, samples=4), torch.Generator().manual_seed(0))
    rows = free.tokens.view(2, 4, -1)
    assert (rows != rows[:, :1]).any(), "without a cut the samples of a prompt differ"


def test_the_repetition_penalty_bends_as_transformers_does_and_both_engines_decode_alike(model_and_tokenizer):
    """The penalty on random logits equals transformers' processor; greedy with it, the built-in engine and
    transformers' generate draw the same tokens (prompts of one length: generate also penalises padding)."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from pipeline.algorithm import RepeatPenalty, draw

    logits = 3 * torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 50, (6, 9), generator=torch.Generator().manual_seed(1))
    repeats = RepeatPenalty.of(ids, torch.ones_like(ids), 50, 1.7)
    assert repeats is not None and RepeatPenalty.of(ids, torch.ones_like(ids), 50, 1.0) is None
    theirs = RepetitionPenaltyLogitsProcessor(1.7)(ids, logits.clone())
    assert torch.allclose(repeats.apply(logits), theirs)
    token, logp = draw(logits, 0.0, repeats=repeats)
    assert torch.equal(token, theirs.argmax(-1)) and torch.allclose(logp, logits.log_softmax(-1))
    assert repeats.seen[torch.arange(6), token].all(), "a drawn token is seen from then on"

    model, tokenizer = model_and_tokenizer
    prompts = [tokenizer(text)["input_ids"] for text in ("reverse:1234=", "reverse:9876=")]
    greedy = SamplingParams(8, temperature=0.0, repetition_penalty=3.0)
    ours = BuiltinEngine(model, tokenizer).generate(prompts, greedy)
    assert torch.equal(ours.tokens, GenerateEngine(model, tokenizer).generate(prompts, greedy).tokens)
    plain = BuiltinEngine(model, tokenizer).generate(prompts, SamplingParams(8, temperature=0.0))
    assert not torch.equal(ours.tokens, plain.tokens), "a penalty of 3 changes what greedy decoding picks"


def test_the_cuts_keep_what_transformers_warpers_keep_in_their_order():
    """top-k, then top-p, then min-p, as transformers' generate applies them (vLLM applies min-p first)."""
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from pipeline.algorithm import filter_logits

    logits = 3 * torch.randn(500, 40, generator=torch.Generator().manual_seed(0))
    for top_k, top_p, min_p in ((0, 0.8, 0.2), (10, 0.95, 0.05), (5, 1.0, 0.3), (0, 0.5, 0.0)):
        theirs = logits
        if top_k:
            theirs = TopKLogitsWarper(top_k)(None, theirs)
        if top_p < 1:
            theirs = TopPLogitsWarper(top_p)(None, theirs)
        if min_p:
            theirs = MinPLogitsWarper(min_p)(None, theirs)
        ours = filter_logits(logits, top_k, top_p, min_p)
        assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), (top_k, top_p, min_p)
    # ties whose probabilities sum exactly to top_p: transformers (and vLLM) drop the token past it; kept, the
    # nucleus was one token wider (4 equal logits at top_p 0.5 kept 3, not 2)
    assert int(filter_logits(torch.zeros(1, 4), top_p=0.5).isfinite().sum()) == 2
    tied = torch.randint(0, 3, (500, 8), generator=torch.Generator().manual_seed(1)).float()
    for top_p in (0.25, 0.5, 0.75):
        theirs = TopPLogitsWarper(top_p)(None, tied)
        assert torch.equal(torch.isinf(filter_logits(tied, top_p=top_p)), torch.isinf(theirs)), top_p


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", 0),
        ("max_new_tokens", True),
        ("temperature", -0.5),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("min_p", 1.0),
        ("repetition_penalty", 0.0),
        ("samples", 0),
    ],
)
def test_sampling_params_refuse_what_no_sampler_can_mean(field, value):
    """Before, ``max_new_tokens=0`` ran the prompt pass and then failed in ``torch.stack``; a negative temperature
    sampled from the inverted distribution without a word."""
    kwargs = {"max_new_tokens": 4, field: value}
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("engine_class", ENGINES)
def test_a_prompt_token_outside_the_vocabulary_is_refused_naming_its_prompt(model_and_tokenizer, engine_class):
    """On a GPU such an id is a device-side assert that poisons the process; here it was an ``IndexError``."""
    model, tokenizer = model_and_tokenizer
    vocab = model.get_input_embeddings().num_embeddings
    with pytest.raises(ValueError, match=rf"prompt 1 has token {vocab}, outside the model's vocabulary of {vocab}"):
        engine_class(model, tokenizer).generate([[1, 2], [3, vocab]], SamplingParams(4))


@pytest.mark.parametrize("engine_class", ENGINES)
def test_the_same_generator_seed_draws_the_same_completions(model_and_tokenizer, engine_class):
    model, tokenizer = model_and_tokenizer
    engine = engine_class(model, tokenizer)
    prompts = [tokenizer("reverse:1234=")["input_ids"], tokenizer("ab=")["input_ids"]]
    params = SamplingParams(max_new_tokens=6, samples=4)
    first = engine.generate(prompts, params, torch.Generator().manual_seed(3))
    again = engine.generate(prompts, params, torch.Generator().manual_seed(3))
    other = engine.generate(prompts, params, torch.Generator().manual_seed(4))
    assert torch.equal(first.tokens, again.tokens) and not torch.equal(first.tokens, other.tokens)


@pytest.mark.parametrize("engine_class", ENGINES)
def test_a_prompt_completes_the_same_alone_and_in_a_padded_batch(model_and_tokenizer, engine_class):
    model, tokenizer = model_and_tokenizer
    engine = engine_class(model, tokenizer)
    short = tokenizer("ab=")["input_ids"]
    long = tokenizer("reverse:98765432=")["input_ids"]
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    alone = engine.generate([short], greedy)
    batched = engine.generate([long, short], greedy)
    assert batched.texts[1] == alone.texts[0]
    width = alone.logps.shape[1]
    assert torch.allclose(batched.logps[1, :width], alone.logps[0], atol=1e-5)


@pytest.mark.parametrize("engine_class", ENGINES)
def test_the_completion_ends_at_the_end_token_and_text_leaves_it_out(model_and_tokenizer, engine_class):
    model, tokenizer = model_and_tokenizer
    eos = tokenizer.eos_token_id
    with torch.no_grad():  # make the end token the likeliest everywhere
        model.lm_head.weight[eos] += 50.0
    try:
        out = engine_class(model, tokenizer).generate(
            [tokenizer("ab=")["input_ids"]], SamplingParams(6, temperature=0.0)
        )
    finally:
        with torch.no_grad():
            model.lm_head.weight[eos] -= 50.0
    assert out.tokens[0, -1] == eos and out.mask.tolist() == [[1.0]] and out.texts == [""]


# -- rewards ---------------------------------------------------------------------------------------------------


def _reward_file(tmp_path, body: str) -> str:  # type: ignore[no-untyped-def]
    path = tmp_path / "my_rewards.py"
    path.write_text(body)
    return str(path)


def test_rewards_load_by_file_module_and_builtin_name_with_weights(tiny):
    from_file = load_reward(f"{tiny / 'rewards.py'}:reversed_digits=0.5")
    builtin = load_reward("exact_match")
    module = load_reward("pipeline.tasks:final_number=2")
    assert (from_file.name, from_file.weight) == ("reversed_digits", 0.5)
    assert (builtin.name, builtin.weight, module.weight) == ("exact_match", 1.0, 2.0)


@pytest.mark.parametrize("weight", ["nan", "inf", "-inf", "1e400"])
def test_a_reward_weight_that_is_not_a_finite_number_is_refused(weight):
    """``exact_match=nan`` was taken: every weighted sum came out NaN, ``nansum`` made it 0, every advantage was 0,
    and the run learned nothing while each function's own reward looked healthy."""
    with pytest.raises(RewardError, match=f"exact_match={weight}: the weight after '=' must be a finite number"):
        RewardSet([f"exact_match={weight}"])


def test_a_subclass_of_the_hf_task_named_on_the_command_line_takes_a_dataset(tiny):
    """``--task module:MyHF`` (a subclass of HFTask, as the docs offer) with ``--dataset``: refused, "--dataset
    trains a Hugging Face model (--task hf)", and without it the task refused to start: it could never run. So
    were --gradient-checkpointing and --engine, which compared the task's name with "hf"."""
    from pipeline.grpo import parse_args

    model, data = str(tiny / "model"), str(tiny / "train.jsonl")
    flags = ["--task", "pipeline.tasks:HFTask", "--model", model, "--dataset", data, "--reward", "exact_match"]
    config, _ = parse_args([*flags, "--gradient-checkpointing", "--engine", "hf"])
    assert (config.task, config.dataset, config.gradient_checkpointing, config.engine) == (
        "pipeline.tasks:HFTask",
        data,
        True,
        "hf",
    )
    with pytest.raises(SettingsError, match="--gradient-checkpointing recomputes a Hugging Face model's layers"):
        parse_args(["--task", "reverse", "--gradient-checkpointing"])
    with pytest.raises(SettingsError, match="--digits 4 sets the digit tasks' numbers"):
        parse_args([*flags, "--digits", "4"])


def test_rewards_combine_with_weights_and_skip_none(tmp_path):
    path = _reward_file(
        tmp_path,
        "async def slow_half(prompts, completions, **kw):\n    return [0.5] * len(completions)\n"
        "def sometimes(prompts, completions, answer, **kw):\n    return [None if a is None else 1.0 for a in answer]\n",
    )
    rewards = RewardSet([f"{path}:slow_half=2", f"{path}:sometimes"])
    per = asyncio.run(rewards.score(["p", "q"], ["a", "b"], {"answer": ["x", None]}))
    assert torch.isnan(per[1, 1]) and rewards.combine(per).tolist() == [2.0, 1.0]
    assert rewards.combine(torch.tensor([[math.nan, 1.0], [math.nan, math.nan]])).isnan().tolist() == [True, False]
    assert rewards.means(per) == {"slow_half": 0.5, "sometimes": 1.0}


def test_async_rewards_scored_without_a_loop_run_on_one_loop_every_step(tiny, tmp_path):
    """The one-process run and a sharded trainer's evaluation score from code without an event loop: each call made
    a new loop (``asyncio.run``), so an async reward holding loop-bound state (a module-level semaphore, a cached
    HTTP client: an LLM judge's) failed from its second step. One loop per reward set serves every such call, as
    TRL's one reward loop does."""
    body = (
        "import asyncio\n"
        "LIMIT = None\n"
        "async def judged(prompts, completions, **kw):\n"
        "    global LIMIT\n"
        "    LIMIT = LIMIT or asyncio.Semaphore(1)\n"
        "    async def one(c):\n"
        "        async with LIMIT:\n"
        "            await asyncio.sleep(0)\n"
        "            return 1.0\n"
        "    return list(await asyncio.gather(*(one(c) for c in completions)))\n"
    )
    path = _reward_file(tmp_path, body)
    task = HFTask(resolve(_config(tiny, tmp_path, prompts=2, group=2, eval_size=2, rewards=[f"{path}:judged"])))
    policy = task.build_policy()
    for ticket in range(2):
        batch = task.sample(policy, torch.Generator().manual_seed(ticket), ticket=ticket)
        assert task.score(None, batch).rewards.tolist() == [1.0] * 4
    for _ in range(2):
        assert task.evaluate(policy)["reward"] == 1.0
    rewards = task.rewards
    rewards.close()
    rewards.close()  # (twice: nothing left to close)


def test_an_evaluation_names_its_step_to_reward_functions_and_in_its_logged_completions(tiny, tmp_path):
    """TRL's reward functions read ``trainer_state.global_step`` at an evaluation too (a curriculum's schedule):
    it was -1 here at every evaluation. The trainer's evaluation after 7 updates says 7, and each
    ``completions.jsonl`` row names it (a resumed run drops the rows past its checkpoint by it)."""
    body = "def step(completions, trainer_state, **kw):\n    return [float(trainer_state.global_step)] * len(completions)\n"
    path = _reward_file(tmp_path, body)
    task = HFTask(resolve(_config(tiny, tmp_path, eval_size=2, log_completions=1, rewards=[f"{path}:step"])))
    policy = task.build_policy()
    assert task.evaluate_at(policy, 7)["reward"] == 7.0
    assert asyncio.run(task.evaluate_at_async(policy, 8))["reward"] == 8.0
    assert task.evaluate(policy)["reward"] == -1.0, "a direct call names no step"
    logged = [json.loads(line)["step"] for line in open(tmp_path / "completions.jsonl")]
    assert logged == [7, 8, -1]


def test_rewards_log_metrics_and_completion_columns_as_trl_passes_them(tiny, tmp_path):
    """TRL (1.0 on) passes every reward function ``log_metric(name, value)``, a scalar averaged over the batch and
    logged under its name, and ``log_extra(column, values)``, a column of the completions table: before, neither
    was passed, and a function that read ``kwargs["log_metric"]`` or named it failed the run."""
    import datasets

    body = (
        "def named(completions, log_metric, log_extra, **kw):\n"
        "    log_metric('judge/len', sum(len(c) for c in completions) / len(completions))\n"
        "    log_extra('why', ['because'] * len(completions))\n"
        "    return [1.0] * len(completions)\n"
        "async def by_kwargs(completions, **kw):\n"
        "    kw['log_metric']('judge/len', 3.0)\n"
        "    kw['log_metric']('judge/nan', float('nan'))\n"
        "    return [0.0] * len(completions)\n"
        "def wrong_value(completions, log_metric, **kw):\n"
        "    log_metric('x', 'high')\n"
        "    return [0.0] * len(completions)\n"
        "def short_column(completions, log_extra, **kw):\n"
        "    log_extra('why', ['one'])\n"
        "    return [0.0] * len(completions)\n"
    )
    path = _reward_file(tmp_path, body)
    log = RewardLog()
    rewards = RewardSet([f"{path}:named", f"{path}:by_kwargs"])
    per = asyncio.run(rewards.score(["p", "q"], ["a", "bcd"], {}, log=log))
    assert per.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    metrics = log.metrics()
    assert metrics["judge/len"] == 2.5 and math.isnan(metrics["judge/nan"]), "a batch's mean (NaN left out)"
    assert log.columns(2) == {"why": ["because", "because"]}
    with pytest.raises(ValueError, match=r"log_extra\('why', ...\) was given 2 values for 3 completions"):
        log.columns(3)
    with pytest.raises(RewardError, match=r"wrong_value .* raised ValueError: log_metric\('x', ...\): the value is a"):
        asyncio.run(RewardSet([f"{path}:wrong_value"]).score(["p"], ["a"], {}))
    task = HFTask(resolve(_config(tiny, tmp_path, eval_size=4, rewards=[f"{path}:named"])))
    policy = task.build_policy()
    batch = task.sample(policy, torch.Generator().manual_seed(0), ticket=0)
    assert set(task.score(None, batch).metrics or {}) == {"judge/len"}, "a rollout's, for the step's report"
    assert "judge/len" in task.evaluate(policy)
    logged = [json.loads(line) for line in open(tmp_path / "completions.jsonl")]
    assert logged[0]["extra"] == {"why": "because"}
    short = HFTask(resolve(_config(tiny, tmp_path, eval_size=4, rewards=[f"{path}:short_column"])))
    with pytest.raises(RewardError, match=r"a reward function's log_extra\('why', ...\) was given 1 values for 4"):
        short.evaluate(policy)
    with pytest.raises(DataError, match="column 'log_metric' has the name of a reward function's own argument"):
        PromptData(datasets.Dataset.from_list([{"prompt": "a", "log_metric": 1}]), "prompt", task.tokenizer)


def test_a_reward_that_sets_a_signal_handler_fails_saying_why_and_what_to_do(tmp_path):
    """math_verify's default timeouts set SIGALRM, which only the main thread may: the error says that a synchronous
    reward runs in a worker thread and how math_verify is called there."""
    body = (
        "import signal\n"
        "def timed(completions, **kw):\n"
        "    signal.signal(signal.SIGALRM, lambda *a: None)\n"
        "    return [1.0] * len(completions)\n"
    )
    path = _reward_file(tmp_path, body)
    with pytest.raises(RewardError, match=r"signal only works in main thread.*runs in a worker thread.*=None"):
        asyncio.run(RewardSet([f"{path}:timed"]).score(["p"], ["a"], {}))


async def test_a_reward_sets_own_loop_closes_even_on_a_thread_that_runs_another(tmp_path):
    """Closed (or collected) on a thread whose event loop runs, the loop ``run_blocking`` keeps cannot be run to
    finish its tasks there: they are cancelled and it is closed, not left open with a traceback."""
    path = _reward_file(tmp_path, "async def one(completions, **kw):\n    return [1.0] * len(completions)\n")
    rewards = RewardSet([f"{path}:one"])
    scored = await asyncio.to_thread(lambda: rewards.run_blocking(rewards.score(["p"], ["a"], {})))
    assert scored.tolist() == [[1.0]]
    kept = rewards._blocking._loop
    assert kept is not None and not kept.is_closed()
    rewards.close()
    assert kept.is_closed() and rewards._blocking._loop is None


def test_a_gdpo_task_trains_on_the_decoupled_sum_and_reports_the_plain_one(tiny, tmp_path):
    # rewards that vary within every group whatever the completions: one widely, one narrowly
    body = (
        "def wide(prompts, completions, **kw):\n    return [float(i % 3) for i in range(len(completions))]\n"
        "def narrow(prompts, completions, **kw):\n    return [0.01 * (i % 2) for i in range(len(completions))]\n"
    )
    path = _reward_file(tmp_path, body)
    settings = dict(prompts=4, group=4, rewards=[f"{path}:wide", f"{path}:narrow=0.5"])
    config = _config(tiny, tmp_path, **settings)
    gdpo = HFTask(resolve(_config(tiny, tmp_path, **settings, multi_objective_aggregation="normalize_then_sum")))
    batch = gdpo.sample(gdpo.build_policy(), torch.Generator().manual_seed(0), ticket=0)
    plain, decoupled = HFTask(resolve(config)).score(None, batch), gdpo.score(None, batch)
    assert plain.total is None and decoupled.total is not None
    assert torch.equal(decoupled.total, plain.rewards), "the weighted sum of the rewards themselves"
    assert not torch.allclose(decoupled.rewards, plain.rewards), "the signal is the normalised sum"
    assert decoupled.rewards.view(4, 4).mean(1).abs().max() < 1e-5, "each group's normalised sum has mean 0"


def test_under_gdpo_the_groups_that_teach_nothing_are_those_whose_signal_is_flat(tmp_path):
    """Anti-correlated reward functions (weights 1 and 2) sum to a flat total while GDPO's normalised signal, which
    the advantages come from, is not: the share of groups that teach nothing is the signal's (it was the total's,
    100 %, while every advantage was ±1)."""
    from pipeline.algorithm import group_advantages, group_spread

    zero = "(prompts, completions, **kw):\n    return [0.0] * len(completions)\n"
    path = _reward_file(tmp_path, f"def r{zero}def s{zero}")
    rewards = RewardSet([f"{path}:r", f"{path}:s=2"])
    first = torch.tensor([1.0, 0.0, 1.0, 0.0])
    per = torch.stack([first, (2 - first) / 2])
    total, signal = rewards.combine(per), rewards.combine_decoupled(per, 4)
    assert total.tolist() == [2.0] * 4 and group_advantages(signal, 4, "batch").abs().min() > 0.9
    assert group_spread(total, 4) == (0.0, 1.0)  # the total alone says: nothing to learn
    assert group_spread(total, 4, signal) == (0.0, 0.0)


def test_gdpo_normalises_each_reward_within_its_group_before_the_weighted_sum(tmp_path):
    zero = "(prompts, completions, **kw):\n    return [0.0] * len(completions)\n"
    path = _reward_file(tmp_path, f"def r{zero}def s{zero}")
    rewards = RewardSet([f"{path}:r=2", f"{path}:s"])
    # two functions x two groups of 3; function 0 varies a lot, function 1 a little; a None in group 2 of function 1
    per = torch.tensor([[0.0, 10.0, 20.0, 5.0, 5.0, 5.0], [0.0, 0.1, 0.2, 1.0, float("nan"), 0.0]])
    z, one = 10 / (10 * math.sqrt(2 / 3) + 1e-4), 1 / (1 + 1e-4)  # (x - mean) / (population std + 1e-4)
    z_small = 0.1 / (0.1 * math.sqrt(2 / 3) + 1e-4)
    expected = [2 * -z - z_small, 0.0, 2 * z + z_small, 2 * 0 + one, 0.0, 2 * 0 - one]  # group 2: +-1 from function 1
    assert rewards.combine_decoupled(per, 3).tolist() == pytest.approx(expected, abs=1e-4)
    plain = rewards.combine(per)
    assert plain.tolist() == pytest.approx([0.0, 20.1, 40.2, 11.0, 10.0, 10.0]), "summed first, function 0 decides"


def test_a_reward_function_named_as_a_reward_statistic_is_refused(tmp_path):
    """Each reward function is logged as ``reward/<name>``: one named ``mean`` (or ``std``, ``group_std``,
    ``frac_zero_std``) overwrote the pipeline's own ``reward/mean`` in every row without a word."""
    zero = "(prompts, completions, **kw):\n    return [0.0] * len(completions)\n"
    path = _reward_file(tmp_path, f"def mean{zero}def ok{zero}")
    with pytest.raises(RewardError, match=r"named 'mean'.*reward/mean.*the pipeline logs itself"):
        RewardSet([f"{path}:ok", f"{path}:mean"])


@pytest.mark.parametrize(
    "body, spec, message",
    [
        ("def f(x):\n    return []\n", "f", r"TRL calls a reward function by keyword.*takes \(x\)"),
        ("def f(completions, /, **kw):\n    return []\n", "f", "TRL calls a reward function by keyword"),
        ("raise ImportError('no numpy here')\n", "f", "importing"),
        ("", "f", "has no 'f'"),
    ],
)
def test_a_reward_that_cannot_load_names_itself(tmp_path, body, spec, message):
    path = _reward_file(tmp_path, body)
    with pytest.raises(RewardError, match=message):
        load_reward(f"{path}:{spec}")


@pytest.mark.parametrize(
    "body, message",
    [
        (
            "def r(prompts, completions, **kw):\n    raise ValueError('bad row')\n",
            r"r \(.*\) raised ValueError: bad row",
        ),
        ("def r(prompts, completions, **kw):\n    return [1.0]\n", "returned 1 values for 2 completions"),
        ("def r(prompts, completions, **kw):\n    return ['x', 'y']\n", "returned a str among its rewards"),
        ("import asyncio\nasync def r(prompts, completions, **kw):\n    await asyncio.Event().wait()\n", "longer than"),
    ],
)
def test_a_reward_that_fails_while_scoring_names_itself(tmp_path, body, message):
    rewards = RewardSet([f"{_reward_file(tmp_path, body)}:r"], timeout=0.5)
    with pytest.raises(RewardError, match=message):
        asyncio.run(rewards.score(["p", "q"], ["a", "b"], {}))


def _sequence_classifier(tiny, folder, labels: int = 1) -> str:  # type: ignore[no-untyped-def]
    """A random Qwen2 sequence classifier with the tiny model's tokenizer (and chat template): a reward model."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny / "model"))
    config = tiny_qwen2(len(tokenizer), num_labels=labels, pad_token_id=tokenizer.pad_token_id).config
    transformers.Qwen2ForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def judge(tiny, tmp_path_factory):  # type: ignore[no-untyped-def]
    return _sequence_classifier(tiny, tmp_path_factory.mktemp("reward-models") / "judge")


def test_a_reward_model_scores_prompt_and_completion_together_whatever_its_batch(judge):
    """40 completions of several lengths (two batches, right-padded): each reward is the model's logit for its
    text alone; chat prompts are rendered with the reward model's template, the completion as the assistant's."""
    import transformers

    reward = load_reward(f"{judge}=0.5")
    assert (reward.name, reward.weight) == ("judge", 0.5)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(judge).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(judge)

    def alone(text: str) -> float:
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            return float(model(**ids).logits[0, 0])

    prompts = [f"reverse:{n}=" for n in range(40)]
    completions = ["9" * (n % 7) + "<eos>" * (n % 2) for n in range(40)]
    got = reward.function(prompts, completions, answer=["1"] * 40)
    assert got == pytest.approx([alone(p + c) for p, c in zip(prompts, completions, strict=True)], abs=1e-5)
    assert len(set(got)) > 5, "the rewards differ with the text"
    chat = [[{"role": "user", "content": p}] for p in prompts[:3]]
    turns = [[{"role": "assistant", "content": c}] for c in completions[:3]]
    rendered = [tokenizer.apply_chat_template(p + t, tokenize=False) for p, t in zip(chat, turns, strict=True)]
    assert rendered[0] == "u:reverse:0=<eos>a:<eos>"
    assert reward.function(chat, turns) == pytest.approx([alone(text) for text in rendered], abs=1e-5)


def test_a_reward_model_scores_without_building_a_kv_cache(judge):
    """A decoder reward model's config asks for a KV cache (Llama's and Qwen's ``use_cache``): scoring built one
    for every batch and held it until the batch's logits were read, never to read it (8 GiB for 32 rows of 2,048
    tokens of an 8B model, on the scorer's GPU)."""
    reward = load_reward(judge)
    model = reward.function.load()
    assert model.config.use_cache, "the checkpoint asks for a cache"
    caches: list[object] = []
    hook = model.register_forward_hook(lambda module, args, out: caches.append(out.past_key_values))
    try:
        assert len(reward.function(["reverse:1=", "reverse:22="], ["1", "22"])) == 2
    finally:
        hook.remove()
    assert caches == [None]


def test_a_reward_model_renders_chat_with_the_runs_template_variables(tiny, tmp_path):
    """``--chat-template-kwargs`` reach a reward model's template, as TRL renders its input (before: rendered
    without them: another text, or a template that needs one failed at the first batch, unchecked before)."""
    import transformers

    from pipeline.tasks import RewardPlacement

    folder = _sequence_classifier(tiny, tmp_path / "hinted-judge")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = HINTED_TEMPLATE + "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(folder)
    plain = load_reward(folder)
    with pytest.raises(RewardError, match="cannot render a conversation"):
        RewardSet([folder]).check_chat(True)
    hinted = load_reward(folder, RewardPlacement(chat_template_kwargs={"hint": "xyz"}))
    RewardSet([folder], placement=RewardPlacement(chat_template_kwargs={"hint": "xyz"})).check_chat(True)
    chat, turn = [{"role": "user", "content": "a"}], [{"role": "assistant", "content": "b"}]
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    ids = tokenizer("xyzab", return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        expected = float(model(**ids).logits[0, 0])
    assert hinted.function([chat], [turn]) == pytest.approx([expected], abs=1e-5)
    assert plain.name == hinted.name


def test_what_is_not_a_reward_model_is_refused_naming_it(tiny, tmp_path, monkeypatch):
    with pytest.raises(RewardError, match=r"not a reward model \(a sequence classifier with one label\); its "):
        load_reward(str(tiny / "model"))  # a causal LM: its classification head would be random
    two = _sequence_classifier(tiny, tmp_path / "two", labels=2)
    with pytest.raises(RewardError, match="a reward model has one output, its reward; this one has 2"):
        load_reward(two)
    with pytest.raises(RewardError, match=r"not a function, nor a reward model's folder or Hub name .* or a reward"):
        load_reward(str(tmp_path))  # a folder with no model in it
    untemplated = _sequence_classifier(tiny, tmp_path / "untemplated")
    os.remove(os.path.join(untemplated, "chat_template.jinja"))
    chat = HFTask(resolve(_config(tiny, tmp_path, dataset=str(tiny / "chat" / "train.jsonl"), rewards=[untemplated])))
    with pytest.raises(RewardError, match="the prompts are chat messages, but its tokenizer has no chat template"):
        chat.check()  # before the run, not at the scorer's first batch
    HFTask(resolve(_config(tiny, tmp_path, rewards=[untemplated]))).check()  # text prompts need no template
    with pytest.raises(RewardError, match=r"--reward exact_matc: no built-in of that name \(exact_match, "):
        load_reward("exact_matc")  # a misspelt built-in is not looked up on the Hub
    import transformers
    from tokenizers import Tokenizer, models

    core = Tokenizer(models.WordLevel({"a": 0, "b": 1, "?": 2}, unk_token="?"))
    bare = transformers.PreTrainedTokenizerFast(tokenizer_object=core)  # no pad token, no end token
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: bare)
    with pytest.raises(RewardError, match="its tokenizer has neither a pad nor an end-of-sequence token"):
        load_reward(_sequence_classifier(tiny, tmp_path / "one"))


def test_reward_functions_are_called_by_keyword_as_trl_calls_them(tmp_path):
    """TRL calls ``f(prompts=, completions=, completion_ids=, trainer_state=, **columns)``: a function taking only
    some of them (``completions`` alone, ``completion_ids``), in any order, gets what it names (before: only
    ``(prompts, completions, ...)`` loaded, passed by position, so ``(completions, prompts)`` scored the prompts,
    and ``completion_ids``/``trainer_state`` were never passed)."""
    from pipeline.tasks import RewardState

    path = _reward_file(
        tmp_path,
        "def only(completions, **kw):\n    return [float(c == 'A') for c in completions]\n"
        "def ids(completion_ids, **kw):\n    return [float(len(i)) for i in completion_ids]\n"
        "def swapped(completions, prompts, answer):\n    return [float(c == a) for c, a in zip(completions, answer)]\n"
        "def step(completions, trainer_state, **kw):\n    return [float(trainer_state.global_step)] * len(completions)\n"
        "def epoch(completions, trainer_state, **kw):\n"
        "    s = trainer_state\n"
        "    assert s.is_world_process_zero and s.is_local_process_zero\n"
        "    return [s.epoch / s.num_train_epochs] * len(completions)\n",
    )
    rewards = RewardSet([f"{path}:only", f"{path}:ids", f"{path}:swapped", f"{path}:step", f"{path}:epoch"])
    state = RewardState.at(7, 10, 8, 40)  # 8 of 40 rows a step: step 7 is 1.4 epochs in, of 2
    assert (state.epoch, state.num_train_epochs) == (pytest.approx(1.4), pytest.approx(2.0))
    per = asyncio.run(rewards.score(["p"], ["A"], {"answer": ["A"]}, completion_ids=[[5, 6]], state=state))
    assert per[:, 0].tolist() == pytest.approx([1.0, 2.0, 1.0, 7.0, 0.7])


def test_rewards_may_come_as_tensors_arrays_and_numpy_or_torch_scalars(tmp_path):
    path = _reward_file(
        tmp_path,
        "import numpy as np, torch\n"
        "def t(completions, **kw):\n    return torch.tensor([1.0, 2.0])\n"
        "def z(completions, **kw):\n    return [torch.tensor(1.0), None]\n"
        "def b(completions, **kw):\n    return np.array([True, False])\n",
    )
    per = asyncio.run(RewardSet([f"{path}:t", f"{path}:z", f"{path}:b"]).score(["p", "q"], ["a", "b"], {}))
    assert per[0].tolist() == [1.0, 2.0] and per[1, 0] == 1.0 and per[1, 1].isnan() and per[2].tolist() == [1.0, 0.0]


def test_builtin_rewards():
    from pipeline.tasks import exact_match, final_number, think_answer_format

    assert exact_match([], [" 42 ", "41"], ["42", "42"]) == [1.0, 0.0]
    assert final_number([], ["so it is 1,234.", "it is 7"], ["work... #### 1234", "#### 8"]) == [1.0, 0.0]
    assert think_answer_format([], ["<think>hm</think> <answer>3</answer>", "3"]) == [1.0, 0.0]
    assert exact_match([], [[{"role": "assistant", "content": "x"}]], ["x"]) == [1.0]
    # a numeric column (datasets reads 42 as 42.0 where a cell is empty or another is 3.5): compared as numbers
    assert exact_match([], ["42", "7", "7.5", "x"], [42.0, 7.5, 7.5, 1.0]) == [1.0, 0.0, 1.0, 0.0]


# -- data ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet", "json"])
def test_datasets_load_from_each_file_kind(tmp_path, model_and_tokenizer, kind):
    import datasets

    rows = [{"prompt": f"reverse:{n}=", "answer": f"r{str(n)[::-1]}"} for n in (12, 345, 6789)]  # text in csv too
    table = datasets.Dataset.from_list(rows)
    path = str(tmp_path / f"data.{kind}")
    {"jsonl": table.to_json, "csv": table.to_csv, "parquet": table.to_parquet, "json": table.to_json}[kind](path)
    data = PromptData(load_rows(path), "prompt", model_and_tokenizer[1])
    assert len(data) == 3 and data.for_rewards([2], 1)[1] == {"answer": ["r9876"]}
    assert model_and_tokenizer[1].decode(data.prompt_ids(0)) == "reverse:12="


def test_chat_or_text_is_the_columns_type_and_a_prompt_that_is_neither_is_refused(tiny, model_and_tokenizer):
    """The first row alone decided: a chat column whose first cell is empty was taken for text, every conversation
    tokenized as its Python repr with no template; an empty text cell trained on the prompt "None"."""
    import datasets

    tokenizer = load_tokenizer(str(tiny / "model"))
    chat = datasets.Dataset.from_list([{"prompt": None}, {"prompt": [{"role": "user", "content": "12"}]}])
    data = PromptData(chat, "prompt", tokenizer)
    assert data.chat and tokenizer.decode(data.prompt_ids(1)).endswith("a:")
    with pytest.raises(DataError, match="row 0: its prompt is empty"):
        data.prompt_ids(0)
    text = PromptData(datasets.Dataset.from_list([{"prompt": "ab="}, {"prompt": None}]), "prompt", tokenizer)
    assert not text.chat
    with pytest.raises(DataError, match="row 1: its prompt is empty"):
        text.prompt_ids(1)
    mixed = PromptData(datasets.Dataset.from_list([{"prompt": "ab="}, {"prompt": "cd="}]), "prompt", tokenizer)
    mixed.rows = [{"prompt": "ab="}, {"prompt": {"role": "user"}}]  # (a row no datasets column would hold)
    with pytest.raises(DataError, match="row 1: its prompt is a dict, not text"):
        mixed.prompt_ids(1)


def test_a_prompt_too_long_for_a_learned_position_table_is_refused_naming_its_row(tiny, tmp_path):
    """A GPT-2 takes as many positions as its table has rows (here 128): a prompt whose completion would run past
    them made the generator's position lookup fail mid-run (an ``IndexError`` on a CPU, a device-side assert
    poisoning the process on a GPU). It is refused naming its row, its length and the limit. A rotary model (the
    tiny Qwen2) runs past its ``max_position_embeddings``, as transformers' ``generate`` lets it."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny / "model"))
    gpt2 = tmp_path / "gpt2"
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer), n_positions=128, n_embd=32, n_layer=1, n_head=2, pad_token_id=tokenizer.pad_token_id
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(gpt2)
    tokenizer.save_pretrained(gpt2)
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "reverse:12="}, {"prompt": "reverse:" + "1" * 200 + "="}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    task = HFTask(resolve(_config(tiny, tmp_path, model=str(gpt2), dataset=str(data), eval_dataset=str(data))))
    assert task.prompt_room is not None and task.prompt_room.positions == 128
    assert task.train_data.prompt_ids(0)
    with pytest.raises(
        DataError,
        match=r"row 1: its prompt is \d+ tokens, and with --max-new-tokens 6 the completion would run past the "
        r"model's 128 positions",
    ):
        task.train_data.prompt_ids(1)
    greedy = _config(tiny, tmp_path, model=str(gpt2), dataset=str(data), eval_dataset=str(data), max_new_tokens=128)
    with pytest.raises(DataError, match="--max-new-tokens 128 leaves no room for a prompt in the model's 128"):
        HFTask(resolve(greedy)).train_data.prompt_ids(0)
    rotary = HFTask(resolve(_config(tiny, tmp_path, dataset=str(data), eval_dataset=str(data), max_new_tokens=256)))
    assert rotary.prompt_room is None and len(rotary.train_data.prompt_ids(1)) > 128


def test_the_rewards_get_the_columns_trl_gives_and_a_column_named_as_an_argument_is_refused(model_and_tokenizer):
    """A ``completions`` column was silently replaced by the model's completions (TRL fails on it), and a
    ``completion`` or ``completion_ids`` column was passed on, where TRL leaves them out."""
    import datasets

    tokenizer = model_and_tokenizer[1]
    rows = datasets.Dataset.from_list([{"prompt": "2+2=", "completion": "4", "completion_ids": [1], "answer": "4"}])
    assert PromptData(rows, "prompt", tokenizer).for_rewards([0], 1)[1] == {"answer": ["4"]}
    for name in ("prompts", "completions", "trainer_state"):
        clashing = datasets.Dataset.from_list([{"prompt": "2+2=", name: "x"}])
        with pytest.raises(DataError, match=f"column {name!r} has the name of a reward function's own argument"):
            PromptData(clashing, "prompt", tokenizer)


def test_a_prompt_sets_token_cache_is_bounded_and_the_rewards_read_each_row_once(monkeypatch, model_and_tokenizer):
    """Every prompt ever tokenized was kept as a list of Python ints (~40 bytes a token: gigabytes per generator
    through a large dataset); and the rewards' prompts and columns read each row once per completion."""
    import datasets

    from pipeline.tasks import _data

    class Counted:
        """A dataset that counts its row reads."""

        def __init__(self, rows: object) -> None:
            self.rows, self.reads = rows, 0
            self.column_names, self.features = rows.column_names, rows.features

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, row: int) -> object:
            self.reads += 1
            return self.rows[row]

    monkeypatch.setattr(_data, "PROMPT_CACHE_ROWS", 2)
    table = Counted(datasets.Dataset.from_list([{"prompt": f"{n}+{n}=", "answer": str(2 * n)} for n in range(3)]))
    data = PromptData(table, "prompt", model_and_tokenizer[1])
    first = [data.prompt_ids(row) for row in range(3)]
    assert len(data._ids) == 2 and data.prompt_ids(0) == first[0], "the oldest let go, tokenized again alike"
    table.reads = 0
    prompts, columns = data.for_rewards([2, 0], 4)
    assert prompts == ["2+2="] * 4 + ["0+0="] * 4 and columns == {"answer": ["4"] * 4 + ["0"] * 4}
    assert table.reads == 2
    # a chat prompt (a list) and a column of lists: each completion's own objects, as TRL's repeated rows are (a
    # reward that extended one completion's conversation in place extended its siblings' too)
    chat = Counted(datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}], "cases": [1, 2]}]))
    prompts, columns = PromptData(chat, "prompt", model_and_tokenizer[1]).for_rewards([0], 2)
    prompts[0].append({"role": "assistant", "content": "hello"})
    columns["cases"][0].pop()
    assert prompts[1] == [{"role": "user", "content": "hi"}] and columns["cases"][1] == [1, 2]
    assert chat.reads == 1


def test_a_local_files_split_or_subset_is_refused_not_ignored(tmp_path, tiny):
    """A local file holds one split and is read whole: --dataset-split, --eval-split and --dataset-config were
    silently ignored for one."""
    for changes in ({"dataset_split": "validation"}, {"dataset_config": "main"}):
        with pytest.raises(DataError, match="is a local file, read whole"):
            _ = HFTask(resolve(_config(tiny, tmp_path, **changes))).train_data
    held = {"eval_dataset": str(tiny / "train.jsonl"), "eval_split": "validation"}
    with pytest.raises(DataError, match=r"--eval-dataset .* is a local file"):
        _ = HFTask(resolve(_config(tiny, tmp_path, **held))).train_data


def test_a_missing_prompt_column_and_a_missing_file_are_refused(tmp_path, tiny, model_and_tokenizer):
    with pytest.raises(DataError, match="no column 'question'"):
        PromptData(load_rows(str(tiny / "train.jsonl")), "question", model_and_tokenizer[1])
    with pytest.raises(DataError, match="no such file"):
        load_rows(str(tmp_path / "absent.jsonl"))


async def test_the_launcher_adds_the_tasks_role_modules_to_the_forkservers_preload(tiny, tmp_path):
    """Every role of an hf run imports transformers: the forkserver imports it once before it forks them (where it is
    a fresh interpreter; a fork of the launcher has it already), added to what the program asked for."""
    before = forkserver_preload()
    set_forkserver_preload(["json"])
    try:
        with pytest.raises(FileNotFoundError, match="no checkpoint"):  # the launcher stops before any process starts
            await run_pipeline(_config(tiny, tmp_path), resume=True)
        assert (
            forkserver_preload()
            == ("json", *HFTask.role_modules)
            == ("json", "transformers", "transformers.modeling_utils")
        )
    finally:
        set_forkserver_preload(before)


def test_loading_a_dataset_leaves_no_thread_behind_so_the_launcher_forks_its_roles(tiny):
    """datasets' progress bars, disabled or not, start tqdm's monitor thread, which never ends: a launcher that loaded
    its data with one left running could not fork its forkserver, and every role imported torch and transformers
    anew (a short run's start took 17 s instead of 8 on this machine)."""
    script = (
        "import sys, threading; from pipeline.tasks import load_rows; load_rows(sys.argv[1]); "
        "from actors._processes._forkserver import fork_refusal; "
        "print([t.name for t in threading.enumerate()], fork_refusal())"
    )
    out = run_python("-c", script, str(tiny / "train.jsonl"), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "['MainThread'] None"


def test_a_chat_prompt_ending_with_an_assistant_message_is_continued_as_trl_does(model_and_tokenizer):
    """A prefill (the prompt's last message an assistant's: "<think>") was closed and a new assistant turn opened
    after it, and the reward functions got it in the prompt and a completion without it. As TRL does, it is
    continued (``continue_final_message``), and the reward functions get the prompt without it and a completion
    that begins with it; the dataset's rows are left as they are."""
    import datasets

    tokenizer = model_and_tokenizer[1]
    messages = [{"role": "user", "content": "12"}, {"role": "assistant", "content": "2"}]
    rows = datasets.Dataset.from_list([{"prompt": messages, "answer": "21"}])
    data = PromptData(rows, "prompt", tokenizer)
    want = tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "input_ids") else want
    assert data.prompt_ids(0) == [int(token) for token in want]
    assert tokenizer.decode(data.prompt_ids(0)).endswith("a:2")
    prompts, columns = data.for_rewards([0], 2)
    assert prompts == [[{"role": "user", "content": "12"}]] * 2 and columns == {"answer": ["21", "21"]}
    assert data.completions([0], 2, ["1", "x"]) == [
        [{"role": "assistant", "content": "21"}],
        [{"role": "assistant", "content": "2x"}],
    ]
    assert rows[0]["prompt"][-1] == {"role": "assistant", "content": "2"}


def test_a_text_prompt_is_tokenized_without_special_tokens_as_trl_does(model_and_tokenizer):
    """Text prompts were tokenized with the tokenizer's special tokens: with one that adds a BOS (Llama's, Gemma's)
    every prompt began with one that TRL's run of the same data does not have (TRL passes
    ``add_special_tokens=False``; a chat template writes its BOS into the text)."""
    import copy

    import datasets
    from tokenizers.processors import TemplateProcessing

    tokenizer = copy.deepcopy(model_and_tokenizer[1])
    bos = tokenizer.eos_token  # (a special token the tiny vocabulary has, standing in for a BOS)
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.convert_tokens_to_ids(bos))]
    )
    assert tokenizer("12")["input_ids"][0] == tokenizer.convert_tokens_to_ids(bos)  # (it adds one)
    data = PromptData(datasets.Dataset.from_list([{"prompt": "12", "answer": "21"}]), "prompt", tokenizer)
    assert data.prompt_ids(0) == tokenizer("12", add_special_tokens=False)["input_ids"]


def test_chat_prompts_render_with_the_template_and_rows_follow_the_ticket(tiny, model_and_tokenizer):
    tokenizer = model_and_tokenizer[1]
    data = PromptData(load_rows(str(tiny / "chat" / "train.jsonl")), "prompt", tokenizer)
    assert data.chat and tokenizer.decode(data.prompt_ids(0)).endswith("<eos>a:")
    assert data.completions([0], 1, ["12"]) == [[{"role": "assistant", "content": "12"}]]
    first = [data.rows_for(t, 8, seed=0) for t in range(7)]  # 56 samples: past one epoch of 50
    assert first == [data.rows_for(t, 8, seed=0) for t in range(7)]
    assert sorted([row for rows in first for row in rows][:50]) == list(range(50))  # each epoch visits every row once
    tokenizer_without = load_tokenizer(str(tiny / "model"))
    tokenizer_without.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        PromptData(load_rows(str(tiny / "chat" / "train.jsonl")), "prompt", tokenizer_without)


def test_without_shuffling_rollouts_take_the_rows_in_the_datasets_order_epoch_after_epoch(tmp_path, tiny):
    task = HFTask(resolve(_config(tiny, tmp_path, shuffle_dataset=False, prompts=8)))
    data = task.train_data
    taken = [row for ticket in range(30) for row in data.rows_for(ticket, 8, seed=0, shuffle=False)]
    count = len(data)
    assert taken == [data.indices[i % count] for i in range(240)] and data.indices == sorted(data.indices)
    batch = task.sample(task.build_policy().eval(), torch.Generator().manual_seed(0), ticket=2)
    assert batch.rows.tolist() == data.indices[16:24], "the task's rollouts follow --no-shuffle-dataset"
    assert data.rows_for(2, 8, seed=0) != data.indices[16:24], "shuffled by default"


def test_an_eval_dataset_is_held_out_whole_and_a_hub_one_is_read_from_its_eval_split(tmp_path, tiny, monkeypatch):
    """``--eval-dataset`` is evaluated on, never trained on; a Hub one is read from ``--eval-split`` (TRL's test
    split by default), not from the training split ``--dataset-split`` names (before: the training split)."""
    from pipeline.tasks import _hf

    chat = str(tiny / "chat" / "train.jsonl")
    task = HFTask(resolve(_config(tiny, tmp_path, eval_dataset=chat)))
    assert len(task.eval_data) == 50 and task.eval_data.chat, "the whole file, as held-out prompts"
    assert len(task.train_data) == 200, "--dataset is trained on whole: nothing held out of it"
    loaded: list[tuple[str, str]] = []
    real = _hf.load_rows

    def recorded(source: str, split: str = "train", flag: str = "--dataset", subset: str = "") -> object:
        loaded.append((source, split))
        return real(chat if source == "org/prompts" else source, split, flag, subset)

    monkeypatch.setattr(_hf, "load_rows", recorded)
    for settings, split in (({}, "test"), ({"eval_split": "validation"}, "validation")):
        loaded.clear()
        assert len(HFTask(resolve(_config(tiny, tmp_path, eval_dataset="org/prompts", **settings))).eval_data) == 50
        assert loaded[-1] == ("org/prompts", split)


def test_an_eval_datasets_subset_is_its_own_and_dataset_config_reaches_only_the_same_dataset(
    tmp_path, tiny, monkeypatch
):
    """``--dataset-config`` is ``--dataset``'s subset: a different Hub ``--eval-dataset`` has its own
    (``--eval-dataset-config``; before, it got ``--dataset``'s, a subset it may not have), and the same
    dataset's test split keeps it (gsm8k main's train and test)."""
    from pipeline.tasks import _hf

    files = {"org/data": str(tiny / "train.jsonl"), "org/prompts": str(tiny / "chat" / "train.jsonl")}
    loaded: list[tuple[str, str, str]] = []
    real = _hf.load_rows

    def recorded(source: str, split: str = "train", flag: str = "--dataset", subset: str = "") -> object:
        loaded.append((source, split, subset))
        return real(files.get(source, source), split, flag)

    monkeypatch.setattr(_hf, "load_rows", recorded)
    hub = {"dataset": "org/data", "dataset_config": "main"}
    for held, subset in (
        ({"eval_dataset": "org/prompts"}, ""),
        ({"eval_dataset": "org/data"}, "main"),
        ({"eval_dataset": "org/prompts", "eval_dataset_config": "easy"}, "easy"),
    ):
        loaded.clear()
        _ = HFTask(resolve(_config(tiny, tmp_path, **hub, **held))).eval_data
        assert loaded == [("org/data", "train", "main"), (held["eval_dataset"], "test", subset)]
    with pytest.raises(DataError, match=r"--eval-dataset .* is a local file"):
        _ = HFTask(resolve(_config(tiny, tmp_path, eval_dataset=files["org/data"], eval_dataset_config="x"))).eval_data


def test_a_local_folder_of_data_files_is_a_dataset_whose_splits_are_its_files(tmp_path, tiny):
    """A folder (a Hub dataset downloaded, parquet shards) loads as ``datasets`` loads one: its files' names give the
    splits (before: refused as a file of no known type)."""
    import datasets

    folder = tmp_path / "prompts"
    folder.mkdir()
    rows = [json.loads(line) for line in (tiny / "train.jsonl").read_text().splitlines()]
    for split, part in (("train", rows[:150]), ("test", rows[150:])):
        datasets.Dataset.from_list(part).to_parquet(str(folder / f"{split}-00000-of-00001.parquet"))
    assert len(load_rows(str(folder))) == 150 and len(load_rows(str(folder), "test")) == len(rows) - 150
    with pytest.raises(DataError, match=r"--dataset .*prompts: cannot be loaded \(Unknown split"):
        load_rows(str(folder), "validation")
    task = HFTask(resolve(_config(tiny, tmp_path, dataset=str(folder), eval_dataset=str(folder))))
    assert (len(task.train_data), len(task.eval_data)) == (150, len(rows) - 150)


def test_a_downloaded_dataset_whose_card_declares_subsets_loads_the_one_named(tmp_path, tiny):
    """A Hub dataset with several subsets downloaded (``huggingface-cli download openai/gsm8k``): its card names
    them, with no default, so ``datasets`` needs one; ``--dataset-config`` was refused for a folder, and nothing
    could load it. The subset named is loaded, and none names what is missing."""
    import datasets

    folder = tmp_path / "snapshot"
    rows = [json.loads(line) for line in (tiny / "train.jsonl").read_text().splitlines()]
    for subset, part in (("main", rows[:100]), ("socratic", rows[100:130])):
        (folder / subset).mkdir(parents=True)
        datasets.Dataset.from_list(part).to_parquet(str(folder / subset / "train-00000-of-00001.parquet"))
    card = ["---", "configs:"]
    for subset in ("main", "socratic"):
        card += [f"- config_name: {subset}", "  data_files:", "  - split: train", f"    path: {subset}/train-*"]
    (folder / "README.md").write_text("\n".join([*card, "---", ""]))
    assert len(load_rows(str(folder), subset="socratic")) == 30
    task = HFTask(resolve(_config(tiny, tmp_path, dataset=str(folder), dataset_config="main")))
    assert len(task.train_data) + len(task.eval_data) == 100
    with pytest.raises(DataError, match=r"--dataset .*snapshot: cannot be loaded \(.*[Cc]onfig"):
        load_rows(str(folder))


def test_chat_template_kwargs_reach_the_template_and_a_failing_template_is_a_data_error(tiny, own_code):
    rows = load_rows(str(tiny / "chat" / "train.jsonl"))
    tokenizer = load_tokenizer(str(own_code))
    hinted = PromptData(rows, "prompt", tokenizer, chat_template_kwargs={"hint": "xyz"})
    plain = PromptData(rows, "prompt", load_tokenizer(str(tiny / "model")))
    assert tokenizer.decode(hinted.prompt_ids(0)) == "xyz" + tokenizer.decode(plain.prompt_ids(0))
    with pytest.raises(DataError, match=r"row 0: the chat template failed: TemplateError: the template needs hint"):
        PromptData(rows, "prompt", tokenizer).prompt_ids(0)
    text = load_rows(str(tiny / "train.jsonl"))
    with pytest.raises(DataError, match="--chat-template-kwargs sets the chat template's variables, but column"):
        PromptData(text, "prompt", tokenizer, chat_template_kwargs={"hint": "xyz"})


def test_a_model_with_its_own_code_loads_only_when_trusted(own_code):
    from pipeline.models import ModelError, check_model

    for load in (check_model, load_model):
        with pytest.raises(ModelError, match=r"brings code of its own .* runs only with --trust-remote-code"):
            load(str(own_code))  # type: ignore[operator]
    model = load_model(str(own_code), trust_remote_code=True)
    assert type(model).__name__ == "HintedForCausalLM" and model.config.model_type == "hinted_qwen2"
    broken = own_code.parent / "broken"
    import shutil

    shutil.copytree(own_code, broken)
    (broken / "modeling_hinted.py").write_text("raise RuntimeError('half-written')\n")
    with pytest.raises(ModelError, match=r"its own code \(modeling_hinted.HintedForCausalLM\) cannot be imported"):
        check_model(str(broken), trust_remote_code=True)


# -- the launcher refuses what it cannot use --------------------------------------------------------------------


def _encoder_only(folder) -> str:  # type: ignore[no-untyped-def]
    import transformers

    transformers.DistilBertConfig(vocab_size=50, dim=16, n_layers=1, n_heads=2, hidden_dim=32).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize(
    "case, message",
    [
        ("not_causal", "a 'distilbert' model is not a causal language model"),
        ("no_column", "no column 'question'"),
        ("bad_reward", "has no 'nope'"),
        ("no_reward", "--dataset needs at least one --reward"),
        ("no_template", "no chat template"),
        ("preset_with_data", None),
        ("hf_without_data", "--task hf trains on your prompts: add --dataset"),
        ("own_code", "runs only with --trust-remote-code"),
        ("causal_lm_as_reward", "not a reward model (a sequence classifier with one label); its architectures"),
        ("lora_target", "--lora-target-modules q_proj,nope: nope names no layer of the model"),
    ],
)
def test_bad_model_data_or_reward_is_one_line_and_exit_2(tmp_path, tiny, own_code, capsys, case, message):
    model, data, reward = str(tiny / "model"), str(tiny / "train.jsonl"), f"{tiny / 'rewards.py'}:reversed_digits"
    extra: list[str] = []
    if case == "not_causal":
        model = _encoder_only(tmp_path / "distilbert")
    elif case == "no_column":
        extra = ["--prompt-column", "question"]
    elif case == "bad_reward":
        reward = f"{tiny / 'rewards.py'}:nope"
    elif case == "causal_lm_as_reward":
        reward = model
    elif case == "lora_target":
        extra = ["--lora-r", "4", "--lora-target-modules", "q_proj,nope"]
    elif case == "no_template":
        import shutil

        model = str(tmp_path / "plain")
        shutil.copytree(tiny / "model", model)
        os.remove(os.path.join(model, "chat_template.jinja"))
        data = str(tiny / "chat" / "train.jsonl")
    run_dir = tmp_path / "run"
    flags = ["--model", model, "--dataset", data, *([] if case == "no_reward" else ["--reward", reward]), *extra]
    if case == "preset_with_data":
        flags = ["--model", model]  # an HF model without a dataset
        message = "the built-in tasks train a preset"
    elif case == "hf_without_data":
        flags = ["--task", "hf", "--model", model, "--reward", reward]
    elif case == "own_code":
        flags = ["--model", str(own_code), "--dataset", data, "--reward", reward]
    code = main([*flags, "--run-dir", str(run_dir), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and message in err, err
    assert err.count("\n") == 1 and not run_dir.exists()


# -- the pipeline ----------------------------------------------------------------------------------------------


def _config(tiny, run_dir, **changes) -> Config:  # type: ignore[no-untyped-def]
    values = dict(
        task="hf",
        model=str(tiny / "model"),
        dataset=str(tiny / "train.jsonl"),
        rewards=[f"{tiny / 'rewards.py'}:reversed_digits", "exact_match=0.5"],
        lr=1e-3,
        prompts=8,
        group=4,
        max_new_tokens=6,
        steps=6,
        eval_every=3,
        eval_size=16,
        log_completions=2,
        run_dir=str(run_dir),
    )
    values.update(changes)
    return Config(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize("ranks", [1, 2], ids=["one-trainer", "two-sharded-ranks"])
async def test_a_hf_model_trains_in_the_pipeline_and_saves_what_transformers_loads(
    tmp_path, tiny, own_code, judge, sockets_dir, ranks
):
    """Also on two FSDP2 ranks: the generator gets whole weights, evaluation and the export see the whole policy.
    The two-rank run combines its rewards as GDPO does (either way reward/mean is the rewards' weighted sum) and
    evaluates two samples of each held-out prompt: both ranks draw the same ones, or their shards' collectives
    would part ways.
    The one-trainer run's model brings its own code and a chat template that fails without its variable: every
    role loads the code (--trust-remote-code) and renders chat prompts with --chat-template-kwargs, and the
    exported folder carries the code; a reward model scores beside the functions, in the scorer and the trainer."""
    import transformers

    aggregation = "normalize_then_sum" if ranks == 2 else "sum_then_normalize"
    model = own_code if ranks == 1 else tiny / "model"
    own = dict(model=str(own_code), trust_remote_code=True, chat_template_kwargs={"hint": "q"})
    functions = _config(tiny, tmp_path).rewards
    if ranks == 1:
        own.update(dataset=str(tiny / "chat" / "train.jsonl"), rewards=[*functions, f"{judge}=0.25"])
    else:
        own = {"num_generations_eval": 2}
    config = _config(tiny, tmp_path, kl_coeff=0.02, trainer_ranks=ranks, multi_objective_aggregation=aggregation, **own)
    result = await run_pipeline(config, quiet=True)
    spread = {"reward_std", "frac_reward_zero_std"} if ranks == 2 else {"reward/judge"}
    assert result.steps == 6
    exact = "reversed_digits/exact"  # the example's reward logs it, TRL's log_metric
    assert set(result.evaluation) == {"reward", "reward/reversed_digits", "reward/exact_match", exact, *spread}
    rows = read_rows(str(tmp_path))
    assert all("reward/reversed_digits" in row and "reward/exact_match" in row for row in rows)
    assert all(0 <= row[exact] <= 1 for row in rows) and f"eval/{exact}" in rows[2], "logged by the reward, each step"
    for row in rows:  # weights 1, 0.5 (and 0.25); GDPO trains on its normalised sum, but logs the rewards themselves
        total = row["reward/reversed_digits"] + 0.5 * row["reward/exact_match"] + 0.25 * row.get("reward/judge", 0)
        assert row["reward/mean"] == pytest.approx(total, abs=1e-5), row
    assert ("reward/judge" in rows[0]) == (ranks == 1)
    logged = [json.loads(line) for line in open(tmp_path / "completions.jsonl")]
    names = {"reversed_digits", "exact_match"} | ({"judge"} if ranks == 1 else set())
    assert len(logged) == 4 and set(logged[0]["rewards"]) == names, "rank 0 logs them"
    assert all(set(row["extra"]) == {"expected"} for row in logged), "with the reward's log_extra column"
    assert all(f"eval/{name}" in rows[2] for name in spread), rows[2]
    # the exported folder gives the checkpoint's logits (a sharded one's read whole by one learner)
    saved = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"), trust_remote_code=True).eval()
    assert type(saved).__name__ == ("HintedForCausalLM" if ranks == 1 else "Qwen2ForCausalLM")
    task = HFTask(resolve(_config(tiny, tmp_path, **own)))
    learner = Learner(task, torch.device("cpu"))
    learner.resume(str(tmp_path))
    policy = learner.policy.eval()
    ids = torch.tensor([task.tokenizer("reverse:1234=")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(saved(ids).logits, policy(ids).logits)
    start = load_model(str(model), trust_remote_code=True).eval()
    assert not torch.equal(saved(ids).logits, start(ids).logits)  # it trained


async def test_a_reward_that_raises_ends_the_run_naming_it(tmp_path, tiny, sockets_dir):
    broken = tmp_path / "broken.py"
    broken.write_text("def grumpy(prompts, completions, **kw):\n    raise KeyError('answer2')\n")
    config = _config(tiny, tmp_path / "run", rewards=[f"{broken}:grumpy"], steps=20)
    with pytest.raises(PipelineError, match=r"reward function grumpy \(.*\) raised KeyError: 'answer2'") as caught:
        await run_pipeline(config, quiet=True)
    assert "Traceback" not in str(caught.value) and str(caught.value).count("\n") == 0, str(caught.value)


async def test_a_resumed_run_repeats_an_uninterrupted_one_step_for_step(tmp_path, tiny, sockets_dir):
    """On-policy with one generator, a run cut after step 3 and resumed trains steps 4-6 exactly as one that ran on.

    Each rollout's prompts and sampling randomness follow its ticket (its step), so nothing depends on
    which process drew it or when; the checkpoint holds the policy, the optimiser, the schedule and the adaptive
    entropy bonus's coefficient (applied from step 2 on, growing each step: a resume that lost it would differ).
    """
    from pipeline.learning.checkpoint import load

    settings = dict(mode="sync", generators=1, steps=6, eval_every=3, log_completions=0, kl_coeff=0.02)
    settings.update(use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=50.0, entropy_coef_delta=0.02)
    await run_pipeline(_config(tiny, tmp_path / "whole", **settings), quiet=True)
    cut = _config(tiny, tmp_path / "cut", **{**settings, "steps": 3})
    await run_pipeline(cut, quiet=True)
    saved = Config.from_dict(json.loads((tmp_path / "cut" / "config.json").read_text()))
    saved.steps = 6
    await run_pipeline(saved, resume=True, quiet=True)
    keys = ("reward/mean", "actor/loss", "actor/kl", "actor/grad_norm", "eval/reward", "actor/entropy_coef")
    whole = [[row.get(k) for k in keys] for row in read_rows(str(tmp_path / "whole"))]
    resumed = [[row.get(k) for k in keys] for row in read_rows(str(tmp_path / "cut"))]
    assert [row[0] for row in resumed] == [row[0] for row in whole] and resumed == whole
    first, second = load(str(tmp_path / "whole"))["policy"], load(str(tmp_path / "cut"))["policy"]
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_weights_of_a_tied_hf_model_install_by_copy_and_by_alias(tiny):
    from actors import WeightConsumer, WeightPublisher

    trained = load_model(str(tiny / "model"))
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(0.01)
    assert trained.lm_head.weight is trained.model.embed_tokens.weight  # tied
    publisher = WeightPublisher("shm", slots=3)
    consumer = WeightConsumer()
    try:
        ids = torch.tensor([[5, 6, 7, 8]])
        for alias in (False, True):
            target = load_model(str(tiny / "model")).eval()
            manifest = publisher.publish(trained, 1 + alias)
            consumer.install(manifest, target, alias=alias)
            with torch.no_grad():
                assert torch.equal(target(ids).logits, trained.eval()(ids).logits)
            if not alias:
                consumer.release(manifest.update_id)
    finally:
        consumer.close()
        publisher.close()


async def test_the_engine_installs_the_newest_manifest_and_refuses_one_that_does_not_fit(tiny):
    from actors import WeightInbox, WeightPublisher, WeightSyncError

    trained = load_model(str(tiny / "model"))
    with torch.no_grad():
        trained.lm_head.weight.add_(0.5)
    engine = BuiltinEngine(load_model(str(tiny / "model")).eval(), load_tokenizer(str(tiny / "model")))
    publisher, inbox = WeightPublisher("shm", slots=3), WeightInbox()
    try:
        assert await engine.load_weights(inbox) is None  # nothing waiting
        inbox.put(publisher.publish(trained, 1))
        inbox.put(newest := publisher.publish(trained, 2))
        assert (await engine.load_weights(inbox)).version == newest.version  # type: ignore[union-attr]
        assert torch.equal(engine.model.lm_head.weight, trained.lm_head.weight)
        before = {name: value.clone() for name, value in engine.model.state_dict().items()}
        inbox.put(publisher.publish({"lm_head.weight": torch.zeros(3, 3)}, 3))
        with pytest.raises(WeightSyncError):
            await engine.load_weights(inbox)
        assert all(torch.equal(before[name], value) for name, value in engine.model.state_dict().items())
    finally:
        inbox.close()
        publisher.close()


def test_sampled_evaluation_draws_n_of_each_prompt_the_same_way_each_time_in_bounded_calls(tmp_path, tiny):
    """--num-generations-eval 3 with 5 held-out prompts and rollouts of 2 x 2: each call holds at most
    max(5, 4) completions (one prompt's 3 here); every evaluation draws the same samples; the metrics are the
    means over all 15 and the spread within each prompt's 3 (TRL's reward_std and frac_reward_zero_std)."""
    settings = dict(prompts=2, group=2, max_new_tokens=4, eval_size=5, num_generations_eval=3, log_completions=15)
    task = HFTask(resolve(_config(tiny, tmp_path, **settings)))
    policy = task.build_policy()
    engine = task.engine(policy)
    calls: list[tuple[int, int]] = []
    drawn: list[str] = []
    generate = engine.generate

    def counted(prompts, params, generator=None):  # type: ignore[no-untyped-def]
        calls.append((len(prompts), params.samples))
        assert params.temperature == 1.0 and generator is not None, "sampled as in training, from a seeded stream"
        out = generate(prompts, params, generator)
        drawn.extend(out.texts)
        return out

    engine.generate = counted  # type: ignore[method-assign]
    first = task.evaluate(policy)
    assert calls == [(1, 3)] * 5 and policy.training, "the policy is back in training mode"
    again = task.evaluate(policy)
    assert again == first and drawn[:15] == drawn[15:], "each evaluation draws the same samples"
    assert len(set(drawn[:15])) > 5, "sampled, not greedy: a prompt's completions differ"
    logged = [json.loads(line) for line in open(tmp_path / "completions.jsonl")][:15]
    assert [row["completion"] for row in logged] == drawn[:15]
    assert [row["prompt"] for row in logged][:3] == [logged[0]["prompt"]] * 3, "a prompt's samples are consecutive"
    scores = torch.tensor([row["rewards"]["reversed_digits"] + 0.5 * row["rewards"]["exact_match"] for row in logged])
    assert first["reward"] == pytest.approx(float(scores.mean()), abs=1e-6)
    spread = group_spread(scores, 3)
    assert (first["reward_std"], first["frac_reward_zero_std"]) == (pytest.approx(spread[0], abs=1e-6), spread[1])
    greedy = HFTask(resolve(_config(tiny, tmp_path, **{**settings, "num_generations_eval": 0, "log_completions": 0})))
    logged_metric = "reversed_digits/exact"  # the example's reward logs it (log_metric)
    assert set(greedy.evaluate(policy)) == {"reward", "reward/reversed_digits", "reward/exact_match", logged_metric}


@pytest.mark.parametrize("push, expected", [(50.0, False), (-50.0, True)])
def test_a_completion_without_its_end_token_is_marked_truncated(tmp_path, tiny, push, expected):
    task = HFTask(resolve(_config(tiny, tmp_path, prompts=2, group=2, max_new_tokens=3)))
    policy = task.build_policy().eval()
    eos = task.tokenizer.eos_token_id

    def shift(module, inputs, logits):  # type: ignore[no-untyped-def]
        logits[..., eos] += push  # the end token the likeliest (every completion ends) or all but impossible (none)
        return logits

    policy.lm_head.register_forward_hook(shift)
    batch = task.sample(policy, torch.Generator().manual_seed(0), ticket=0)
    assert batch.truncated.tolist() == [expected] * 4


@pytest.mark.parametrize(
    "changes",
    [{"max_tokens_per_pass": 64}, {"gradient_checkpointing": True}, {"micro_batch": 3, "gradient_checkpointing": True}],
    ids=["token-budget", "checkpointing", "micro-batch+checkpointing"],
)
def test_passes_by_token_budget_and_checkpointing_give_the_same_update(tmp_path, tiny, changes):
    def one_update(**overrides):  # type: ignore[no-untyped-def]
        config = resolve(_config(tiny, tmp_path, prompts=4, group=2, max_new_tokens=6, kl_coeff=0.05, **overrides))
        task = HFTask(config)
        learner = Learner(task, torch.device("cpu"))
        learner.policy.eval()  # sampled as a generator samples (a checkpointing model in training mode has no cache)
        batch = task.sample(learner.policy, torch.Generator(device="cpu").manual_seed(0), ticket=0)
        learner.policy.train()
        rewards = torch.arange(8, dtype=torch.float32, device="cpu") / 8
        ref = task.reference_logps(learner.reference(), batch)
        passes = len(task.micro_batches(batch, config.micro_batch, config.max_tokens_per_pass))
        update = learner.update(batch, rewards, ref)
        return passes, update, {name: p.grad.clone() for name, p in learner.policy.named_parameters()}

    whole_passes, whole, expected = one_update(max_tokens_per_pass=0)
    passes, update, got = one_update(**changes)
    assert whole_passes == 1 and (passes > 1) == ("gradient_checkpointing" not in changes or "micro_batch" in changes)
    assert update.report.loss.item() == pytest.approx(whole.report.loss.item(), rel=1e-5, abs=1e-6)
    assert update.report.entropy == pytest.approx(whole.report.entropy, rel=1e-5)
    assert update.grad_norm == pytest.approx(whole.grad_norm, rel=1e-5)
    for name, gradient in expected.items():  # the step's gradients (Adam's first step would magnify rounding)
        torch.testing.assert_close(got[name], gradient, rtol=1e-4, atol=1e-7)


def test_the_entropy_bonus_trains_a_hf_model_through_its_chunked_head(tmp_path, tiny):
    """--entropy-coef c: the HF scorer's entropies carry their gradient (chunk by chunk), and the learner's step
    descends the loss less c times the trained tokens' mean entropy."""
    config = resolve(_config(tiny, tmp_path, prompts=4, group=2, kl_coeff=0.0, entropy_coef=0.5, max_grad_norm=0))
    task = HFTask(config)
    learner = Learner(task, torch.device("cpu"))
    learner.policy.eval()
    batch = task.sample(learner.policy, torch.Generator(device="cpu").manual_seed(0), ticket=0)
    learner.policy.train()
    rewards = torch.arange(8, dtype=torch.float32) / 8

    def gradient(term) -> torch.Tensor:  # type: ignore[no-untyped-def]
        learner.policy.zero_grad()
        term.backward()
        return torch.cat([p.grad.flatten() for p in learner.policy.parameters()])

    report = task.loss(learner.policy, batch, rewards, None)
    assert report.entropy_bonus is not None and report.entropy_bonus.requires_grad
    bonus = gradient(report.entropy_bonus)
    plain = gradient(task.loss(learner.policy, batch, rewards, None).loss)
    learner.policy.zero_grad()
    learner.update(batch, rewards, None)
    step = torch.cat([p.grad.flatten() for p in learner.policy.parameters()])
    torch.testing.assert_close(step, plain - 0.5 * bonus, rtol=1e-4, atol=1e-7)
    assert bonus.norm() > 0.01 * plain.norm()
    without = HFTask(dataclasses.replace(config, entropy_coef=0.0)).loss(learner.policy, batch, rewards, None)
    assert without.entropy_bonus is not None and not without.entropy_bonus.requires_grad


def test_dropout_goes_off_in_every_form_a_model_holds_it():
    """GPT-2 drops out through ``nn.Dropout`` modules; after :func:`disable_dropout` training mode computes what eval
    mode does, and the model's config keeps its own rates (an export is the user's model)."""
    import transformers

    from pipeline.models import disable_dropout

    config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.3)
    model = transformers.GPT2LMHeadModel(config).train()
    tokens = torch.randint(0, 64, (2, 8), device="cpu")
    with torch.no_grad():
        assert not torch.equal(model(tokens).logits, model.eval()(tokens).logits)
        assert disable_dropout(model.train()) == 7, "the embedding's, and 3 in each of the 2 blocks"
        torch.testing.assert_close(model(tokens).logits, model.eval()(tokens).logits)
    assert model.config.resid_pdrop == 0.3 and disable_dropout(model) == 0
    router = torch.nn.Module()
    router.layerdrop, router.jitter_noise, router.dropout_rate, router.hidden_dropout = 0.1, 0.01, 0.2, True
    assert disable_dropout(router) == 3
    assert (router.layerdrop, router.jitter_noise, router.dropout_rate, router.hidden_dropout) == (0, 0, 0, True)


def test_the_policys_dropout_is_off_so_the_ratio_is_one_at_lag_zero(tmp_path, tiny):
    """A Qwen2 whose attention drops out (``attention_dropout``, a probability its attention function takes, no
    module): the trainer in training mode scores the generator's tokens (drawn in eval mode) at their own log-probs;
    with --no-disable-dropout its random masks move every ratio off 1 (TRL's ``disable_dropout``)."""
    import shutil

    import transformers

    folder = tmp_path / "model"
    shutil.copytree(tiny / "model", folder)
    config = transformers.AutoConfig.from_pretrained(str(folder))
    config.attention_dropout = 0.3
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    mismatch = {}
    for disable in (True, False):
        task = HFTask(resolve(_config(tiny, tmp_path, model=str(folder), prompts=4, group=2, disable_dropout=disable)))
        learner = Learner(task, torch.device("cpu"))
        learner.policy.eval()
        batch = task.sample(learner.policy, torch.Generator(device="cpu").manual_seed(0), ticket=0)
        learner.policy.train()
        with torch.no_grad():
            mismatch[disable] = task.loss(learner.policy, batch, torch.arange(8.0) / 8, None).logp_diff
    assert mismatch[True] < 1e-5 < 1e-2 < mismatch[False], mismatch


def test_gspo_iterations_and_top_entropy_train_a_hf_model(tmp_path, tiny):
    """Sequence-level ratios with μ = 2 take the two steps two single updates take; a top-entropy share keeps the
    policy term of the tokens the pass's own entropies rank highest (the HF scorer's chunked head gives them)."""

    def learner(**overrides):  # type: ignore[no-untyped-def]
        config = resolve(_config(tiny, tmp_path, prompts=4, group=2, **{"kl_coeff": 0.05, **overrides}))
        task = HFTask(config)
        return task, Learner(task, torch.device("cpu"))

    task, twice = learner(importance_sampling_level="sequence", num_iterations=2)
    twice.policy.eval()
    batch = task.sample(twice.policy, torch.Generator(device="cpu").manual_seed(0), ticket=0)
    twice.policy.train()
    rewards = torch.arange(8, dtype=torch.float32) / 8
    ref = task.reference_logps(twice.reference(), batch)
    twice.update(batch, rewards, ref)
    _, once = learner(importance_sampling_level="sequence")
    for _ in range(2):
        once.update(batch, rewards, ref)
    for mine, theirs in zip(twice.policy.parameters(), once.policy.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)
    halves_task, halves = learner(mini_batches=2)  # an HF task's loss of one mini-batch: its 4 rows' own
    halves.update(batch, rewards, ref)
    assert halves.schedule.last_epoch == 2
    part = halves_task.loss(halves.policy, batch, rewards, ref, slice(4, 8), batch=slice(4, 8))
    share = halves_task.loss(halves.policy, batch, rewards, ref, slice(4, 8))
    assert float(part.kl) == pytest.approx(2 * float(share.kl), rel=0.25), "its own normaliser, not the rollout's"

    top_task, top = learner(top_entropy_quantile=0.25, kl_coeff=0.0)
    with torch.no_grad():
        logps, entropy = top_task.logps_of(top.policy)(batch.tokens, batch.prompt_mask, 1.0)
        report = top_task.loss(top.policy, batch, rewards, None)
    kept = high_entropy_tokens(entropy, batch.mask > 0, 0.25)
    assert 0 < int(kept.sum()) < int((batch.mask > 0).sum()) / 2
    advantages = group_advantages(rewards, 2).unsqueeze(1)
    ratio = torch.where(kept, (logps - batch.logps).exp(), torch.zeros_like(logps))  # 1 at lag 0, to rounding
    expected = float((-ratio * advantages).sum() / batch.mask.sum())
    assert report.policy_loss == pytest.approx(expected, abs=1e-5)


@pytest.mark.skipif(
    missing_compiler(torch.device("cpu")) is not None, reason="torch.compile on a CPU builds C++: no compiler here"
)
def test_compiled_blocks_take_the_eager_learners_steps_under_the_same_names(tmp_path, tiny, caplog):
    """--compile: each layer compiled for dynamic shapes. Updates on rollouts of other widths take the eager
    learner's steps (to rounding), the evaluation (its decoding eager: nothing compiled for a KV cache's passes) is
    the eager model's, and the parameters keep their names (checkpoints, updates). (The RefModel's compiled passes,
    without gradients, compile two graphs more: checked by hand in a run with a KL term, not here.)"""
    from torch._dynamo.utils import counters

    def learner(**overrides):  # type: ignore[no-untyped-def]
        task = HFTask(resolve(_config(tiny, tmp_path, prompts=4, group=2, kl_coeff=0.05, **overrides)))
        return task, Learner(task, torch.device("cpu"))

    task, eager = learner()
    with caplog.at_level(logging.INFO, logger="pipeline.models._blocks"):
        _, compiled = learner(compile=True)
    assert "Qwen2ForCausalLM: 2 blocks (Qwen2DecoderLayer) compiled by torch.compile" in caplog.text
    assert list(compiled.policy.state_dict()) == list(eager.policy.state_dict())
    rewards = torch.arange(8, dtype=torch.float32) / 8
    widths = set()
    for cut in (0, 2):
        eager.policy.eval()
        batch = task.sample(eager.policy, torch.Generator(device="cpu").manual_seed(cut), ticket=cut)
        if cut:  # completions cut short: passes of another width
            end = batch.mask.shape[1] - cut
            batch = dataclasses.replace(
                batch, tokens=batch.tokens[:, :-cut], logps=batch.logps[:, :end], mask=batch.mask[:, :end]
            )
        widths.add(batch.tokens.shape[1])
        ref = task.reference_logps(eager.reference(), batch)
        eager.policy.train()
        want, got = eager.update(batch, rewards, ref), compiled.update(batch, rewards, ref)
        assert float(got.report.loss) == pytest.approx(float(want.report.loss), abs=1e-5)
        assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-4)
    assert len(widths) == 2, "the second rollout is another shape: compiled for dynamic shapes, not again"
    for mine, theirs in zip(compiled.policy.parameters(), eager.policy.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)  # Adam steps ~1e-3 whatever the gradient's size
    graphs = counters["stats"]["unique_graphs"]
    assert compiled.evaluate() == pytest.approx(eager.evaluate(), abs=1e-6)
    assert counters["stats"]["unique_graphs"] == graphs, "the evaluation's decoding ran the blocks eagerly"
    with pytest.raises(RuntimeError, match=r"compiled blocks cannot be sharded \(FSDP2\): --trainer-shard ddp"):
        compiled.share_with(object.__new__(FullySharded))  # refused before it joins (settings refuse it first)
    with pytest.raises(ModelError, match="--compile: Linear has no repeated blocks to compile"):
        compile_blocks(torch.nn.Linear(2, 2))


def test_lora_adapters_train_alone_and_generators_get_the_merged_weights(tmp_path, tiny):
    """--lora-r 4: only the adapters step; the base stays the reference; what is published is the plain model's
    state with W + (alpha / r) B A merged, which a plain model installs and then computes the adapted logits."""
    task = HFTask(resolve(_config(tiny, tmp_path, lora_r=4, lora_target_modules="q_proj,v_proj,up_proj")))
    learner = Learner(task, torch.device("cpu"))
    plain = task.build_policy()
    assert learner.adapter is not None and type(learner.policy) is type(plain), "the policy keeps its class"
    trained = {id(p) for group in learner.optim.param_groups for p in group["params"]}
    assert trained == {id(p) for n, p in learner.policy.named_parameters() if ".lora_" in n} and len(trained) == 12
    published = learner.published()
    assert isinstance(published, dict) and set(published) == set(plain.state_dict())
    assert all(torch.equal(published[n], t) for n, t in plain.state_dict().items()), "B starts at 0: the base"
    base = {n: t.clone() for n, t in learner.policy.state_dict().items() if ".lora_" not in n}
    learner.policy.eval()
    batch = task.sample(learner.policy, torch.Generator(device="cpu").manual_seed(0), ticket=0)
    learner.policy.train()
    learner.update(batch, torch.arange(32, dtype=torch.float32) / 32, None)
    assert all(torch.equal(learner.policy.state_dict()[n], t) for n, t in base.items()), "the base is frozen"
    merged = learner.published()
    assert isinstance(merged, dict)
    moved = sorted(n for n in merged if not torch.equal(merged[n], plain.state_dict()[n]))
    assert moved and all(n.endswith(("q_proj.weight", "v_proj.weight", "up_proj.weight")) for n in moved), moved
    plain.load_state_dict(merged)
    ids = torch.tensor([task.tokenizer("reverse:1234=")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(ids).logits, learner.policy.eval()(ids).logits, atol=1e-5, rtol=0)
    exported = learner.exported()
    assert type(exported) is type(plain) and not any(".lora_" in n for n in exported.state_dict())


async def test_a_lora_run_syncs_merged_weights_and_saves_the_merged_model_and_its_adapter(tmp_path, tiny, sockets_dir):
    """On-policy (lag 0), the trainer's log-probs before each update equal the generator's: it samples with the
    merged weights. model/ is the merged policy as transformers loads it; adapter/ is PEFT's, and the base with it
    gives model/'s logits; the checkpoint resumes into the adapters."""
    import transformers
    from peft import PeftModel

    settings = dict(mode="sync", generators=1, steps=4, eval_every=2, lr=1e-2, kl_coeff=0.02, lora_r=4)
    config = _config(tiny, tmp_path, **settings)
    result = await run_pipeline(config, quiet=True)
    rows = read_rows(str(tmp_path))
    assert result.steps == 4 and all(row["mismatch/logp_abs"] < 1e-4 for row in rows), rows
    assert rows[-1]["actor/kl"] > 0, "the adapters moved the policy away from the base, the reference"
    saved = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "model")).eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tiny / "model"))
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    ids = torch.tensor([HFTask(resolve(config)).tokenizer("reverse:1234=")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, saved(ids).logits, atol=1e-5, rtol=0)
        plain = load_model(str(tiny / "model")).eval()  # PeftModel adapted ``base`` in place
        assert not torch.allclose(plain(ids).logits, saved(ids).logits, atol=1e-3), "it trained"
    learner = Learner(HFTask(resolve(config)), torch.device("cpu"))
    learner.resume(str(tmp_path))
    published = learner.published()
    assert isinstance(published, dict)
    assert all(torch.equal(published[name], tensor) for name, tensor in saved.state_dict().items())


def test_two_ddp_ranks_train_the_lora_adapters_as_one_learner(tmp_path, tiny):
    """--lora-r 4 --trainer-ranks 2 --trainer-shard ddp: each rank holds the adapters whole, the ranks' adapter
    gradients are summed, and both take the one learner's step; the frozen base stays as it was on both."""
    config = resolve(_config(tiny, tmp_path, lora_r=4, trainer_ranks=2, trainer_shard="ddp", prompts=4, lr=1e-2))
    learner, update, reports = _two_sharded_ranks_and_one_learner(config, "ddp")
    state = learner.policy.state_dict()
    adapters = {name: p.grad for name, p in learner.policy.named_parameters() if p.requires_grad}
    for report in reports:
        assert report["grad_norm"] == pytest.approx(update.grad_norm, rel=1e-4)
        gradients, weights = report["gradients"], report["weights"]
        assert isinstance(gradients, dict) and set(gradients) == set(adapters) and all(".lora_" in n for n in adapters)
        for name, grad in adapters.items():  # each adapter's summed gradient, to its own scale
            assert grad is not None and (gradients[name] - grad).norm() <= 1e-4 * grad.norm() + 1e-9, name
        assert isinstance(weights, dict) and set(weights) == set(state)
        assert all(torch.equal(weights[n], t) for n, t in state.items() if ".lora_" not in n), "the base is frozen"
    # the ranks took the same step (Adam turns rounding-sized gradients into lr-sized steps: compared rank to rank)
    first, second = reports[0]["weights"], reports[1]["weights"]
    assert isinstance(first, dict) and isinstance(second, dict)
    assert all(torch.equal(second[name], value) for name, value in first.items())


def test_lora_target_modules_that_match_no_layer_are_refused(tiny):
    from pipeline.models import ModelError, check_lora_targets

    check_lora_targets(str(tiny / "model"), "all-linear")
    with pytest.raises(ModelError, match=r"--lora-target-modules q_proj,nope: nope names no layer .* q_proj, "):
        check_lora_targets(str(tiny / "model"), "q_proj,nope")


def test_a_tied_reference_is_mixed_once(tmp_path, tiny):
    learner = Learner(HFTask(resolve(_config(tiny, tmp_path, kl_coeff=0.05))), torch.device("cpu"))
    ref = learner.reference_state
    assert ref["lm_head.weight"].data_ptr() == ref["model.embed_tokens.weight"].data_ptr(), "tied in the copy too"
    before = ref["lm_head.weight"].clone()
    with torch.no_grad():
        learner.policy.model.embed_tokens.weight.add_(1.0)  # type: ignore[operator]
    learner.mix_reference(0.5)
    torch.testing.assert_close(ref["lm_head.weight"], before + 0.5, atol=1e-6, rtol=0)  # not + 0.75: mixed once


def test_bfloat16_roles_hold_their_weights_in_bfloat16_and_derived_buffers_in_float32(model_and_tokenizer):
    """A rotary embedding's inverse frequencies are not weights: in bfloat16 they would shift every position."""
    import copy

    from pipeline.models import hold_weights

    model = hold_weights(copy.deepcopy(model_and_tokenizer[0]), torch.device("cpu"), torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {v.dtype for v in model.state_dict().values() if v.is_floating_point()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert model.lm_head.weight is model.model.embed_tokens.weight, "tied weights stay tied"


def test_the_one_process_reference_holds_the_runs_dtype_as_the_refmodel_does(tmp_path, tiny):
    """--dtype bfloat16: the one-process run's reference scores with bfloat16 weights, as the RefModel role's does
    (it held float32 ones, so the yardstick's KL term was not the pipeline's)."""
    learner = Learner(HFTask(resolve(_config(tiny, tmp_path, kl_coeff=0.05, dtype="bfloat16"))), torch.device("cpu"))
    reference = learner.reference()
    assert {p.dtype for p in reference.parameters()} == {torch.bfloat16}
    assert reference.model.rotary_emb.inv_freq.dtype == torch.float32
    assert not any(p.requires_grad for p in reference.parameters()) and not reference.training
    assert {p.dtype for p in learner.policy.parameters()} == {torch.float32}, "the trainer keeps float32"


def _two_sharded_ranks_and_one_learner(
    config: Config, shard: str = "fsdp"
) -> tuple[Learner, Update, list[dict[str, object]]]:
    """One rollout of ``config``'s task, rewards 0..1 by row: one learner's update of it, and two FSDP2 ranks' reports.

    The reference log-probs are the initial policy's when the run has a KL term, else none.
    """
    from pipeline_support import ranks_step

    task = HFTask(resolve(config))
    learner = Learner(task, torch.device("cpu"))
    learner.policy.eval()
    batch = task.sample(learner.policy, torch.Generator(device="cpu").manual_seed(0), ticket=0)
    learner.policy.train()
    rows = config.prompts * config.group
    rewards = torch.arange(rows, dtype=torch.float32) / rows
    ref = task.reference_logps(learner.reference(), batch) if config.hyper("kl_coeff") > 0 else None
    update = learner.update(batch, rewards, ref)
    return learner, update, ranks_step(2, config.to_dict(), batch, rewards, ref, shard, timeout=180)


@pytest.mark.parametrize(
    "changes, tolerance, loss_abs",
    [({"gradient_checkpointing": True, "entropy_coef": 0.1}, 1e-4, 1e-6), ({"dtype": "bfloat16"}, 0.05, 1e-3)],
    ids=["gradient-checkpointing-and-entropy-bonus", "bfloat16"],
)
def test_a_hf_model_sharded_over_two_ranks_takes_the_one_learner_step(tmp_path, tiny, changes, tolerance, loss_abs):
    """FSDP2 on two gloo ranks: the scorer is the root (tied head and embedding in it), each layer a unit.

    Gradient checkpointing recomputes each unit's forward in the backward (here with an entropy bonus, whose
    gradient runs through the chunked head inside the sharded root). In bfloat16 the ranks compute under
    FSDP2's mixed precision where one trainer autocasts: equal to bf16 rounding (under autocast the sharded
    gradient norm was 1.74 against 2.34: the case that caught it).
    """
    config = _config(tiny, tmp_path, prompts=4, group=2, kl_coeff=0.05, **changes)
    learner, update, results = _two_sharded_ranks_and_one_learner(config)
    for result in results:
        assert result["loss"] == pytest.approx(float(update.report.loss), rel=tolerance, abs=loss_abs)
        assert result["grad_norm"] == pytest.approx(update.grad_norm, rel=tolerance / 5)
        for name, p in learner.policy.named_parameters():  # each parameter's gradient, to its own scale
            assert (result["gradients"][name] - p.grad).norm() <= tolerance * p.grad.norm() + 1e-9, name
    for name, value in results[0]["weights"].items():
        assert torch.equal(results[1]["weights"][name], value), name


def test_two_sharded_ranks_at_a_real_vocabulary_hold_half_the_model_each_and_take_its_step(tmp_path, tiny):
    """FSDP2 at Qwen's 151,936-token vocabulary, 64 wide (the tied embedding is 9.7 M of 10.0 M parameters).

    Each rank holds half of every tensor, built in host memory first (``stage_on_host``: on a GPU only the
    shards reach it), and the head's log-probs run in chunks inside the sharded root: a rank's process peaks
    under 1.1 GB (792 MB measured, imports included), where this batch's float32 logits alone would be 350 MB
    and their log-softmax and its gradient as much again each.
    """
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny / "model", folder)  # the tokenizer; the weights are replaced
    parameters = _example().build_model(str(folder), "qwen2", 151_936, 0, heads=2)
    config = _config(tiny, tmp_path, model=str(folder), prompts=8, group=4, kl_coeff=0.0, max_new_tokens=8)
    _, update, results = _two_sharded_ranks_and_one_learner(config)
    whole = parameters * 4
    for result in results:
        assert result["loss"] == pytest.approx(float(update.report.loss), rel=1e-4, abs=1e-6)
        assert result["grad_norm"] == pytest.approx(update.grad_norm, rel=2e-5)
        assert abs(result["held_bytes"] - whole / 2) < 0.001 * whole, (result["held_bytes"], whole)
        assert result["peak_rss_mb"] < 1100, result["peak_rss_mb"]  # 792 MB measured


def test_the_trainers_evaluation_decodes_over_the_dynamic_cache_unless_a_path_is_asked_for(tmp_path, tiny):
    """A kept static cache and its graphs would hold memory between evaluations in the trainer's process."""
    model = load_model(str(tiny / "model")).eval()
    for asked, decodes in (("auto", "dynamic"), ("static", "static")):
        task = HFTask(resolve(_config(tiny, tmp_path, decode=asked)))
        engine = task.engine(model)
        assert isinstance(engine, BuiltinEngine) and engine.decoding.wanted == decodes


@pytest.mark.parametrize("flag", ["auto", "float32"])
def test_the_export_takes_the_models_recorded_dtype_with_its_head_tied_and_loads(tiny, tmp_path, flag):
    """``model/`` was always float32 (the trainer's masters): a bfloat16 model came back twice its size, and vLLM's
    ``dtype="auto"`` serves a float32 config as float16, whose range a bfloat16 model may exceed. With
    ``--export-dtype auto`` (the default) it is published in the dtype ``--model``'s config records; ``float32``
    keeps the masters' precision."""
    import shutil

    import transformers

    source = tmp_path / "bf16-model"
    shutil.copytree(tiny / "model", source)
    config = json.loads((source / "config.json").read_text())
    config["dtype"] = "bfloat16"  # (as a published bfloat16 model records it; its weights here are float32)
    config.pop("torch_dtype", None)
    (source / "config.json").write_text(json.dumps(config))
    task = HFTask(resolve(Config(task="hf", model=str(source), dataset=str(tiny / "train.jsonl"), export_dtype=flag)))
    policy = load_model(str(source))
    policy.config.tie_word_embeddings = True
    policy.tie_weights()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    task.export(policy, str(run_dir))
    want = torch.bfloat16 if flag == "auto" else torch.float32
    assert json.loads((run_dir / "model" / "config.json").read_text())["dtype"] == str(want).removeprefix("torch.")
    saved = transformers.AutoModelForCausalLM.from_pretrained(str(run_dir / "model"), dtype="auto")
    assert saved.dtype == want
    from safetensors import safe_open

    with safe_open(str(run_dir / "model" / "model.safetensors"), "pt") as stored:
        names = set(stored.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names, "the tied head is saved once"
    for name, value in saved.state_dict().items():
        assert torch.equal(value, policy.state_dict()[name].to(want)), name
    assert sorted(p.name for p in run_dir.iterdir()) == ["model"], "nothing left beside it"


def test_the_export_dtype_is_refused_outside_its_choices_and_for_a_task_without_a_model_folder():
    from pipeline.config import check_settings
    from pipeline.tasks import check_task_settings

    with pytest.raises(SettingsError, match="--export-dtype int8: choose one of auto, float32, bfloat16, float16"):
        check_settings(Config(task="hf", export_dtype="int8"))
    with pytest.raises(SettingsError, match="--export-dtype with --task bandit"):
        check_task_settings(resolve(Config(task="bandit", export_dtype="bfloat16")))


def test_the_export_casts_all_but_the_modules_kept_in_float32_and_says_its_dtype_in_every_nested_config(tmp_path):
    """As transformers' loader keeps ``_keep_in_fp32_modules`` in float32, the export does; and a config with
    sub-configs (a ``text_config``) says the dtype there too, not only at its top level."""
    from pipeline.models import cast_state, record_dtype

    model = tiny_qwen2()
    model._keep_in_fp32_modules = ["norm"]  # (the final norm: model.norm.weight)
    state = cast_state(model, torch.bfloat16)
    assert state["model.norm.weight"].dtype == torch.float32
    assert state["model.layers.0.input_layernorm.weight"].dtype == torch.bfloat16, "a name part matches, not a prefix"
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"], "the tied head stays one tensor"
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"dtype": "float32", "text_config": {"torch_dtype": "float32", "x": 1}, "y": {"z": 2}}))
    record_dtype(str(path), torch.bfloat16)
    assert json.loads(path.read_text()) == {
        "dtype": "bfloat16",
        "text_config": {"dtype": "bfloat16", "torch_dtype": "bfloat16", "x": 1},
        "y": {"z": 2},
    }
