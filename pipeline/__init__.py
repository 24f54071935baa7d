"""An asynchronous GRPO pipeline on the ``actors`` runtime.

Generator xN -> Scorer -> RefModel -> Trainer, each an actor in its own
process, linked by typed ports; fresh weights go to the generators as
shared-memory (or CUDA IPC) manifests. The default task teaches a tiny
transformer to reverse digit strings; ``--task hf`` trains a Hugging Face
causal LM on the user's prompts with TRL-style reward functions
(:class:`HFTask`, the ``hf`` extra); ``--task bandit`` and user
:class:`Task` subclasses plug in the same way. Run it with
``python -m pipeline.grpo``.

The package is built in layers, each a subpackage that imports only those
below it (``docs/architecture.md``)::

    run        flags, placement, the launcher, metrics, trackers
    roles      the actors: Generator, Scorer, RefModel, Trainer; their messages
    learning   the Learner, checkpoints, the one-process baseline
    tasks      the Task interface, the built-in tasks, users' data and rewards
    models | config    models and engines | the run's Config and its checks
    algorithm  GRPO's mathematics on tensors
"""

from .config import Config
from .learning import Learner, ReferenceResult, Update, train_one_process
from .models import BuiltinEngine, Completions, Engine, GenerateEngine, SamplingParams, VLLMEngine, VLLMUnavailable
from .roles import Generator, GeneratorTimes, Grant, RefModel, Rollout, ScoredRollout, Scorer, StepReport, Trainer
from .run import PipelineError, Roles, RunResult, main, read_rows, run_pipeline
from .tasks import (
    BanditSamples,
    BanditTask,
    DigitsTask,
    HFBatch,
    HFTask,
    LossReport,
    RewardError,
    RewardSet,
    Scores,
    Task,
    TokenBatch,
    load_task,
    resolve,
    task_class,
    to_device,
)

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
    "read_rows",
    "resolve",
    "run_pipeline",
    "task_class",
    "to_device",
    "train_one_process",
]
