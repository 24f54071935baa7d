"""The built-in engine's decode paths side by side: completion tokens/s, the same tokens, the first batch's cost.

    python benchmarks/bench_decode.py                                   # CPU: dynamic and static, a small model
    python benchmarks/bench_decode.py --device cuda --shape qwen2.5-0.5b --dtype bfloat16 --prompts 32 --group 8 \\
        --new-tokens 64                                                 # the GPU figure: 256 x 64 tokens

A random Qwen2 of ``--shape`` (``small``: 8 layers of width 512; ``tiny``
and ``qwen2.5-0.5b``: examples/tiny_hf_model.py's shapes) samples
``--prompts`` prompts of 16-48 tokens x ``--group`` completions of
``--new-tokens`` tokens, in this process, with each ``--paths`` entry of
:class:`pipeline.models.BuiltinEngine`'s ``decode`` (default: dynamic and
static on a CPU, dynamic and graphs on a GPU; ``compiled`` compiles the step
with torch.compile first). Per path, as medians over ``--repeat`` batches
after one warm-up (which compiles and captures the step): completion
tokens/s and its ratio to ``dynamic`` (today's path, the baseline, measured
in the same run); whether every path drew the dynamic path's tokens for the
same seed, and the largest log-probability difference; the first batch's
seconds. With ``--profile``, one more batch of the last path under
``torch.profiler``: the operators that took the most device time and the
most host time (a decode launch-bound on the host shows there, not in the
device's column). One JSON line at the end.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
from typing import Any

import torch
from _profile import top_operators

from pipeline.models import BuiltinEngine, Completions, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8, "num_attention_heads": 8}


class Tokenizer:
    """Pad and end ids and a decode: all the engine asks of a tokenizer (no vocabulary file for a random model)."""

    pad_token_id = 0
    eos_token_id = 2

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def shape(name: str) -> dict[str, int]:
    if name == "small":
        return {**SMALL, "num_key_value_heads": 4, "vocab_size": 32_000}
    spec = importlib.util.spec_from_file_location("tiny_hf_model", os.path.join(ROOT, "examples", "tiny_hf_model.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {"vocab_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, **module.SHAPES[name]}


def build_model(name: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        **{**shape(name), "max_position_embeddings": 4096},
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=2,
        attn_implementation="sdpa",
    )
    return transformers.Qwen2ForCausalLM(config).to(device=device, dtype=dtype).eval().requires_grad_(False)


def timed(engine: BuiltinEngine, prompts: list[list[int]], params: SamplingParams, seed: int) -> tuple[float, Any]:
    device = next(engine.model.parameters()).device
    rng = torch.Generator(device=device).manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    out = engine.generate(prompts, params, rng)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started, out


def measure(
    model: torch.nn.Module, path: str, prompts: list[list[int]], params: SamplingParams, repeat: int
) -> tuple[dict[str, float], list[Completions]]:
    engine = BuiltinEngine(model, Tokenizer(), path)  # type: ignore[arg-type]
    first_s, _ = timed(engine, prompts, params, seed=-1)
    rates, outs = [], []
    for seed in range(repeat):
        seconds, out = timed(engine, prompts, params, seed)
        rates.append(float(out.mask.sum()) / seconds)
        outs.append(out)
    engine.decoding.close()
    return {"tokens_per_s": statistics.median(rates), "first_batch_s": first_s}, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["tiny", "small", "qwen2.5-0.5b"], default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--paths", nargs="+", choices=["dynamic", "static", "graphs", "compiled", "auto"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads on a CPU")
    parser.add_argument("--profile", action="store_true", help="the busiest operators of one more batch")
    parser.add_argument("--top", type=int, default=10, help="operators --profile lists per column (default 10)")
    args = parser.parse_args()
    if args.top < 1:
        parser.error(f"--top {args.top}: list at least one operator")
    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    paths = args.paths or (["dynamic", "graphs"] if cuda else ["dynamic", "static"])
    if "dynamic" not in paths:
        paths = ["dynamic", *paths]  # the baseline
    model = build_model(args.shape, args.device, getattr(torch, args.dtype))
    vocab = model.config.vocab_size  # type: ignore[union-attr]
    rng = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(3, vocab, (int(torch.randint(16, 49, (1,), generator=rng)),), generator=rng).tolist()
        for _ in range(args.prompts)
    ]
    params = SamplingParams(args.new_tokens, temperature=1.0, samples=args.group)
    results: dict[str, dict[str, float]] = {}
    draws: dict[str, list[Completions]] = {}
    for path in paths:
        results[path], draws[path] = measure(model, path, prompts, params, args.repeat)
    base = results["dynamic"]["tokens_per_s"]
    record: dict[str, Any] = {
        "bench": "decode",
        "shape": args.shape,
        "device": torch.cuda.get_device_name(args.device) if cuda else "cpu",
        "dtype": args.dtype,
        "rows": args.prompts * args.group,
        "new_tokens": args.new_tokens,
        "repeat": args.repeat,
    }
    for path, result in results.items():
        same = all(torch.equal(a.tokens, b.tokens) for a, b in zip(draws[path], draws["dynamic"], strict=True))
        gap = max(float((a.logps - b.logps).abs().max()) for a, b in zip(draws[path], draws["dynamic"], strict=True))
        ratio = result["tokens_per_s"] / base
        print(
            f"{path:8s} {result['tokens_per_s']:9.0f} completion tokens/s ({ratio:.2f}x dynamic)  "
            f"same tokens {same}, log-prob gap {gap:.1e}  first batch {result['first_batch_s']:.2f} s"
        )
        record.update(
            {
                f"{path}_tokens_per_s": round(result["tokens_per_s"], 1),
                f"{path}_ratio": round(ratio, 3),
                f"{path}_same_tokens": same,
                f"{path}_logp_gap": float(f"{gap:.3g}"),
                f"{path}_first_batch_s": round(result["first_batch_s"], 3),
            }
        )
    if args.profile:
        record["profile"] = profile(model, paths[-1], prompts, params, args.top)
    print(json.dumps(record))


def profile(
    model: torch.nn.Module, path: str, prompts: list[list[int]], params: SamplingParams, top: int
) -> dict[str, Any]:
    """One batch of ``path`` (after a warm-up that captures its graph) under the profiler: the busiest operators."""
    engine = BuiltinEngine(model, Tokenizer(), path)  # type: ignore[arg-type]
    timed(engine, prompts, params, seed=-1)
    device = next(model.parameters()).device
    batch = lambda: engine.generate(prompts, params, torch.Generator(device=device).manual_seed(0))  # noqa: E731
    wall_s, _ = timed(engine, prompts, params, seed=0)
    found = {
        "path": path,
        "wall_ms": round(wall_s * 1e3, 2),
        "by_device": top_operators(batch, device, top, by="device"),
        "by_host": top_operators(batch, device, top, by="cpu"),
    }
    engine.decoding.close()
    for column in ("by_device", "by_host"):
        print(f"{path}, one batch of {found['wall_ms']} ms: the busiest operators {column.replace('_', ' ')}")
        for op in found[column]:
            print(f"    {op['ms']:9.2f} ms  {op['share']:6.1%}  x{op['calls']:<5} {op['op']}")
    return found


if __name__ == "__main__":
    main()
