"""Reward functions in TRL's signature: loading them by name, calling them with a deadline, combining them.

A reward function is called as TRL's ``GRPOTrainer`` calls it, by keyword:
``f(prompts=..., completions=..., completion_ids=..., trainer_state=..., **columns) -> list[float | None]``
(a function without ``**kwargs`` gets only the names it takes), or is a reward model
(:class:`pipeline.models.RewardModel`, named by its folder or Hub name): ``prompts`` as the dataset holds them
(text, or chat messages), ``completions`` as text, or as a one-message list
``[{"role": "assistant", "content": text}]`` when the prompts are messages,
and every other dataset column as a keyword argument, one value per
completion. ``None`` means "not applicable": the weighted sum skips it
(TRL's ``nansum``). Functions may be ``async def``. Named on the command line
as ``module:function`` or ``path/to/file.py:function``, optionally
``=WEIGHT``, or by a built-in name (:data:`BUILTINS`).

The scorer awaits them off its event loop's thread (a synchronous one runs in
a worker thread), each with a deadline; a function that raises, returns the
wrong number of values or misses its deadline fails the run with a
:class:`RewardError` naming it.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ..algorithm import nan_moments
from ..models import ModelError, RewardModel
from ._blocking_loop import BlockingLoop
from ._reward_log import RewardLog, is_scalar

__all__ = [
    "BUILTINS",
    "REWARD_STATISTICS",
    "RewardError",
    "RewardFunction",
    "RewardPlacement",
    "RewardSet",
    "RewardState",
    "exact_match",
    "final_number",
    "load_reward",
    "parse_spec",
    "think_answer_format",
]


#: Said of a synchronous reward function that set a signal handler (``math_verify``'s default timeouts do).
SIGNAL_HINT = (
    " (a synchronous reward function runs in a worker thread, so the scorer's event loop keeps serving, and only "
    "the main thread may set signal handlers: give math_verify's parse and verify parsing_timeout=None and "
    "timeout_seconds=None, as TRL's accuracy_reward does off the main thread, and bound the time with "
    "--reward-timeout)"
)


T = TypeVar("T")


class RewardError(RuntimeError):
    """A reward function that cannot be loaded, or failed while scoring; the message names it."""


# -- built-ins ------------------------------------------------------------------------------------------------


def _text(completion: Any) -> str:
    """A completion's text, whether it came as a string or as chat messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def exact_match(prompts: list[Any], completions: list[Any], answer: list[Any], **_: Any) -> list[float | None]:
    """1 where the completion, stripped, equals the ``answer`` column; None where a row has no answer.

    A numeric answer (a column ``datasets`` read as numbers: ``42.0`` for 42) matches a completion that reads
    as the same number.
    """
    return [
        None if a is None else float(_same_answer(_text(c).strip(), a))
        for c, a in zip(completions, answer, strict=True)
    ]


def _same_answer(text: str, answer: Any) -> bool:
    if isinstance(answer, numbers.Real) and not isinstance(answer, bool):
        try:
            return math.isclose(float(text.replace(",", "")), float(answer), rel_tol=0, abs_tol=1e-9)
        except ValueError:
            return False
    return text == str(answer).strip()


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _last_number(text: str) -> float | None:
    """The last number in ``text`` (GSM8K's answers end with ``#### 42``); None if there is none."""
    found = _NUMBER.findall(text.split("####")[-1]) or _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def final_number(prompts: list[Any], completions: list[Any], answer: list[Any], **_: Any) -> list[float | None]:
    """1 where the last number of the completion equals the ``answer`` column's final number (GSM8K style)."""
    rewards: list[float | None] = []
    for completion, reference in zip(completions, answer, strict=True):
        expected = None if reference is None else _last_number(str(reference))
        if expected is None:
            rewards.append(None)
            continue
        got = _last_number(_text(completion))
        rewards.append(float(got is not None and math.isclose(got, expected, rel_tol=0, abs_tol=1e-6)))
    return rewards


_THINK_ANSWER = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def think_answer_format(prompts: list[Any], completions: list[Any], **_: Any) -> list[float | None]:
    """1 where the completion is ``<think>…</think><answer>…</answer>`` (the format reward of R1-style runs)."""
    return [float(bool(_THINK_ANSWER.match(_text(c)))) for c in completions]


