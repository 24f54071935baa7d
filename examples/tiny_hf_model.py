"""Build a small random Hugging Face model, a task and a reward file to try ``--task hf`` offline.

    python examples/tiny_hf_model.py runs/tiny-hf             # Qwen2-style; --arch llama for Llama
    python examples/tiny_hf_model.py runs/tiny-hf --heads 2   # for --engine vllm on a CPU (head width 32)
    python examples/tiny_hf_model.py runs/qwen-shape --shape qwen2.5-0.5b   # 494 M parameters, for a GPU
    python -m pipeline.grpo --model runs/tiny-hf/model --dataset runs/tiny-hf/train.jsonl \\
        --reward runs/tiny-hf/rewards.py:reversed_digits --lr 1e-3 --max-new-tokens 6 --steps 300

writes, into DIR:

- ``model/``: a randomly initialised causal LM (about 100 k parameters) with a
  character-level tokenizer built with ``tokenizers`` and a chat template,
  loadable by ``AutoModelForCausalLM`` / ``AutoTokenizer``;
- ``train.jsonl``: prompts ``"reverse:4821="`` with an ``answer`` column
  (``"1284"``); ``--chat`` writes the prompts as chat messages instead;
- ``rewards.py``: ``reversed_digits``, a reward function in TRL's signature
  (1 for the exact answer; partial credit for digits in place and for the right length).

Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import random

#: Every character the tokenizer knows, after its special tokens.
CHARACTERS = list("0123456789=+ abcdefghijklmnopqrstuvwxyz:,.?!<>/")
SPECIAL = ["<pad>", "<bos>", "<eos>"]
#: Renders chat messages as plain text; the generation prompt is the empty assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'][0] }}:{{ message['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)

REWARDS = '''"""Reward functions for the example task, in TRL's signature."""


def _text(completion):
    return completion if isinstance(completion, str) else completion[-1]["content"]


def reversed_digits(prompts, completions, answer, log_metric=None, log_extra=None, **kwargs):
    """1 for the reversed digits exactly; else 0.2 per digit in its place and 0.2 for the right length.

    Logs the share of exact answers as a metric and each completion's expected
    answer beside it (TRL's log_metric and log_extra, which the pipeline passes too).
    """
    rewards, got = [], [_text(completion).strip() for completion in completions]
    for text, expected in zip(got, answer):
        in_place = sum(a == b for a, b in zip(text, expected))
        rewards.append(0.2 * in_place / len(expected) * 4 + 0.2 * (len(text) == len(expected)))
    if log_metric is not None:
        log_metric("reversed_digits/exact", sum(t == e for t, e in zip(got, answer)) / len(got))
    if log_extra is not None:
        log_extra("expected", list(answer))
    return rewards
'''


def build_tokenizer(folder: str):  # type: ignore[no-untyped-def]
    """A character-level fast tokenizer with pad, bos and eos tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + CHARACTERS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return tokenizer


#: Model shapes: ``tiny`` (about 100 k parameters, the tokenizer's own vocabulary), ``tiny-real-vocab`` (the same
#: layers under Qwen's 151,936-token head: where a CPU step's time goes at a real vocabulary), and Qwen2.5-0.5B's
#: (494 M parameters, its 151,936-token vocabulary; random weights, for memory and speed on a GPU).
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2},
    "tiny-real-vocab": {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "vocab_size": 151_936},
    "qwen2.5-0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151_936,
        "max_position_embeddings": 32_768,
    },
}


def build_model(folder: str, arch: str, vocab: int, seed: int, heads: int = 4, shape_name: str = "tiny") -> int:
    """A random causal LM of the chosen architecture and shape saved to ``folder``; returns its parameter count."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    shape = {
        "vocab_size": vocab,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "max_position_embeddings": 128,
        "tie_word_embeddings": True,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **SHAPES[shape_name],
    }
    if arch == "llama":
        config = transformers.LlamaConfig(**shape)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**shape)
        model = transformers.Qwen2ForCausalLM(config)
    model.save_pretrained(folder, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def write_task(folder: str, rows: int, digits: int, chat: bool, seed: int) -> str:
    """``rows`` distinct digit-reversal prompts as JSONL; the path."""
    if digits < 1 or not 1 <= rows <= 10**digits:
        raise ValueError(f"give 1 to 10**digits rows, and at least 1 digit ({10 ** max(digits, 0)} such numbers)")
    rng = random.Random(seed)
    seen: set[str] = set()
    while len(seen) < rows:
        seen.add("".join(rng.choice("0123456789") for _ in range(digits)))
    path = os.path.join(folder, "train.jsonl")
    with open(path, "w") as f:
        for number in sorted(seen, key=lambda _: rng.random()):
            text = f"reverse:{number}="
            prompt: object = [{"role": "user", "content": text}] if chat else text
            f.write(json.dumps({"prompt": prompt, "answer": number[::-1]}) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--arch", choices=["qwen2", "llama"], default="qwen2")
    parser.add_argument("--rows", type=int, default=2000, help="prompts in train.jsonl (default 2000)")
    parser.add_argument("--digits", type=int, default=4)
    parser.add_argument("--chat", action="store_true", help="prompts as chat messages")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--heads", type=int, default=4, help="attention heads of width 64/heads (vLLM's CPU backend needs 2: width 32)"
    )
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="tiny",
        help="the model's shape: tiny (default), tiny-real-vocab (tiny's layers, a 151,936-token head) or "
        "qwen2.5-0.5b (494 M parameters, a 151,936-token vocabulary; for a GPU)",
    )
    args = parser.parse_args(argv)
    os.makedirs(args.folder, exist_ok=True)
    try:  # (the prompts first: a task its digits cannot make is refused before any model is built)
        data = write_task(args.folder, args.rows, args.digits, args.chat, args.seed)
    except ValueError as exc:
        parser.error(f"--rows {args.rows} --digits {args.digits}: {exc}")
    model_dir = os.path.join(args.folder, "model")
    os.makedirs(model_dir, exist_ok=True)
    tokenizer = build_tokenizer(model_dir)
    parameters = build_model(model_dir, args.arch, len(tokenizer), args.seed, args.heads, args.shape)
    rewards = os.path.join(args.folder, "rewards.py")
    with open(rewards, "w") as f:
        f.write(REWARDS)
    print(f"model: {model_dir} ({args.arch}, {parameters:,} parameters); prompts: {data}; rewards: {rewards}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
