"""What is learned: the :class:`Task` interface the roles call, and the tasks that implement it.

The built-in digit tasks and bandit, the user's Hugging Face task with its
prompt data and TRL-style reward functions, GRPO's loss over completions
that token tasks share, and the registry that turns ``--task`` into a
class. May import :mod:`pipeline.models`, :mod:`pipeline.config` and
:mod:`pipeline.algorithm`.
"""

from ._bandit import BanditSamples, BanditTask
from ._completion_loss import completion_loss, loss_spec
from ._data import DataError, PromptData, PromptRoom, load_rows, split_held_out
from ._digit_task import DigitsTask, TokenBatch
from ._digits import BOS, DIGIT_TASKS, EOS, PAD, PLUS, SEP, VOCAB, DigitProblem, Verdict, verify
from ._hf import HFBatch, HFTask
from ._interface import LossReport, Scores, Task, to_device
from ._registry import load_task, resolve, task_class
from ._reward_log import RewardLog
from ._rewards import (
    BUILTINS,
    REWARD_STATISTICS,
    RewardError,
    RewardFunction,
    RewardPlacement,
    RewardSet,
    RewardState,
    exact_match,
    final_number,
    load_reward,
    parse_spec,
    think_answer_format,
)
from ._task_settings import HF_DATA, SAMPLER, check_task_settings, found_task

__all__ = [
    "BOS",
    "BUILTINS",
    "DIGIT_TASKS",
    "EOS",
    "HF_DATA",
    "PAD",
    "PLUS",
    "REWARD_STATISTICS",
    "SAMPLER",
    "SEP",
    "VOCAB",
    "BanditSamples",
    "BanditTask",
    "DataError",
    "DigitProblem",
    "DigitsTask",
    "HFBatch",
    "HFTask",
    "LossReport",
    "PromptData",
    "PromptRoom",
    "RewardError",
    "RewardFunction",
    "RewardLog",
    "RewardPlacement",
    "RewardSet",
    "RewardState",
    "Scores",
    "Task",
    "TokenBatch",
    "Verdict",
    "check_task_settings",
    "completion_loss",
    "exact_match",
    "final_number",
    "found_task",
    "load_reward",
    "load_rows",
    "load_task",
    "loss_spec",
    "parse_spec",
    "resolve",
    "split_held_out",
    "task_class",
    "think_answer_format",
    "to_device",
    "verify",
]
