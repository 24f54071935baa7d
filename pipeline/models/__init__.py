"""What generates and scores text: the tiny built-in transformer, Hugging Face causal LMs, the engines, reward models.

An engine turns prompts into completions with their behaviour
log-probabilities: the built-in sampler (``builtin``), transformers'
``generate`` (``hf``) or vLLM (``vllm``); :func:`build_engine` picks one
by name. May import :mod:`pipeline.algorithm` and the runtime's weights
(an engine installs updates).
"""

from ._blocks import compile_blocks, repeated_blocks
from ._causal_lm import (
    CompletionLogps,
    ModelError,
    causal_logps,
    check_model,
    first_line,
    load_model,
    load_tokenizer,
    position_limit,
    positions,
    require_transformers,
)
from ._choice import VLLMOptions, build_engine
from ._compiler import missing_compiler, require_compiler
from ._decode_choice import DECODE_PATHS, DecodePath, DecoderChoice
from ._decoders import Decoder, DynamicDecoder, ModelCall, StaticDecoder, static_refusal
from ._dropout import disable_dropout
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
from ._export_dtype import cast_state, record_dtype, recorded_dtype
from ._held_weights import hold_weights, weights_dtype
from ._lora import LoraAdapter, check_lora_targets, require_peft
from ._reward_model import RewardModel
from ._saved_folder import process_tag, replace_folder, staging_folder, sync_path, tag_alive
from ._tiny import PRESETS, Generation, ModelConfig, TinyTransformer, completion_logps, generate
from ._vllm import VLLMEngine, VLLMUnavailable, import_vllm, logprobs_mode, vllm_missing

__all__ = [
    "DECODE_PATHS",
    "PRESETS",
    "BuiltinEngine",
    "CompletionLogps",
    "Completions",
    "DecodePath",
    "Decoder",
    "DecoderChoice",
    "DynamicDecoder",
    "Engine",
    "GenerateEngine",
    "Generation",
    "LoraAdapter",
    "ModelCall",
    "ModelConfig",
    "ModelError",
    "RewardModel",
    "SamplingParams",
    "StaticDecoder",
    "TinyTransformer",
    "VLLMEngine",
    "VLLMOptions",
    "VLLMUnavailable",
    "build_engine",
    "cast_state",
    "causal_logps",
    "check_lora_targets",
    "check_model",
    "compile_blocks",
    "completion_logps",
    "decode_completions",
    "disable_dropout",
    "end_tokens",
    "first_line",
    "generate",
    "hold_weights",
    "import_vllm",
    "left_pad",
    "load_model",
    "load_tokenizer",
    "logprobs_mode",
    "missing_compiler",
    "position_limit",
    "positions",
    "process_tag",
    "record_dtype",
    "recorded_dtype",
    "repeated_blocks",
    "replace_folder",
    "require_compiler",
    "require_peft",
    "require_transformers",
    "staging_folder",
    "static_refusal",
    "sync_path",
    "tag_alive",
    "vllm_missing",
    "weights_dtype",
]
