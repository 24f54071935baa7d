"""An asynchronous GRPO pipeline on the ``actors`` runtime.

Generator xN -> Scorer -> RefModel -> Trainer, each an actor in its own
process, linked by typed ports; fresh weights go to the generators as
shared-memory (or CUDA IPC) manifests. The default task teaches a tiny
transformer to reverse digit strings; ``--task hf`` trains a Hugging Face
causal LM on the user's prompts with TRL-style reward functions
(:class:`HFTask`, the ``hf`` extra); ``--task bandit`` and user
:class:`Task` subclasses plug in the same way. Run it with
``python -m pipeline.grpo``.
"""

from typing import TYPE_CHECKING, Any

from .bandit import BanditSamples, BanditTask
from .engines import BuiltinEngine, Completions, Engine, GenerateEngine, SamplingParams
from .hf_task import HFBatch, HFTask
from .learner import Learner, Update
from .messages import Config, GeneratorTimes, Grant, Rollout, ScoredRollout, StepReport
from .reference import ReferenceResult, train_one_process
from .rewards import RewardError, RewardSet
from .roles import Generator, RefModel, Scorer
from .task import LossReport, Scores, Task, load_task, resolve, task_class, to_device
from .token_task import DigitsTask, TokenBatch
from .trainer import Trainer
from .vllm_engine import VLLMEngine, VLLMUnavailable

if TYPE_CHECKING:
    from .grpo import PipelineError, Roles, RunResult, main, run_pipeline

_LAUNCHER = {"PipelineError", "Roles", "RunResult", "main", "run_pipeline"}


def __getattr__(name: str) -> Any:
    # The launcher loads on first use, so ``python -m pipeline.grpo`` runs it
    # as __main__ without the package having imported it first.
    if name in _LAUNCHER:
        from . import grpo

        return getattr(grpo, name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")


__all__ = [
    "BanditSamples",
    "BanditTask",
    "BuiltinEngine",
    "Completions",
    "Config",
    "DigitsTask",
    "Engine",
    "GenerateEngine",
    "Generator",
    "GeneratorTimes",
    "Grant",
    "HFBatch",
    "HFTask",
    "Learner",
    "LossReport",
    "PipelineError",
    "RefModel",
    "ReferenceResult",
    "RewardError",
    "RewardSet",
    "Roles",
    "Rollout",
    "RunResult",
    "SamplingParams",
    "ScoredRollout",
    "Scorer",
    "Scores",
    "StepReport",
    "Task",
    "TokenBatch",
    "Trainer",
    "Update",
    "VLLMEngine",
    "VLLMUnavailable",
    "load_task",
    "main",
    "resolve",
    "run_pipeline",
    "task_class",
    "to_device",
    "train_one_process",
]
