"""The user's task: a Hugging Face causal LM, a dataset of prompts, reward functions in TRL's signature.

``--task hf`` (implied by ``--dataset``). Each rollout takes ``--prompts``
dataset rows by its ticket (:meth:`pipeline.tasks.PromptData.rows_for`) and
samples ``--group`` completions of each with the generator's engine
(``--engine``: :mod:`pipeline.models`, :mod:`pipeline.models`); the scorer awaits the reward functions
(:class:`pipeline.tasks.RewardSet`), the reference model and the trainer
score the same left-padded tokens with :class:`pipeline.models.CompletionLogps`, in passes of at most
``--max-tokens-per-pass`` tokens, never holding logits over the vocabulary for the whole rollout.
Evaluation decodes the held-out prompts greedily and reports the weighted
reward (the primary metric) and each function's mean; ``--log-completions N``
appends N of them to ``completions.jsonl``. The trainer also writes the
policy as a Hugging Face folder, ``<run_dir>/model`` (:meth:`HFTask.export`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

from ..algorithm import group_spread
from ..models import (
    BuiltinEngine,
    CompletionLogps,
    Engine,
    SamplingParams,
    VLLMOptions,
    build_engine,
    cast_state,
    check_lora_targets,
    check_model,
    disable_dropout,
    load_model,
    load_tokenizer,
    position_limit,
    record_dtype,
    recorded_dtype,
    replace_folder,
    staging_folder,
)
from ._completion_loss import completion_loss
from ._data import DataError, PromptData, PromptRoom, load_rows, split_held_out
from ._interface import LossReport, Scores, Task
from ._reward_log import RewardLog
from ._rewards import RewardError, RewardPlacement, RewardSet, RewardState

if TYPE_CHECKING:
    from ..config import Config

__all__ = ["HFBatch", "HFTask"]

_log = logging.getLogger(__name__)

T = TypeVar("T")

#: Completion limit when ``--max-new-tokens`` is not given (TRL's default).
DEFAULT_MAX_NEW_TOKENS = 256
#: Sampled evaluation's seed (``--seed`` is added): far from every rollout's (the roles' ``sampling_seed``).
EVAL_SEED = 2**61


@dataclass
class HFBatch:
    """One rollout: ``group`` completions of each of ``rows`` (dataset indices), left-padded prompts first."""

    rows: torch.Tensor  # [B] int64
    tokens: torch.Tensor  # [B*G, P+T]
    prompt_mask: torch.Tensor  # [B*G, P] 1 on prompt tokens, 0 on left padding
    logps: torch.Tensor  # [B*G, T] behaviour log-probabilities
    mask: torch.Tensor  # [B*G, T] 1 up to and including the end token
    truncated: torch.Tensor  # [B*G] bool: reached the limit without an end token
    texts: list[str]  # the completions, decoded
    group: int
    ticket: int = -1  # the step this rollout trains (a reward function's trainer_state.global_step)


class HFTask(Task):
    """GRPO on a Hugging Face causal LM with the user's prompts and reward functions."""

    #: TRL's defaults for a pretrained model: a small learning rate, no KL term.
    defaults: ClassVar[dict[str, float]] = {"lr": 1e-6, "kl_coeff": 0.0, "clip": 0.2}
    primary: ClassVar[str] = "reward"
    target: ClassVar[float | None] = None
    #: transformers' import and its modeling code: ~2.5 s of every role's start on a 2-core machine.
    role_modules: ClassVar[tuple[str, ...]] = ("transformers", "transformers.modeling_utils")

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if not config.dataset:
            raise ValueError("--task hf needs --dataset")
        self.max_new_tokens = config.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        self._engines: dict[int, tuple[torch.nn.Module, Engine]] = {}
        self._scorers: dict[int, tuple[torch.nn.Module, CompletionLogps]] = {}
        self._reward_sets: dict[str, RewardSet] = {}

    # -- what each role loads, once, when it first needs it ------------------------------------------------

    @cached_property
    def tokenizer(self) -> Any:
        return load_tokenizer(self.config.model, self.config.trust_remote_code)

    @cached_property
    def model_config(self) -> Any:
        """``--model``'s config, read once (and checked to describe a causal language model)."""
        return check_model(self.config.model, self.config.trust_remote_code)

    @cached_property
    def prompt_room(self) -> PromptRoom | None:
        """How long a prompt may be: the model's positions less ``--max-new-tokens`` (None where it does not say)."""
        positions = position_limit(self.model_config)
        return PromptRoom(positions, self.max_new_tokens) if positions is not None else None

    @cached_property
    def _splits(self) -> tuple[PromptData, PromptData]:
        config = self.config
        column, tokenizer, variables, room = (
            config.prompt_column,
            self.tokenizer,
            config.chat_template_kwargs,
            self.prompt_room,
        )
        held_subset = config.eval_dataset_config or (
            config.dataset_config if config.eval_dataset == config.dataset else ""
        )
        for flag, source, split, subset in (
            ("--dataset", config.dataset, config.dataset_split != "train", config.dataset_config),
            ("--eval-dataset", config.eval_dataset, config.eval_dataset and config.eval_split != "test", held_subset),
        ):
            if os.path.isfile(source) and (split or subset):  # (a file holds one split, read whole: ignored)
                raise DataError(
                    f"{flag} {source} is a local file, read whole: --dataset-split, --eval-split, --dataset-config "
                    "and --eval-dataset-config pick a Hub dataset's split and subset"
                )
        rows = load_rows(config.dataset, config.dataset_split, subset=config.dataset_config)
        if config.eval_dataset:
            train = PromptData(rows, column, tokenizer, chat_template_kwargs=variables, room=room)
            held = load_rows(config.eval_dataset, config.eval_split, "--eval-dataset", held_subset)
            return train, PromptData(
                held, column, tokenizer, flag="--eval-dataset", chat_template_kwargs=variables, room=room
            )
        train_rows, held_rows = split_held_out(len(rows), config.eval_fraction, config.seed)
        return (
            PromptData(rows, column, tokenizer, train_rows, chat_template_kwargs=variables, room=room),
            PromptData(rows, column, tokenizer, held_rows, "--eval-fraction", variables, room),
        )

    @property
    def train_data(self) -> PromptData:
        return self._splits[0]

    @property
    def eval_data(self) -> PromptData:
        return self._splits[1]

    @cached_property
    def rewards(self) -> RewardSet:
        """The reward functions (a reward model among them is checked here, loaded on the CPU when first called)."""
        return self.rewards_on(torch.device("cpu"))

    def rewards_on(self, device: torch.device) -> RewardSet:
        """The reward functions with any reward model on ``device`` (bfloat16 there if the run is, on a GPU)."""
        held = self._reward_sets.get(str(device))
        if held is None:
            config = self.config
            dtype = torch.bfloat16 if config.dtype == "bfloat16" and device.type == "cuda" else torch.float32
            placement = RewardPlacement(
                device, dtype, config.trust_remote_code, dict(config.chat_template_kwargs or {})
            )
            held = self._reward_sets[str(device)] = RewardSet(config.rewards, config.reward_timeout, placement)
        return held

    def build_scorer(self, device: torch.device) -> RewardSet:
        """The scorer's reward functions, any reward model on its device."""
        return self.rewards_on(device)

    def check(self) -> None:
        """Load everything a role will need (model config, tokenizer, both prompt sets, rewards): fail before starting."""
        self.model_config  # noqa: B018  (read: a model that is no causal LM is refused here)
        self.train_data.prompt_ids(self.train_data.indices[0])
        self.eval_data.prompt_ids(self.eval_data.indices[0])
        self.rewards.check_chat(self.train_data.chat or self.eval_data.chat)  # imported and signature-checked too
        if self.config.lora_r:
            check_lora_targets(self.config.model, self.config.lora_target_modules, self.config.trust_remote_code)

    # -- the Task interface ----------------------------------------------------------------------------------

    def build_policy(self) -> torch.nn.Module:
        model = load_model(self.config.model, trust_remote_code=self.config.trust_remote_code)
        if self.config.disable_dropout and disable_dropout(model):  # the trainer's log-probs then are the generators'
            _log.info("%s: dropout off in training (--disable-dropout)", type(model).__name__)
        return model

    def params(self, samples: int, greedy: bool = False) -> SamplingParams:
        config = self.config
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=0.0 if greedy else config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            min_p=config.min_p,
            repetition_penalty=config.repetition_penalty,
            samples=samples,
        )

    def build_engine(self, policy: torch.nn.Module) -> Engine:
        """The generator's engine for ``policy``, as ``--engine`` names it (vLLM is imported only then)."""
        config = self.config
        vllm = VLLMOptions(
            temperature=config.temperature,
            top_k=config.top_k,
            top_p=config.top_p,
            min_p=config.min_p,
            repetition_penalty=config.repetition_penalty,
            seed=config.seed,
            dtype=config.vllm_dtype,
            max_model_len=config.vllm_max_model_len or None,
            gpu_memory_utilization=config.vllm_gpu_memory,
            trust_remote_code=config.trust_remote_code,
        )
        engine = build_engine(config.engine, policy, self.tokenizer, config.model, vllm, config.decode)
        self._engines[id(policy)] = (policy, engine)
        return engine

    def engine(self, policy: torch.nn.Module) -> Engine:
        """The engine that samples ``policy``: the one built for it, else (the trainer's evaluation) the built-in.

        The trainer's evaluation decodes over the dynamic cache unless a path
        is asked for: a kept static cache and its graphs would hold memory
        between evaluations in the process that holds the optimizer's state.
        """
        decode = "dynamic" if self.config.decode == "auto" else self.config.decode
        return _held(self._engines, policy, lambda: BuiltinEngine(policy, self.tokenizer, decode))

    def sample(self, policy: torch.nn.Module, generator: torch.Generator, ticket: int = 0) -> HFBatch:
        data = self.train_data
        rows = data.rows_for(max(0, ticket), self.config.prompts, self.config.seed, self.config.shuffle_dataset)
        engine = self.engine(policy)
        out = engine.generate([data.prompt_ids(row) for row in rows], self.params(self.config.group), generator)
        completion = out.tokens[:, out.prompt_mask.shape[1] :]
        ends = torch.tensor(engine.eos, device=completion.device)
        truncated = ~(torch.isin(completion, ends) & out.mask.bool()).any(1)  # no end token
        return HFBatch(
            torch.tensor(rows, dtype=torch.long, device=out.tokens.device),
            out.tokens,
            out.prompt_mask,
            out.logps,
            out.mask,
            truncated,
            out.texts,
            self.config.group,
            ticket,
        )

    async def score_async(self, scorer: Any, samples: HFBatch) -> Scores:
        """``scorer`` is :meth:`build_scorer`'s reward functions (None: those on the CPU)."""
        rewards, log = scorer if isinstance(scorer, RewardSet) else self.rewards, RewardLog()
        per_function = await rewards.score(**self._reward_inputs(samples), log=log)
        return self._scores(rewards, per_function, samples.group, log)

    def score(self, scorer: Any, samples: HFBatch) -> Scores:
        """:meth:`score_async` for code without an event loop (on the reward set's own loop, call after call)."""
        rewards, log = scorer if isinstance(scorer, RewardSet) else self.rewards, RewardLog()
        per_function = rewards.run_blocking(rewards.score(**self._reward_inputs(samples), log=log))
        return self._scores(rewards, per_function, samples.group, log)

    def _reward_inputs(self, samples: HFBatch) -> dict[str, Any]:
        """The reward functions' arguments for a rollout's completions."""
        data = self.train_data
        rows = samples.rows.tolist()
        prompts, columns = data.for_rewards(rows, samples.group)
        return {
            "prompts": prompts,
            "completions": data.completions(rows, samples.group, samples.texts),
            "columns": columns,
            "completion_ids": completion_ids(samples.tokens, samples.prompt_mask.shape[1], samples.mask),
            "state": RewardState.at(samples.ticket, self.config.steps, self.config.prompts, len(data)),
        }

    def _scores(self, rewards: RewardSet, per_function: torch.Tensor, group: int, log: RewardLog) -> Scores:
        """The rollout's scores (a training rollout's ``log_extra`` columns are not kept: only the held-out
        completions are logged)."""
        total, means, metrics = rewards.combine(per_function), rewards.means(per_function), log.metrics()
        if self.config.multi_objective_aggregation == "normalize_then_sum":  # GDPO: the advantages' signal differs
            signal = rewards.combine_decoupled(per_function, group)
            return Scores(signal, None, means, total, metrics)
        return Scores(total, None, means, metrics=metrics)

    def logps_of(self, model: torch.nn.Module) -> CompletionLogps:
        """What scores completions under ``model`` (one per model: its body/head split is checked once)."""
        return _held(self._scorers, model, lambda: CompletionLogps(model, compiled=self.config.compile))

    def forward_module(self, policy: torch.nn.Module) -> torch.nn.Module:
        """The scorer: the loss runs the model's body and chunked head through its forward."""
        return self.logps_of(policy)

    def reference_logps(self, reference: torch.nn.Module, samples: HFBatch) -> torch.Tensor:
        """The reference's log-probs, in passes of at most ``--max-tokens-per-pass`` tokens."""
        scorer, config = self.logps_of(reference), self.config
        with torch.no_grad():
            parts = [
                scorer(samples.tokens[rows], samples.prompt_mask[rows], config.temperature)[0]
                for rows in self.micro_batches(samples, config.micro_batch, config.max_tokens_per_pass)
            ]
        return torch.cat(parts) * samples.mask

    def loss(
        self,
        policy: torch.nn.Module,
        samples: HFBatch,
        rewards: torch.Tensor,
        ref_logps: torch.Tensor | None,
        rows: slice | None = None,
        batch: slice | None = None,
    ) -> LossReport:
        scorer, bonus = self.logps_of(policy), self.config.entropy_control().active

        def policy_logps(part: slice) -> tuple[torch.Tensor, torch.Tensor]:
            return scorer(samples.tokens[part], samples.prompt_mask[part], self.config.temperature, bonus)

        return completion_loss(
            self.config,
            self.max_new_tokens,
            policy_logps,
            samples.logps,
            ref_logps,
            samples.mask,
            rewards,
            samples.group,
            samples.truncated,
            rows,
            batch,
        )

    def rows(self, samples: HFBatch) -> int:
        return int(samples.tokens.shape[0])

    def row_tokens(self, samples: HFBatch) -> int:
        return int(samples.tokens.shape[1])

    def measure(self, samples: HFBatch) -> tuple[int, float]:
        tokens = int(samples.mask.sum())
        return tokens, tokens / max(1, samples.mask.shape[0])

    async def evaluate_async(self, policy: torch.nn.Module) -> dict[str, float]:
        """The held-out prompts' completions, greedy or ``--num-generations-eval`` samples of each: the weighted
        reward and each function's mean; sampled, also the spread within each prompt's samples."""
        return await self.evaluate_at_async(policy, -1)

    def evaluate(self, policy: torch.nn.Module) -> dict[str, float]:
        """:meth:`evaluate_async` for code without an event loop (on the reward set's own loop, call after call)."""
        return self.evaluate_at(policy, -1)

    async def evaluate_at_async(self, policy: torch.nn.Module, step: int) -> dict[str, float]:
        """:meth:`evaluate_async` after ``step`` updates: the reward functions' ``trainer_state.global_step`` (as
        TRL's at an evaluation) and each ``completions.jsonl`` row's ``step`` (-1: no step, a direct call)."""
        rewards, inputs, texts = self._held_out(policy, step)
        log = RewardLog()
        return self._evaluation(rewards, inputs, texts, await rewards.score(**inputs, log=log), log, step)

    def evaluate_at(self, policy: torch.nn.Module, step: int) -> dict[str, float]:
        """:meth:`evaluate_at_async` for code without an event loop."""
        rewards, inputs, texts = self._held_out(policy, step)
        log = RewardLog()
        per_function = rewards.run_blocking(rewards.score(**inputs, log=log))
        return self._evaluation(rewards, inputs, texts, per_function, log, step)

    def _held_out(self, policy: torch.nn.Module, step: int) -> tuple[RewardSet, dict[str, Any], list[str]]:
        """The reward functions beside ``policy``, their arguments for its held-out completions, and their texts."""
        data, samples = self.eval_data, self.config.num_generations_eval
        rows = data.indices[: self.config.eval_size]
        was_training = policy.training
        policy.eval()
        try:
            texts, ids = self._held_out_completions(policy, [data.prompt_ids(row) for row in rows])
        finally:
            policy.train(was_training)
        prompts, columns = data.for_rewards(rows, max(1, samples))  # a prompt's samples are consecutive
        rewards = self.rewards_on(next(policy.parameters()).device)  # a reward model beside the policy
        inputs = {
            "prompts": prompts,
            "completions": data.completions(rows, max(1, samples), texts),
            "columns": columns,
            "completion_ids": ids,
            "state": RewardState.at(step, self.config.steps, self.config.prompts, len(self.train_data)),
        }
        return rewards, inputs, texts

    def _evaluation(
        self,
        rewards: RewardSet,
        inputs: dict[str, Any],
        texts: list[str],
        per_function: torch.Tensor,
        log: RewardLog,
        step: int,
    ) -> dict[str, float]:
        """The held-out metrics (with what the reward functions logged), its completions logged."""
        samples = self.config.num_generations_eval
        combined = rewards.combine(per_function)
        try:
            extra = log.columns(len(texts))
        except ValueError as exc:
            raise RewardError(f"a reward function's {exc}") from None
        self._log_completions(inputs["prompts"], texts, per_function, rewards.names, extra, step)
        metrics = {
            "reward": float(combined.nanmean()),  # (a completion no function scored is left out)
            **{f"reward/{name}": value for name, value in rewards.means(per_function).items()},
        }
        if samples > 1:
            metrics["reward_std"], metrics["frac_reward_zero_std"] = group_spread(combined, samples)
        logged = log.metrics()
        clash = sorted(set(logged) & set(metrics))
        if clash:
            raise RewardError(
                f"a reward function logged the metric {clash[0]!r} (log_metric), a name the evaluation logs itself: "
                "name it otherwise"
            )
        return {**metrics, **logged}

    def _held_out_completions(
        self, policy: torch.nn.Module, prompts: list[list[int]]
    ) -> tuple[list[str], list[list[int]]]:
        """Greedy completions, or ``--num-generations-eval`` sampled ones of each prompt (consecutive).

        Sampling draws from one seeded stream per evaluation, so every evaluation of a run (a resumed one's
        too, and every rank of a sharded trainer) draws the same noise, and calls hold no more completions
        than the greedy evaluation or a rollout would.
        """
        engine, samples = self.engine(policy), self.config.num_generations_eval
        if samples == 0:
            out = engine.generate(prompts, self.params(1, greedy=True))
            return out.texts, completion_ids(out.tokens, out.prompt_mask.shape[1], out.mask)
        device = next(policy.parameters()).device
        generator = torch.Generator(device=device).manual_seed(EVAL_SEED + self.config.seed)
        per_call = max(1, max(len(prompts), self.config.prompts * self.config.group) // samples)
        texts: list[str] = []
        ids: list[list[int]] = []
        for start in range(0, len(prompts), per_call):
            out = engine.generate(prompts[start : start + per_call], self.params(samples), generator)
            texts += out.texts
            ids += completion_ids(out.tokens, out.prompt_mask.shape[1], out.mask)
        return texts, ids

    def _log_completions(
        self,
        prompts: list[Any],
        texts: list[str],
        per_function: torch.Tensor,
        names: list[str],
        extra: dict[str, list[Any]],
        step: int,
    ) -> None:
        """The first ``--log-completions`` held-out completions, their rewards and the columns reward functions
        logged for them (``log_extra``), as rows of ``completions.jsonl``, each naming the step it evaluated (a
        resumed run drops the rows past its checkpoint's, as ``metrics.jsonl``'s)."""
        count, run_dir = self.config.log_completions, self.config.run_dir
        if count <= 0 or not run_dir:
            return
        with open(os.path.join(run_dir, "completions.jsonl"), "a") as f:
            for i in range(min(count, len(texts))):
                scores = {n: (None if v != v else v) for n, v in zip(names, per_function[:, i].tolist(), strict=True)}
                row = {"step": step, "prompt": prompts[i], "completion": texts[i], "rewards": scores}
                if extra:
                    row["extra"] = {column: values[i] for column, values in extra.items()}
                f.write(json.dumps(row, default=str) + "\n")

    @cached_property
    def export_dtype(self) -> torch.dtype:
        """The dtype of ``model/``'s weights: ``--export-dtype``, or with ``auto`` the one ``--model``'s config
        records (a bfloat16 model is published as bfloat16: its float32 export was twice the size, and served by
        vLLM's ``dtype="auto"`` as float16, whose range a bfloat16 model may exceed), else float32."""
        if self.config.export_dtype != "auto":
            return getattr(torch, self.config.export_dtype)  # type: ignore[no-any-return]
        recorded = recorded_dtype(self.model_config)
        return recorded if recorded in (torch.bfloat16, torch.float16) else torch.float32

    def export(self, policy: torch.nn.Module, run_dir: str) -> str | None:
        """``policy`` (its weights in :attr:`export_dtype`) and its tokenizer as ``<run_dir>/model`` (safetensors),
        replaced whole."""
        if not run_dir:
            return None
        target = os.path.join(run_dir, "model")
        staging = staging_folder(target)
        dtype = self.export_dtype
        if dtype == torch.float32:
            policy.save_pretrained(staging, safe_serialization=True)  # type: ignore[operator]
        else:
            policy.save_pretrained(staging, safe_serialization=True, state_dict=cast_state(policy, dtype))  # type: ignore[operator]
            record_dtype(os.path.join(staging, "config.json"), dtype)
        self.tokenizer.save_pretrained(staging)
        return replace_folder(staging, target)


def _held(cache: dict[int, tuple[torch.nn.Module, T]], model: torch.nn.Module, build: Callable[[], T]) -> T:
    """What ``cache`` holds for ``model``, built once (keyed by identity: a module is not hashable by value)."""
    held = cache.get(id(model))
    if held is None or held[0] is not model:
        held = cache[id(model)] = (model, build())
    return held[1]


def completion_ids(tokens: torch.Tensor, prompt_width: int, mask: torch.Tensor) -> list[list[int]]:
    """Each row's completion token ids, its end token included, its padding left out (TRL's ``completion_ids``)."""
    completion, kept = tokens[:, prompt_width:].cpu(), mask.bool().cpu()
    return [row[keep].tolist() for row, keep in zip(completion, kept, strict=True)]
