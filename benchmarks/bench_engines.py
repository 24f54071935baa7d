"""Generation engines side by side on one Hugging Face model: tokens/s, weight updates, mismatch, pipeline steps/s.

    python benchmarks/bench_engines.py [--engines builtin hf vllm] [--size tiny|small] [--repeat 5] [--json]
    python benchmarks/bench_engines.py --engines vllm --vllm-dtype bfloat16                # the mismatch in bf16
    python benchmarks/bench_engines.py --size small --device cuda --transport cuda-ipc     # on a GPU

Each engine (``--engine`` of ``python -m pipeline.grpo``: ``builtin``, this
project's sampler; ``hf``, transformers' ``generate``; ``vllm``, vLLM in the
process) runs in a fresh actor process of its own, on the same random Qwen2
built here (``tiny``: examples/tiny_hf_model.py's task model with 2 heads,
127 k parameters; ``small``: 8 layers of width 512, 25 M parameters, 100 MB),
and reports, as medians over ``--repeat``:

- completion tokens/s for 32 prompts x 8 samples (after one warm-up batch),
  and the start-up and first-batch seconds;
- the lag-0 mismatch: mean |log pi_engine - log pi_trainer| over the sampled
  tokens, the trainer's log-probs computed by the same weights in float32;
- a weight update published by this process (``--transport``) and installed
  into the engine, against one plain copy of the same bytes in the same
  process, measured in the same run (the ratio's goal: <= 2x);

and with ``--pipeline STEPS``, the pipeline's steps/s with each engine on the
example task (2 generators, async, shm). One JSON line at the end.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import tempfile
from typing import Any

import torch
import uvloop

from actors import WeightPublisher, this_host
from pipeline import Config, run_pipeline
from pipeline.models import load_model, load_tokenizer
from pipeline.run import read_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {"tiny": (64, 2, 2, 256), "small": (512, 8, 8, 1376)}  # width, layers, heads, MLP width


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("tiny_hf_model", os.path.join(ROOT, "examples", "tiny_hf_model.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_task(folder: str, size: str) -> str:
    """The example task in ``folder`` with a model of ``size``; the model folder."""
    import transformers

    _example().main([folder, "--heads", "2"])
    model_dir = os.path.join(folder, "model")
    if size != "tiny":
        width, layers, heads, mlp = SIZES[size]
        tokenizer = load_tokenizer(model_dir)
        config = transformers.Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=width,
            intermediate_size=mlp,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads // 2,
            max_position_embeddings=128,
            tie_word_embeddings=True,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
        torch.manual_seed(0)
        transformers.Qwen2ForCausalLM(config).save_pretrained(model_dir, safe_serialization=True)
    return model_dir


async def measure_engine(kind: str, model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    """One engine in a fresh process: generation, mismatch, and ``--repeat`` weight updates."""
    from _engine_host import EngineHost

    tokenizer = load_tokenizer(model_dir)
    rows = [json.loads(line) for line in open(os.path.join(os.path.dirname(model_dir), "train.jsonl"))][:32]
    prompts = [tokenizer.encode(row["prompt"]) for row in rows]
    procs = this_host().spawn_procs(per_host={"procs": 1})
    try:
        host = procs.spawn("engine", EngineHost, kind, model_dir, args.device, args.threads, args.vllm_dtype).slice(
            procs=0
        )
        generation = await host.generate.call_one(prompts, 8, args.max_new_tokens, args.repeat)
        policy = load_model(model_dir).to(args.device)
        updates = []
        with WeightPublisher(args.transport, slots=2) as publisher:
            for version in range(1, args.repeat + 2):
                with torch.no_grad():
                    for p in policy.parameters():
                        p.mul_(1.0001)
                updates.append(await host.install.call_one(publisher.publish(policy, version)))
        updates = updates[1:]  # the first update warms the engine's loaders
        nbytes = sum(p.numel() * p.element_size() for p in policy.parameters())
    finally:
        await procs.stop()
    engine_ms = statistics.median(u["engine_ms"] for u in updates)
    copy_ms = statistics.median(u["copy_ms"] for u in updates)
    return {
        **generation,
        "update_ms": engine_ms,
        "copy_ms": copy_ms,
        "update_ratio": engine_ms / copy_ms,
        "update_mb": nbytes / 2**20,
    }


def pipeline_steps_per_s(kind: str, folder: str, steps: int, run_dir: str) -> float:
    """Steps/s of the example task's pipeline with ``kind`` generators, past a 10-step warm-up."""
    config = Config(
        task="hf",
        model=os.path.join(folder, "model"),
        dataset=os.path.join(folder, "train.jsonl"),
        rewards=[os.path.join(folder, "rewards.py") + ":reversed_digits"],
        engine=kind,  # type: ignore[arg-type]
        max_new_tokens=6,
        steps=steps,
        lr=2e-3,
        target_score=None,
        eval_every=10_000,
        eval_size=16,
        report_to="none",
        run_dir=run_dir,
    )
    uvloop.run(run_pipeline(config, quiet=True))
    rows = [r for r in read_rows(run_dir) if r["step"] > 10]
    return (len(rows) - 1) / (rows[-1]["time"] - rows[0]["time"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", default=["builtin", "hf", "vllm"], choices=["builtin", "hf", "vllm"])
    parser.add_argument("--size", choices=list(SIZES), default="tiny")
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--transport", default="shm", choices=["shm", "cuda-ipc"])
    parser.add_argument("--vllm-dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the builtin and hf engines")
    parser.add_argument("--pipeline", type=int, default=0, metavar="STEPS", help="also time the pipeline per engine")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_task(os.path.join(tmp, args.size), args.size)
        for kind in args.engines:
            results[kind] = uvloop.run(measure_engine(kind, model_dir, args))
        if args.pipeline:
            folder = os.path.join(tmp, "task")
            build_task(folder, "tiny")
            for kind in args.engines:
                results[kind]["pipeline_steps_per_s"] = pipeline_steps_per_s(
                    kind, folder, args.pipeline, os.path.join(tmp, f"run-{kind}")
                )
    base = results.get("builtin")
    record: dict[str, Any] = {
        "bench": "engines",
        "size": args.size,
        "device": args.device,
        "repeat": args.repeat,
        "vllm_dtype": args.vllm_dtype,
    }
    for kind, r in results.items():
        record.update({f"{kind}_{k}": float(f"{v:.4g}") for k, v in r.items()})
        if base is not None:
            record[f"{kind}_tokens_ratio_to_builtin"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
    if not args.json:
        for kind, r in results.items():
            line = (
                f"{kind:8s} {r['tokens_per_s']:9.0f} tokens/s  mismatch {r['mismatch']:.2e}  "
                f"update {r['update_ms']:.2f} ms vs copy {r['copy_ms']:.2f} ms of {r['update_mb']:.1f} MB "
                f"({r['update_ratio']:.1f}x; goal <= 2x)  start {r['start_s']:.1f} s, first batch {r['first_batch_s']:.1f} s"
            )
            if "pipeline_steps_per_s" in r:
                line += f"  pipeline {r['pipeline_steps_per_s']:.2f} steps/s"
            print(line)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
