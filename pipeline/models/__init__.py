"""What generates and scores text: the tiny built-in transformer, Hugging Face causal LMs, the engines.

An engine turns prompts into completions with their behaviour
log-probabilities: the built-in sampler (``builtin``), transformers'
``generate`` (``hf``) or vLLM (``vllm``); :func:`build_engine` picks one
by name. May import :mod:`pipeline.algorithm` and the runtime's weights
(an engine installs updates).
"""

from ._causal_lm import (
    CompletionLogps,
    ModelError,
    causal_logps,
    check_model,
    load_model,
    load_tokenizer,
    positions,
    require_transformers,
)
from ._choice import VLLMOptions, build_engine
from ._engines import (
    BuiltinEngine,
    Completions,
    Engine,
    GenerateEngine,
    SamplingParams,
    decode_completions,
    end_tokens,
    left_pad,
)
from ._tiny import PRESETS, Generation, ModelConfig, TinyTransformer, completion_logps, generate
from ._vllm import VLLMEngine, VLLMUnavailable, import_vllm, logprobs_mode, vllm_missing

__all__ = [
    "PRESETS",
    "BuiltinEngine",
    "CompletionLogps",
    "Completions",
    "Engine",
    "GenerateEngine",
    "Generation",
    "ModelConfig",
    "ModelError",
    "SamplingParams",
    "TinyTransformer",
    "VLLMEngine",
    "VLLMOptions",
    "VLLMUnavailable",
    "build_engine",
    "causal_logps",
    "check_model",
    "completion_logps",
    "decode_completions",
    "end_tokens",
    "generate",
    "import_vllm",
    "left_pad",
    "load_model",
    "load_tokenizer",
    "logprobs_mode",
    "positions",
    "require_transformers",
    "vllm_missing",
]