#: Reward functions ``--reward`` knows by name.
BUILTINS: dict[str, Callable[..., list[float | None]]] = {
    "exact_match": exact_match,
    "final_number": final_number,
    "think_answer_format": think_answer_format,
}


# -- loading --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RewardState:
    """What a reward function reads of TRL's ``trainer_state``: the step (``global_step``: the step the scored
    rollout trains; at a held-out evaluation the updates made so far, -1 when none is named), the run's last (``max_steps``), the passes over the dataset so
    far and in all (``epoch``, ``num_train_epochs``: prompts drawn / the dataset's rows, as TRL's fractional epoch),
    and which process scores (the only one: ``is_world_process_zero`` and ``is_local_process_zero`` are True)."""

    global_step: int = -1
    max_steps: int = 0
    epoch: float = 0.0
    num_train_epochs: float = 0.0
    is_world_process_zero: bool = True
    is_local_process_zero: bool = True

    @classmethod
    def at(cls, step: int, max_steps: int, prompts_per_step: int, rows: int) -> RewardState:
        """The state at ``step`` (-1: none named) of a run drawing ``prompts_per_step`` of ``rows``."""
        per_row = prompts_per_step / max(1, rows)
        return cls(step, max_steps, max(0, step) * per_row, max_steps * per_row)


@dataclass(frozen=True)
class RewardFunction:
    """A loaded reward function, its name (``reward/<name>`` in the metrics) and weight."""

    name: str
    source: str
    function: Callable[..., Any]
    weight: float = 1.0

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.function)

    def keywords(self, offered: dict[str, Any]) -> dict[str, Any]:
        """The keywords it takes of those ``offered``: all of them if it has ``**kwargs``, else those it names."""
        parameters = inspect.signature(self.function).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            return offered
        return {name: value for name, value in offered.items() if name in parameters}


def parse_spec(spec: str) -> tuple[str, float]:
    """``source[=weight]`` split into its source and weight."""
    source, sep, weight = spec.rpartition("=") if "=" in spec else (spec, "", "")
    if not sep:
        return spec, 1.0
    try:
        value = float(weight)
    except ValueError:
        raise RewardError(f"--reward {spec}: the weight after '=' must be a number") from None
    if not math.isfinite(value):  # (a NaN weight made every summed reward 0: nothing was learned, without a word)
        raise RewardError(f"--reward {spec}: the weight after '=' must be a finite number, not {weight}")
    return source, value


@dataclass(frozen=True)
class RewardPlacement:
    """Where a reward model named among the rewards runs: the scoring process's device, its dtype, whether its
    own code may run (``--trust-remote-code``), and its chat template's variables (``--chat-template-kwargs``)."""

    device: torch.device | str = "cpu"
    dtype: torch.dtype = torch.float32
    trust_remote_code: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # its chat template's variables


def _import(source: str, placement: RewardPlacement) -> Callable[..., Any]:
    if source in BUILTINS:
        return BUILTINS[source]
    location, sep, attribute = source.rpartition(":")
    if not sep:  # a folder or a Hub name: a reward model, as TRL's reward_funcs may name one
        if not os.path.isdir(source) and "/" not in source:  # no built-in, no folder, no org/name
            raise RewardError(
                f"--reward {source}: no built-in of that name ({', '.join(BUILTINS)}); a function is module:function "
                "or path/to/file.py:function, a reward model its folder or Hub name (org/name)"
            )
        try:
            return RewardModel(
                source, placement.device, placement.dtype, placement.trust_remote_code, placement.chat_template_kwargs
            )
        except ModelError as exc:
            raise RewardError(
                f"{exc}; a reward is module:function, path/to/file.py:function, one of {', '.join(BUILTINS)}, or "
                "a reward model"
            ) from None
    if not location or not attribute:
        raise RewardError(
            f"--reward {source}: use module:function, path/to/file.py:function, one of {', '.join(BUILTINS)}, or a "
            "reward model's folder or Hub name"
        )
    try:
        if location.endswith(".py"):
            if not os.path.isfile(location):
                raise RewardError(f"--reward {source}: no file {location}")
            module_name = f"_reward_{abs(hash(os.path.abspath(location)))}"
            module = sys.modules.get(module_name)
            if module is None:
                spec = importlib.util.spec_from_file_location(module_name, location)
                if spec is None or spec.loader is None:
                    raise RewardError(f"--reward {source}: {location} cannot be imported")
                module = importlib.util.module_from_spec(spec)
                sys.modules[module_name] = module
                spec.loader.exec_module(module)
        else:
            module = importlib.import_module(location)
    except RewardError:
        raise
    except Exception as exc:  # the user's module failed to import: say so in one line
        raise RewardError(f"--reward {source}: importing {location} failed: {type(exc).__name__}: {exc}") from None
    function = getattr(module, attribute, None)
    if function is None:
        raise RewardError(f"--reward {source}: {location} has no {attribute!r}")
    if not callable(function):
        raise RewardError(f"--reward {source}: {attribute!r} is not callable")
    return function  # type: ignore[no-any-return]


