"""Where a trainer step's time goes: the pipeline's GRPO update of a Hugging Face model, against its body's alone.

    python benchmarks/bench_train_step.py                                  # CPU: the example's tiny model
    python benchmarks/bench_train_step.py --shape tiny-real-vocab --prompts 8 --compile   # CPU, a 151,936 head
    python benchmarks/bench_train_step.py --model runs/qwen-shape --device cuda --dtype bfloat16 \\
        --prompts 32 --group 8 --new-tokens 64 --profile                   # the GPU round's step (issue 40)

Builds the trainer's :class:`pipeline.learning.Learner` for ``--task hf`` on
``--model`` (a folder ``examples/tiny_hf_model.py`` wrote; built in a
temporary folder at ``--shape`` when not given) and times its ``update`` —
the trainer's whole step: the policy's forward and backward in passes of
``--max-tokens-per-pass`` tokens, the head's log-probs in chunks, the GRPO
loss, gradient clipping and Adam — on one synthetic rollout of
``--prompts`` x ``--group`` completions of ``--new-tokens`` random tokens
after the dataset's prompts (nothing is generated). The raw baseline,
measured in the same run on the same tokens in the same passes: the model's
body (its transformer layers, no output head) forward and backward under
the same autocast, and the same Adam step. Prints medians over ``--repeat``
steps after one warm-up, the ratio step / baseline, the trained tokens/s,
and with ``--profile`` the operators that took the most time in one more step
(``torch.profiler``: device time on a GPU, CPU time otherwise). With
``--compile``, a second learner whose blocks and head chunks
``torch.compile`` compiled (``--compile`` in the pipeline) takes the same
steps beside the first: its
median, its first step (the compiler's time) and, with ``--profile``, its
operators. One JSON line at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from _profile import top_operators

from pipeline import Config, resolve
from pipeline.learning import Learner
from pipeline.models import positions
from pipeline.tasks import HFBatch, HFTask, load_task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_example(folder: str, shape: str) -> str:
    """examples/tiny_hf_model.py's model, prompts and reward file at ``shape`` in ``folder``; the folder."""
    spec = importlib.util.spec_from_file_location("tiny_hf_model", os.path.join(ROOT, "examples", "tiny_hf_model.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main([folder, "--shape", shape, "--rows", "200"])
    return folder


def rollout(task: HFTask, device: torch.device, new_tokens: int, seed: int = 0) -> tuple[HFBatch, torch.Tensor]:
    """One synthetic rollout on ``device``: the dataset's first prompts, left-padded, and random completions with
    random behaviour log-probs and rewards (the update's cost does not depend on what the tokens say)."""
    config = task.config
    rng = torch.Generator().manual_seed(seed)
    data = task.train_data
    prompts = [data.prompt_ids(row) for row in data.rows_for(0, config.prompts, config.seed)]
    width = max(len(ids) for ids in prompts)
    padded = torch.zeros(len(prompts), width, dtype=torch.long)
    prompt_mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, ids in enumerate(prompts):
        padded[row, width - len(ids) :] = torch.tensor(ids)
        prompt_mask[row, width - len(ids) :] = 1
    rows = len(prompts) * config.group
    vocab = int(task.tokenizer.vocab_size)
    completions = torch.randint(3, vocab, (rows, new_tokens), generator=rng)
    batch = HFBatch(
        rows=torch.arange(len(prompts), device=device),
        tokens=torch.cat([padded.repeat_interleave(config.group, 0), completions], 1).to(device),
        prompt_mask=prompt_mask.repeat_interleave(config.group, 0).to(device),
        logps=(-4 * torch.rand(rows, new_tokens, generator=rng)).to(device),
        mask=torch.ones(rows, new_tokens, device=device),
        truncated=torch.zeros(rows, dtype=torch.bool, device=device),
        texts=[""] * rows,
        group=config.group,
    )
    return batch, torch.rand(rows, generator=rng).to(device)


def body_step(learner: Learner, samples: HFBatch) -> None:
    """The raw baseline: the policy's body forward and backward over the same passes, with the update's attention
    mask and positions (left-padded prompts), then Adam."""
    policy, task, dtype = learner.policy, learner.task, learner.compute_dtype
    body = policy.get_decoder()  # type: ignore[operator]
    learner.optim.zero_grad()
    completion = samples.tokens.shape[1] - samples.prompt_mask.shape[1]
    attention = torch.cat([samples.prompt_mask, torch.ones_like(samples.tokens[:, -completion:])], 1)[:, :-1]
    for rows in task.micro_batches(samples, learner.micro_batch, learner.max_tokens):
        autocast = (
            torch.autocast(learner.device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
        )
        with autocast:
            mask = attention[rows]
            out = body(input_ids=samples.tokens[rows, :-1], attention_mask=mask, position_ids=positions(mask))
        out.last_hidden_state.float().square().mean().backward()  # type: ignore[no-untyped-call]
    learner.optim.step()


def timed(step: Callable[[], Any], device: torch.device, repeat: int, *, warm: bool = True) -> list[float]:
    """Seconds of each of ``repeat`` calls of ``step`` after one warm-up (``warm=False``: the caller's), the device's
    queue drained each time."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if warm:
        step()
    seconds = []
    for _ in range(repeat):
        sync()
        started = time.perf_counter()
        step()
        sync()
        seconds.append(time.perf_counter() - started)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a folder examples/tiny_hf_model.py wrote (default: built at --shape)")
    parser.add_argument("--shape", choices=["tiny", "tiny-real-vocab", "qwen2.5-0.5b"], default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-tokens-per-pass", type=int, default=Config().max_tokens_per_pass)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="list the operators that took the most time")
    parser.add_argument("--top", type=int, default=12, help="operators --profile lists (default 12)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on a CPU")
    parser.add_argument("--compile", action="store_true", help="also time a learner with --compile")
    args = parser.parse_args()
    if args.repeat < 1 or args.prompts < 1 or args.group < 2 or args.new_tokens < 1:
        parser.error("--repeat, --prompts and --new-tokens must be at least 1, --group at least 2")
    if args.top < 1:
        parser.error(f"--top {args.top}: list at least one operator")
    torch.set_num_threads(args.threads)
    with contextlib.ExitStack() as stack:
        folder = args.model or build_example(stack.enter_context(tempfile.TemporaryDirectory()), args.shape)
        settings = dict(
            task="hf",
            model=os.path.join(folder, "model"),
            dataset=os.path.join(folder, "train.jsonl"),
            rewards=[os.path.join(folder, "rewards.py") + ":reversed_digits"],
            prompts=args.prompts,
            group=args.group,
            max_new_tokens=args.new_tokens,
            max_tokens_per_pass=args.max_tokens_per_pass,
            dtype=args.dtype,
            device=args.device,
            lr=1e-6,
        )
        task = load_task(resolve(Config(**settings)))  # type: ignore[arg-type]
        assert isinstance(task, HFTask)
        device = torch.device(args.device)
        learner = Learner(task, device)
        samples, rewards = rollout(task, device, args.new_tokens)

        def step() -> None:
            learner.update(samples, rewards, None)

        step_s = statistics.median(timed(step, device, args.repeat))
        body_s = statistics.median(timed(lambda: body_step(learner, samples), device, args.repeat))
        operators = top_operators(step, device, args.top) if args.profile else []
        compiled = measure_compiled(settings, device, samples, rewards, args) if args.compile else {}
    tokens = int(samples.tokens.numel())
    parameters = sum(p.numel() for p in learner.policy.parameters())
    passes = len(task.micro_batches(samples, learner.micro_batch, learner.max_tokens))
    where = f"{args.device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else args.device
    print(
        f"trainer step, {parameters / 1e6:.1f} M parameters, {args.dtype}, {samples.tokens.shape[0]} rows x "
        f"{samples.tokens.shape[1]} tokens in {passes} passes, on {where}, medians of {args.repeat}:"
    )
    print(f"  the pipeline's update:          {step_s * 1e3:9.1f} ms   {tokens / step_s:12,.0f} tokens/s")
    print(f"  its body's fwd+bwd + Adam (raw): {body_s * 1e3:9.1f} ms   ratio update / raw {step_s / body_s:.2f}")
    print(f"  6 x parameters x tokens / update: {6 * parameters * tokens / step_s / 1e12:.2f} TFLOP/s")
    for op in operators:
        print(f"    {op['ms']:9.2f} ms  {op['share']:6.1%}  x{op['calls']:<5} {op['op']}")
    if compiled:
        print(
            f"  the update, --compile:           {compiled['step_ms']:9.1f} ms   {step_s * 1e3 / compiled['step_ms']:.2f}x "
            f"the eager update; its first step {compiled['first_s']:.1f} s"
        )
        for op in compiled["top_ops"]:
            print(f"    {op['ms']:9.2f} ms  {op['share']:6.1%}  x{op['calls']:<5} {op['op']}")
    record = {
        "bench": "train_step",
        "device": where,
        "dtype": args.dtype,
        "parameters": parameters,
        "rows": int(samples.tokens.shape[0]),
        "tokens": tokens,
        "passes": passes,
        "step_ms": round(step_s * 1e3, 2),
        "raw_body_ms": round(body_s * 1e3, 2),
        "ratio": round(step_s / body_s, 3),
        "tokens_per_s": round(tokens / step_s),
        "top_ops": operators,
    }
    if compiled:
        record.update(
            compiled_step_ms=compiled["step_ms"],
            compiled_speedup=round(step_s * 1e3 / compiled["step_ms"], 3),
            compiled_first_s=compiled["first_s"],
            compiled_top_ops=compiled["top_ops"],
        )
    print(json.dumps(record))


def measure_compiled(
    settings: dict[str, Any], device: torch.device, samples: HFBatch, rewards: torch.Tensor, args: argparse.Namespace
) -> dict[str, Any]:
    """A second learner with ``--compile`` (blocks and head chunks), on the same rollout: its median step, its first
    step's seconds (the compiler's), and with ``--profile`` its busiest operators."""
    task = load_task(resolve(Config(**{**settings, "compile": True})))  # type: ignore[arg-type]
    learner = Learner(task, device)

    def step() -> None:
        learner.update(samples, rewards, None)

    (first_s,) = timed(step, device, 1, warm=False)  # the compiler's step: the warm-up of those timed next
    step_s = statistics.median(timed(step, device, args.repeat, warm=False))
    operators = top_operators(step, device, args.top) if args.profile else []
    return {"step_ms": round(step_s * 1e3, 2), "first_s": round(first_s, 2), "top_ops": operators}


if __name__ == "__main__":
    main()
