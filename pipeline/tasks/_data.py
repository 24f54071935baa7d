"""Prompt datasets: a file or a Hub dataset, its prompt column rendered for the model, the rest for rewards.

``--dataset`` is a local JSONL, JSON, parquet or CSV file, or a Hub dataset
name; either is loaded with the ``datasets`` library. The prompt column holds
text, or a list of chat messages rendered with the tokenizer's chat template
(``add_generation_prompt=True``). Every other column goes with its prompt to
the reward functions.

Which rows a rollout trains on depends only on its ticket (the trainer step
it is for; :mod:`pipeline.roles`): ticket ``t`` takes samples ``t·B`` to
``(t+1)·B - 1`` of an endless sequence of epochs, each a fresh seeded
permutation. Every generator, a restarted one, and a resumed run therefore
agree on the order, and a resumed run's data position is its step.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..models import first_line

__all__ = ["DataError", "PromptData", "PromptRoom", "load_rows", "split_held_out"]

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DataError(ValueError):
    """A dataset that cannot be loaded or used; the message names the flag."""


def load_rows(source: str, split: str = "train", flag: str = "--dataset", subset: str = "") -> Any:
    """The ``datasets.Dataset`` that ``source`` (a local file, a folder whose files are splits, or a Hub name with its
    ``subset``) holds."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"{flag} needs the datasets library: pip install -e '.[hf]'") from None
    datasets.disable_progress_bars()
    extension = os.path.splitext(source)[1].lower()
    try:
        with _no_progress_monitor():
            if os.path.isdir(source):  # as a Hub dataset downloaded: its files, or its card's subsets, give the splits
                return datasets.load_dataset(source, subset or None, split=split)
            if os.path.exists(source):
                builder = _BUILDERS.get(extension)
                if builder is None:
                    raise DataError(
                        f"{flag} {source}: use a .jsonl, .json, .parquet or .csv file, or a Hub dataset name"
                    )
                return datasets.load_dataset(builder, data_files=source, split="train")
            if extension in _BUILDERS:
                raise DataError(f"{flag} {source}: no such file")
            return datasets.load_dataset(source, subset or None, split=split)
    except DataError:
        raise
    except Exception as exc:  # the library's own errors: one line, naming the flag
        raise DataError(f"{flag} {source}: cannot be loaded ({first_line(exc)})") from None


@contextlib.contextmanager
def _no_progress_monitor() -> Iterator[None]:
    """No tqdm monitor thread starts within: tqdm starts one for every bar, a disabled one too, and never stops it.

    ``datasets`` makes such bars while it resolves files. A thread left
    running keeps the actors runtime from forking its forkserver from the
    launcher (``fork_refusal``), so every role of a run would start as a
    fresh interpreter importing torch and transformers again: seconds each.
    """
    from tqdm import tqdm

    before = tqdm.monitor_interval
    tqdm.monitor_interval = 0  # tqdm's documented switch: no monitor thread
    try:
        yield
    finally:
        tqdm.monitor_interval = before