def load_reward(spec: str, placement: RewardPlacement | None = None) -> RewardFunction:
    """The reward function ``spec`` names, its signature checked against TRL's (a reward model placed as given)."""
    source, weight = parse_spec(spec)
    function = _import(source, placement or RewardPlacement())
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        raise RewardError(f"--reward {source}: its signature cannot be read") from None
    unnamed = [p.name for p in parameters.values() if p.kind is inspect.Parameter.POSITIONAL_ONLY]
    takes_keywords = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    if unnamed or not (takes_keywords or "completions" in parameters):
        raise RewardError(
            f"--reward {source}: TRL calls a reward function by keyword, with completions=, prompts=, "
            f"completion_ids=, trainer_state=, log_metric=, log_extra= and the dataset's columns; "
            f"{getattr(function, '__name__', source)} takes ({', '.join(map(str, parameters.values()))})"
        )
    name = getattr(function, "__name__", source.rpartition(":")[2])
    return RewardFunction(name=name, source=source, function=function, weight=weight)


# -- calling --------------------------------------------------------------------------------------------------


#: The ``reward/<name>`` statistics the pipeline logs itself: no reward function may take their names.
REWARD_STATISTICS = frozenset({"mean", "std", "group_std", "frac_zero_std"})


class RewardSet:
    """The run's reward functions, called together on one batch of completions."""

    def __init__(self, specs: Sequence[str], timeout: float = 60.0, placement: RewardPlacement | None = None) -> None:
        if not specs:
            raise RewardError("a dataset run needs at least one --reward")
        self.functions = [load_reward(spec, placement) for spec in specs]
        names = [f.name for f in self.functions]
        duplicate = next((name for name in names if names.count(name) > 1), None)
        if duplicate is not None:
            raise RewardError(f"two reward functions are named {duplicate!r}: each is logged as reward/<name>")
        statistic = next((name for name in names if name in REWARD_STATISTICS), None)
        if statistic is not None:
            raise RewardError(
                f"a reward function is named {statistic!r}: each is logged as reward/<name>, and reward/{statistic} "
                "is a statistic the pipeline logs itself; rename it (or wrap it in a function of another name)"
            )
        self.weights = torch.tensor([f.weight for f in self.functions], dtype=torch.float32, device="cpu")
        self.timeout = timeout
        self._loaded = False
        self._blocking = BlockingLoop()

    def check_chat(self, chat: bool) -> None:
        """With chat prompts, refuse a reward model that cannot render them (before the run, not at its first batch)."""
        if not chat:
            return
        for model in self._models():
            try:
                model.check_chat()
            except ModelError as exc:
                raise RewardError(str(exc)) from None

    def load(self) -> None:
        """Load every reward model's weights (a no-op once done): untimed, as :meth:`score` runs it before its first
        timed call, so a slow load is not a reward that missed ``--reward-timeout``."""
        for model in self._models():
            try:
                model.load()
            except ModelError as exc:
                raise RewardError(str(exc)) from exc
        self._loaded = True

    def _models(self) -> list[RewardModel]:
        return [reward.function for reward in self.functions if isinstance(reward.function, RewardModel)]

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.functions]

    async def score(
        self,
        prompts: list[Any],
        completions: list[Any],
        columns: dict[str, list[Any]],
        *,
        completion_ids: list[list[int]] | None = None,
        state: RewardState | None = None,
        log: RewardLog | None = None,
    ) -> torch.Tensor:
        """[F, N] rewards, one row per function, NaN where a function returned None (reward models loaded first,
        untimed). Each function is called by keyword, as TRL calls it: ``prompts``, ``completions``,
        ``completion_ids`` (each completion's token ids, its end token included), ``trainer_state``,
        ``log_metric`` and ``log_extra`` (into ``log``; a throwaway one if None) and the dataset's columns."""
        if not self._loaded:
            await asyncio.to_thread(self.load)
        log = log if log is not None else RewardLog()
        offered: dict[str, Any] = {**columns, "prompts": prompts, "completions": completions}
        if completion_ids is not None:
            offered["completion_ids"] = completion_ids
        offered["trainer_state"] = state if state is not None else RewardState()
        offered["log_metric"], offered["log_extra"] = log.log_metric, log.log_extra
        rows = await asyncio.gather(*(self._call(f, offered, len(completions)) for f in self.functions))
        return torch.tensor(rows, dtype=torch.float32, device="cpu").reshape(len(self.functions), len(completions))

    def run_blocking(self, scoring: Coroutine[Any, Any, T]) -> T:
        """``scoring`` (a :meth:`score`) run for code without an event loop (a one-process run, a sharded
        trainer's evaluation): on one loop this set keeps, so what async reward functions keep bound to it (a
        semaphore, a client) lasts from call to call."""
        return self._blocking.run(scoring)

    def close(self) -> None:
        """Close :meth:`run_blocking`'s loop (a later call makes another)."""
        self._blocking.close()

    async def _call(self, reward: RewardFunction, offered: dict[str, Any], count: int) -> list[float]:
        kwargs = reward.keywords(offered)
        try:
            if reward.is_async:
                result = await asyncio.wait_for(reward.function(**kwargs), self.timeout)
            else:
                result = await asyncio.wait_for(asyncio.to_thread(reward.function, **kwargs), self.timeout)
        except asyncio.TimeoutError:
            raise RewardError(
                f"reward function {reward.name} ({reward.source}) took longer than {self.timeout:g} s "
                "(--reward-timeout)"
            ) from None
        except Exception as exc:
            hint = SIGNAL_HINT if "signal only works in main thread" in str(exc) else ""
            raise RewardError(
                f"reward function {reward.name} ({reward.source}) raised {type(exc).__name__}: {exc}{hint}"
            ) from None
        return _checked(reward, result, count)

    def combine(self, per_function: torch.Tensor) -> torch.Tensor:
        """[N] weighted sums over functions, a None (NaN) counting as nothing; NaN where every function returned
        None (that completion is left out of its group and gets no advantage, as in TRL)."""
        total = (per_function * self.weights.unsqueeze(1)).nansum(0)
        return total.masked_fill(per_function.isnan().all(0), math.nan)

    def combine_decoupled(self, per_function: torch.Tensor, group: int, eps: float = 1e-4) -> torch.Tensor:
        """[N] weighted sums of each function's rewards normalised within its group first (GDPO): a function whose
        rewards vary little is not drowned by one that varies much. A None (NaN) is left out of its group's mean and
        std and counts as nothing in the sum."""
        grouped = per_function.view(per_function.shape[0], -1, group)
        mean, std = nan_moments(grouped, 2)  # the population std, as group_advantages
        return self.combine(((grouped - mean) / (std + eps)).view_as(per_function))  # (a None stays NaN)

    def means(self, per_function: torch.Tensor) -> dict[str, float]:
        """Each function's mean over the completions it applied to (NaN if none)."""
        out = {}
        for name, row in zip(self.names, per_function, strict=True):
            kept = row[~row.isnan()]
            out[name] = float(kept.mean()) if kept.numel() else math.nan
        return out


def _checked(reward: RewardFunction, result: Any, count: int) -> list[float]:
    """The rewards as floats (None as NaN): a list or tuple, or a 1-D tensor or array (as TRL takes any of them)."""
    where = f"reward function {reward.name} ({reward.source})"
    if hasattr(result, "tolist") and getattr(result, "ndim", None) == 1:  # a torch tensor or numpy array
        result = result.tolist()
    if not isinstance(result, (list, tuple)):
        raise RewardError(f"{where} returned a {type(result).__name__}, not a list of floats")
    if len(result) != count:
        raise RewardError(f"{where} returned {len(result)} values for {count} completions")
    values = []
    for value in result:
        if value is None:
            values.append(math.nan)
        elif isinstance(value, numbers.Real) or is_scalar(value):  # numpy and torch scalars, 0-d tensors, np.bool_
            values.append(float(value))
        else:
            raise RewardError(f"{where} returned a {type(value).__name__} among its rewards (floats or None only)")
    return values