def split_held_out(count: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Row indices for training and for evaluation: a seeded ``fraction`` of ``count`` rows held out."""
    held = round(count * fraction)
    if held <= 0 or held >= count:
        raise DataError(f"--eval-fraction {fraction}: holds out {held} of {count} rows; it must leave some of each")
    order = torch.randperm(count, generator=torch.Generator(device="cpu").manual_seed(seed), device="cpu").tolist()
    return sorted(order[held:]), sorted(order[:held])


#: The reward functions' own keyword arguments (TRL's signature): a dataset column may not take their names.
REWARD_ARGUMENTS = frozenset({"prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra"})
#: Rows whose prompt token ids a prompt set keeps (least recently used let go).
PROMPT_CACHE_ROWS = 65_536
#: Columns TRL leaves out of the reward functions' arguments (a reference completion's, as SFT data holds).
NOT_FOR_REWARDS = frozenset({"completion", "completion_ids"})


def _holds_messages(rows: Any, column: str, indices: list[int]) -> bool:
    """Whether ``column`` holds chat messages: its type says (a list of them), not one row, whose cell may be
    empty; without a typed column, the first row that holds something."""
    feature = getattr(rows, "features", {}).get(column)
    if feature is not None:  # (text is a Value)
        return isinstance(feature, list) or type(feature).__name__ in ("List", "LargeList", "Sequence")
    first = next((rows[row][column] for row in indices if rows[row][column] is not None), None)
    return isinstance(first, list)


@dataclass(frozen=True)
class PromptRoom:
    """How long a prompt may be: the model's positions, less the completion's tokens (``--max-new-tokens``)."""

    positions: int
    new_tokens: int

    def check(self, flag: str) -> None:
        """Refuse a completion that leaves no room for a prompt at all."""
        if self.new_tokens >= self.positions:
            raise DataError(
                f"{flag}: --max-new-tokens {self.new_tokens} leaves no room for a prompt in the model's "
                f"{self.positions} positions (max_position_embeddings)"
            )

    def refuse(self, row: int, tokens: int) -> None:
        """Refuse row ``row``'s prompt of ``tokens`` tokens if its completion would run past the positions."""
        if tokens + self.new_tokens > self.positions:
            raise DataError(
                f"row {row}: its prompt is {tokens} tokens, and with --max-new-tokens {self.new_tokens} the completion "
                f"would run past the model's {self.positions} positions (max_position_embeddings): shorten the "
                f"prompt, or lower --max-new-tokens to {self.positions - tokens} at most"
            )


class PromptData:
    """One set of prompts: their token ids for the model, their raw values and columns for the rewards.

    With ``room``, a prompt too long for the model's positions with its completion is refused, naming its row
    (the model would fail on it mid-step: a device-side assert on a GPU).
    """

    def __init__(
        self,
        rows: Any,
        prompt_column: str,
        tokenizer: Any,
        indices: list[int] | None = None,
        flag: str = "--dataset",
        chat_template_kwargs: dict[str, Any] | None = None,
        room: PromptRoom | None = None,
    ) -> None:
        names = list(rows.column_names)
        if prompt_column not in names:
            raise DataError(f"{flag}: no column {prompt_column!r} (--prompt-column); it has {', '.join(names)}")
        self.rows = rows
        self.prompt_column = prompt_column
        self.indices = list(range(len(rows))) if indices is None else indices
        if not self.indices:
            raise DataError(f"{flag}: no rows")
        self.tokenizer = tokenizer
        self.room = room
        if room is not None:
            room.check(flag)
        clash = sorted(set(names) & (REWARD_ARGUMENTS - NOT_FOR_REWARDS) - {prompt_column})
        if clash:
            raise DataError(
                f"{flag}: column {clash[0]!r} has the name of a reward function's own argument "
                f"({', '.join(sorted(REWARD_ARGUMENTS))}); rename it"
            )
        # as TRL, the rewards get every column but the prompt and a reference completion's
        self.columns = [name for name in names if name != prompt_column and name not in NOT_FOR_REWARDS]
        self.chat = _holds_messages(rows, prompt_column, self.indices)
        if self.chat and not getattr(tokenizer, "chat_template", None):
            raise DataError(f"{flag}: the prompts are chat messages, but the model's tokenizer has no chat template")
        self.template_kwargs = dict(chat_template_kwargs or {})
        if self.template_kwargs and not self.chat:
            raise DataError(
                f"{flag}: --chat-template-kwargs sets the chat template's variables, but column {prompt_column!r} "
                "holds text, which is tokenized as it is"
            )
        self._ids: OrderedDict[int, array[int]] = OrderedDict()  # the last PROMPT_CACHE_ROWS rows tokenized
        self._order: tuple[tuple[int, int], list[int]] | None = None

    def __len__(self) -> int:
        return len(self.indices)

    def prompt(self, row: int) -> Any:
        """The prompt of dataset row ``row`` as the dataset holds it (text, or messages)."""
        return self.rows[row][self.prompt_column]

    def prompt_ids(self, row: int) -> list[int]:
        """Row ``row``'s prompt as token ids (rendered with the chat template if it is messages)."""
        cached = self._ids.get(row)
        if cached is not None:
            self._ids.move_to_end(row)
            return cached.tolist()
        prompt = self.prompt(row)
        if prompt is None:
            raise DataError(f"row {row}: its prompt is empty (column {self.prompt_column!r} holds nothing there)")
        if self.chat and not isinstance(prompt, list):
            raise DataError(f"row {row}: its prompt is a {type(prompt).__name__}, not chat messages")
        if not self.chat and (isinstance(prompt, bool) or not isinstance(prompt, (str, int, float))):
            raise DataError(f"row {row}: its prompt is a {type(prompt).__name__}, not text")
        if self.chat:
            # a prompt ending with an assistant's message (a prefill: "<think>") is continued, as TRL does; any
            # other ends with the template's cue for the assistant's turn
            prefilled = _prefill(prompt) is not None
            try:
                continued = {"continue_final_message": True} if prefilled else {}
                ids = self.tokenizer.apply_chat_template(
                    prompt, add_generation_prompt=not prefilled, tokenize=True, **continued, **self.template_kwargs
                )
            except Exception as exc:  # the tokenizer's own template: whatever it raises
                raise DataError(
                    f"row {row}: the chat template failed: {type(exc).__name__}: {exc} (its variables: "
                    f"--chat-template-kwargs {json.dumps(self.template_kwargs)})"
                ) from None
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer tokenizers return a BatchEncoding
                ids = ids["input_ids"]
        else:  # as TRL tokenizes prompts: no special tokens added (a BOS belongs to the text, as to a template)
            ids = self.tokenizer(str(prompt), add_special_tokens=False)["input_ids"]
        ids = [int(token) for token in ids]
        if not ids:
            raise DataError(f"row {row}: its prompt has no tokens")
        if self.room is not None:
            self.room.refuse(row, len(ids))
        # kept compact (4 bytes a token, not a Python int's 28 and a list slot's 8) and bounded: a run through
        # a large dataset kept every prompt it ever tokenized
        self._ids[row] = array("i", ids)
        if len(self._ids) > PROMPT_CACHE_ROWS:
            self._ids.popitem(last=False)
        return ids

    def for_rewards(self, rows: list[int], group: int) -> tuple[list[Any], dict[str, list[Any]]]:
        """The prompts and the other columns of ``rows``, each repeated ``group`` times (one per completion):
        every row read once, not once per completion. A chat prompt's prefill (its last message an assistant's)
        is not among its messages: it begins the completion (:meth:`completions`), as in TRL."""
        records = [self.rows[row] for row in rows]
        prompts = [_own(record[self.prompt_column]) for record in records for _ in range(group)]
        if self.chat:
            for prompt in prompts:
                if _prefill(prompt) is not None:
                    prompt.pop()
        columns = {name: [_own(record[name]) for record in records for _ in range(group)] for name in self.columns}
        return prompts, columns

    def completions(self, rows: list[int], group: int, texts: list[str]) -> list[Any]:
        """The completions of ``rows`` (``group`` each, in order) as TRL passes them to reward functions: their
        texts, or for chat prompts one assistant message each, which begins with the prompt's prefill, if any."""
        if not self.chat:
            return list(texts)
        prefills = [_prefill(self.prompt(row)) or "" for row in rows for _ in range(group)]
        return [[{"role": "assistant", "content": pre + text}] for pre, text in zip(prefills, texts, strict=True)]

    def rows_for(self, ticket: int, batch: int, seed: int, shuffle: bool = True) -> list[int]:
        """The ``batch`` dataset rows of rollout ``ticket``: consecutive samples of seeded, reshuffled epochs (or,
        without ``shuffle``, of the rows in the dataset's order, epoch after epoch)."""
        count = len(self.indices)
        if not shuffle:
            return [self.indices[sample % count] for sample in range(ticket * batch, (ticket + 1) * batch)]
        return [
            self.indices[self._epoch_order(sample // count, seed)[sample % count]]
            for sample in range(ticket * batch, (ticket + 1) * batch)
        ]

    def _epoch_order(self, epoch: int, seed: int) -> list[int]:
        """Epoch ``epoch``'s permutation of the rows (the newest kept: consecutive tickets share one)."""
        if self._order is None or self._order[0] != (epoch, seed):
            generator = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + epoch)
            self._order = ((epoch, seed), torch.randperm(len(self.indices), generator=generator, device="cpu").tolist())
        return self._order[1]


def _prefill(prompt: Any) -> str | None:
    """The content of a chat prompt's last message where it is an assistant's (the start of its answer, which the
    model continues), else None."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict) and prompt[-1].get("role") == "assistant":
        return str(prompt[-1].get("content") or "")
    return None


def _own(value: Any) -> Any:
    """``value`` for one completion alone: a list or dict (a chat prompt, a column of test cases) copied, so a
    reward function that changes one completion's (extends the conversation, pops a case) changes no other's,
    as each of TRL's repeated rows is an object of its own."""
    return copy.deepcopy(value) if isinstance(value, (list, dict)) else value
