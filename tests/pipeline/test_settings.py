"""Settings no run can train with are refused before anything starts: one line, a non-zero exit, no traceback."""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import pytest
import torch
from harness import ROOT, actor_pids, run_python

from pipeline import Config, DigitsTask, resolve
from pipeline.config import SettingsError, check_settings
from pipeline.grpo import main, parse_args

#: Flags that make a run a Hugging Face one (the settings are checked before the dataset is read).
HF = ("--dataset", "prompts.jsonl", "--reward", "exact_match")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--group", "1"], "--group 1: GRPO needs at least 2 samples per prompt"),
        (["--temperature", "0"], "--temperature 0.0: training samples at a temperature above 0"),
        (["--prompts", "0"], "--prompts 0: must be at least 1"),
        (["--top-p", "0"], "--top-p 0.0: the nucleus mass must be in (0, 1]"),
        (["--top-p", "1.5"], "--top-p 1.5: the nucleus mass must be in (0, 1]"),
        (["--clip", "1.5"], "--clip 1.5: the ratio clip must be in (0, 1)"),
        (["--dual-clip", "0.5"], "--dual-clip 0.5: the dual clip C must be above 1 (or 0: off)"),
        (["--epsilon-high", "0"], "--epsilon-high 0.0: the clip's upper bound must be above 0"),
        (["--lr", "0"], "--lr 0.0: the learning rate must be above 0"),
        (["--kl-coeff", "-0.1"], "--kl-coeff -0.1: must be at least 0"),
        (["--max-staleness", "-1"], "--max-staleness -1: must be at least 0"),
        (["--micro-batch", "-2"], "--micro-batch -2: must be at least 0"),
        (["--max-grad-norm", "-1"], "--max-grad-norm -1.0: must be at least 0 (0 turns clipping off)"),
        (["--generators", "0"], "--generators 0: must be at least 1"),
        (["--resume", "no/such/run"], "--resume no/such/run: no such folder"),
        (["--top-k", "-1"], "--top-k -1: must be at least 0"),
        (["--min-p", "1"], "--min-p 1.0: a share of the likeliest token's probability, in [0, 1)"),
        (["--repetition-penalty", "0"], "--repetition-penalty 0.0: it divides or multiplies logits, so above 0"),
        (["--task", "bandit", "--repetition-penalty", "1.2"], "--repetition-penalty with --task bandit: the bandit"),
        (["--min-p", "-0.1"], "--min-p -0.1: a share of the likeliest token's probability, in [0, 1)"),
        (
            ["--task", "pipeline.tasks:BanditTask", "--top-k", "2", "--min-p", "0.1"],
            "--top-k, --min-p with --task pipeline.tasks:BanditTask: the bandit draws its actions",
        ),
        (
            ["--task", "bandit", "--top-p", "0.9", "--temperature", "0.7"],
            "--temperature, --top-p with --task bandit: the bandit draws its actions from the policy's own softmax",
        ),
        (
            ["--multi-objective-aggregation", "normalize_then_sum"],
            "--multi-objective-aggregation normalize_then_sum normalises each --reward function's rewards (--task hf)",
        ),
        (
            [
                *("--multi-objective-aggregation", "normalize_then_sum", "--scale-rewards", "group"),
                *("--dataset", "prompts.jsonl", "--reward", "exact_match"),
            ],
            "--multi-objective-aggregation normalize_then_sum with --scale-rewards group: GDPO normalises",
        ),
        (["--save-every", "-5"], "--save-every -5: must be at least 0 (0: only at the end)"),
        (["--ray-hosts", "-1"], "--ray-hosts -1: must be at least 0"),
        (["--ray-hosts", "2"], "--ray-hosts picks the Ray nodes to use: add --ray"),
        (["--mode", "sync", "--max-staleness", "4"], "--max-staleness bound an async run's rollouts; --mode sync"),
        (["--mode", "sync", "--max-inflight", "3"], "--max-inflight bound an async run's rollouts; --mode sync"),
        (["--warmup-steps", "11", "--steps", "10"], "--warmup-steps 11 with --steps 10: the learning rate would"),
        (["--reward", "exact_match"], "--reward with --task reverse: only a Hugging Face task (--task hf, --dataset)"),
        (["--eval-dataset", "x.jsonl", "--log-completions", "2"], "--eval-dataset, --log-completions with --task"),
        (["--task", "add", "--prompt-column", "q"], "--prompt-column with --task add: only a Hugging Face task"),
        (["--eval-fraction", "0.2"], "--eval-fraction with --task reverse: only a Hugging Face task"),
        ([*HF, "--eval-split", "validation"], "--eval-split picks a Hub --eval-dataset's split: add --eval-dataset"),
        ([*HF, "--eval-dataset-config", "x"], "--eval-dataset-config picks a Hub --eval-dataset's subset: add --eval"),
        (
            [*HF, "--eval-dataset", "x.jsonl", "--eval-fraction", "0.2"],
            "--eval-fraction holds out a share of --dataset; --eval-dataset gives the held-out prompts",
        ),
        (["--reward-timeout", "0"], "--reward-timeout 0.0: a reward function needs some time (above 0)"),
        (["--eval-fraction", "1"], "--eval-fraction 1.0: the held-out share must be in (0, 1)"),
        (["--stop-grace", "-1"], "--stop-grace -1.0: a number of seconds, at least 0"),
        (["--stop-grace", "nan"], "--stop-grace nan: must be a finite number"),
        (["--max-tokens-per-pass", "-1"], "--max-tokens-per-pass -1: must be at least 0"),
        (["--gradient-checkpointing"], "--gradient-checkpointing recomputes a Hugging Face model's layers"),
        (["--trainer-ranks", "0"], "--trainer-ranks 0: must be at least 1"),
        (["--trainer-ranks", "2", "--collective-timeout", "0"], "--collective-timeout 0.0: a number of seconds above"),
        (["--collective-timeout", "120"], "--collective-timeout bounds the trainer ranks' collectives: add --trainer"),
        (
            ["--compile", "--trainer-ranks", "2"],
            "--compile with --trainer-ranks 2 --trainer-shard fsdp: compiled blocks under FSDP2's hooks are not",
        ),
        (["--num-iterations", "0"], "--num-iterations 0: must be at least 1"),
        (["--sync-ref-model", "--kl-coeff", "0"], "--sync-ref-model with --kl-coeff 0: there is no reference model"),
        (["--sync-ref-model", "--ref-model-sync-steps", "0"], "--ref-model-sync-steps 0: must be at least 1"),
        (["--sync-ref-model", "--ref-model-mixup-alpha", "0"], "--ref-model-mixup-alpha 0.0: the policy's share"),
        (
            ["--sync-ref-model", "--trainer-ranks", "2"],
            "--sync-ref-model with --trainer-ranks 2 --trainer-shard fsdp: the policy is sharded",
        ),
        (
            ["--sync-ref-model", "--dataset", "prompts.jsonl", "--reward", "exact_match"],
            "--sync-ref-model: --task hf has no KL term by default (β 0)",
        ),
        (
            ["--use-bias-correction-kl", "--kl-coeff", "0"],
            "--use-bias-correction-kl with --kl-coeff 0: there is no KL term to correct",
        ),
        (
            ["--use-bias-correction-kl", "--dataset", "prompts.jsonl", "--reward", "exact_match"],
            "--use-bias-correction-kl: --task hf has no KL term by default (β 0), so no KL term to correct",
        ),
        (["--loss", "sapo", "--sapo-temperature-neg", "0"], "--sapo-temperature-neg 0.0: the gate's temperature"),
        (["--loss", "sapo", "--sapo-temperature-pos", "-1"], "--sapo-temperature-pos -1.0: the gate's temperature"),
        (["--loss", "cispo", "--epsilon-high", "0.28"], "--loss cispo --epsilon-high 0.28: cispo caps the ratio"),
        (["--is-correction", "token_mask", "--is-min", "1"], "--is-min 1.0: an importance weight's lower bound"),
        (
            ["--num-iterations", "2", "--is-correction", "sequence_mask"],
            "--num-iterations 2 with --is-correction sequence_mask: importance weights take",
        ),
        (["--off-policy-mask-threshold", "-0.1"], "--off-policy-mask-threshold -0.1: a completion's mean drift"),
        (["--top-entropy-quantile", "0"], "--top-entropy-quantile 0.0: the share of tokens trained must be in (0, 1]"),
        (["--top-entropy-quantile", "1.5"], "--top-entropy-quantile 1.5: the share of tokens trained must be in"),
        (
            ["--top-entropy-quantile", "0.2", "--trainer-ranks", "2"],
            "--top-entropy-quantile 0.2 with --trainer-ranks 2: each rank would rank only its own rows",
        ),
        (
            ["--num-iterations", "2", "--is-correction", "tis"],
            "--num-iterations 2 with --is-correction tis: importance weights take each update's ratio",
        ),
        (["--decode", "static", "--engine", "hf"], "--decode static picks how the built-in sampler decodes"),
        (["--is-cap", "3"], "--is-cap set the importance weights' bounds: add --is-correction"),
        (["--task", "bandit", "--mask-truncated"], "--mask-truncated with --task bandit: a bandit's completion is one"),
        (["--loss", "dapo", "--sapo-temperature-neg", "2"], "--sapo-temperature-neg set --loss sapo's gate: add"),
        (["--vespo-k-pos", "1", "--vespo-lambda-neg", "3"], "--vespo-k-pos, --vespo-lambda-neg set --loss vespo's"),
        (["--ref-model-sync-steps", "8"], "--ref-model-sync-steps set the reference's sync: add --sync-ref-model"),
        (
            [*("--engine", "vllm", "--temperature", "0.7", "--top-p", "0.9"), *HF],
            "--engine vllm with --temperature 0.7 and a sampler filter or penalty: vLLM gives the filtered",
        ),
        (
            [
                *("--engine", "vllm", "--temperature", "0.7", "--top-k", "5", "--is-correction", "tis"),
                "--loss",
                "vespo",
                *HF,
            ],
            "--engine vllm with --temperature 0.7 and a sampler filter or penalty: vLLM gives the filtered "
            "distribution's log-probs only, and --loss vespo",
        ),
        (["--loss", "luspo"], "--loss luspo weighs GSPO's sequence ratio by each completion's length: add"),
        (["--mini-batches", "0"], "--mini-batches 0: must be at least 1"),
        (
            ["--mini-batches", "2", "--is-correction", "tis"],
            "--mini-batches 2 with --is-correction tis: importance weights take each step's ratio",
        ),
        (["--mini-batches", "5"], "--mini-batches 5: a rollout of 256 completions does not split into 5 equal parts"),
        (
            ["--trainer-ranks", "2", "--mini-batches", "256"],
            "--trainer-ranks 2 with --mini-batches 256: a mini-batch of a rollout's 256 rows",
        ),
        (
            ["--loss", "vespo", "--importance-sampling-level", "sequence"],
            "--loss vespo --importance-sampling-level sequence: vespo takes each completion's ratio",
        ),
        (["--vespo-k-neg", "-1"], "--vespo-k-neg -1.0: the weight's power of the ratio must be at least 0"),
        (["--vespo-lambda-pos", "0"], "--vespo-lambda-pos 0.0: the weight's decay must be above 0"),
        (["--trainer-ranks", "9", "--prompts", "2", "--group", "4"], "--trainer-ranks 9: a rollout has 8 rows"),
        (["--loss", "sapo", "--dual-clip", "5"], "--dual-clip bounds a clipped loss's term for a negative advantage;"),
        (
            ["--loss", "vespo", "--clip", "0.1", "--epsilon-high", "0.28"],
            "--clip, --epsilon-high clip the ratio; --loss",
        ),
        (["--loss", "cispo", "--clip", "0.1"], "--clip sets the clip's lower bound; --loss cispo only caps the ratio"),
        (["--vllm-gpu-memory", "0.5"], "--vllm-gpu-memory set vLLM's engine: add --engine vllm"),
        (["--task", "bandit", "--prompts", "64"], "--prompts with --task bandit: a bandit's rollout is one state's"),
        (
            ["--task", "bandit", "--top-entropy-quantile", "0.2", "--max-new-tokens", "3"],
            "--max-new-tokens, --top-entropy-quantile with --task bandit: a bandit's rollout is one state's --group",
        ),
        (
            ["--task", "bandit", "--group", "4", "--mini-batches", "2", "--trainer-ranks", "4"],
            "--trainer-ranks 4 with --mini-batches 2 and --task bandit: a rollout has 4 rows (--group)",
        ),
        (["--no-shuffle-dataset"], "--no-shuffle-dataset keeps a dataset's order (--task hf, --dataset); --task"),
        (["--lora-alpha", "8"], "--lora-alpha set LoRA adapters: add --lora-r"),
        (["--lora-r", "-1"], "--lora-r -1: must be at least 0"),
        (
            ["--lora-r", "4", "--lora-alpha", "-1", *("--dataset", "prompts.jsonl", "--reward", "exact_match")],
            "--lora-alpha -1.0: the adapters' scale is alpha / r, so at least 0",
        ),
        (
            [
                "--lora-r",
                "4",
                "--lora-target-modules",
                " ,",
                *("--dataset", "prompts.jsonl", "--reward", "exact_match"),
            ],
            "--lora-target-modules: name the layers to adapt",
        ),
        (["--lora-r", "4"], "--lora-r 4 adapts a Hugging Face model's linear layers (--task hf"),
        (
            ["--lora-r", "4", "--trainer-ranks", "2", *("--dataset", "prompts.jsonl", "--reward", "exact_match")],
            "--lora-r with --trainer-ranks 2 --trainer-shard fsdp: the adapters are small and the base is frozen",
        ),
        (
            ["--lora-r", "4", "--sync-ref-model", *("--dataset", "prompts.jsonl", "--reward", "exact_match")],
            "--lora-r with --sync-ref-model: the reference is the base model under the adapters",
        ),
        (["--num-generations-eval", "4"], "--num-generations-eval 4 samples a Hugging Face model's held-out"),
        (["--num-generations-eval", "-1"], "--num-generations-eval -1: must be at least 0"),
        (["--trust-remote-code"], "--trust-remote-code lets a Hugging Face model's own code run (--task hf"),
        (["--chat-template-kwargs", '{"hint": "x"}'], "--chat-template-kwargs sets a Hugging Face tokenizer's chat"),
        (
            [
                *("--chat-template-kwargs", '{"tokenize": false, "add_generation_prompt": false, "hint": 1}'),
                *("--dataset", "prompts.jsonl", "--reward", "exact_match"),
            ],
            "--chat-template-kwargs add_generation_prompt, tokenize: the pipeline sets these itself",
        ),
    ],
)
def test_a_setting_that_cannot_train_is_one_line_and_exit_2(tmp_path, capsys, flags, message):
    run_dir = tmp_path / "run"
    code = main([*flags, "--run-dir", str(run_dir), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {message}"), err
    assert err.count("\n") == 1 and not run_dir.exists()


def test_an_earlier_runs_export_left_staged_by_a_kill_never_becomes_the_fresh_runs_model(tmp_path):
    """An earlier run killed between its export's two renames left ``model.tmp-<pid>`` (complete) and
    ``model.old-<pid>``, no ``model/``: ``--overwrite`` removed its outputs but not these, and the clean-up of
    killed saves then put its model in place for the fresh run (a run without ``--overwrite`` was not even
    refused). They count as the earlier run's outputs: refused, or removed with them."""
    import subprocess
    import sys

    from pipeline.learning.checkpoint import remove_stale_staging
    from pipeline.run._run_dir import refuse_earlier_run, remove_earlier_run

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # (a pid whose process has exited)
    run_dir = tmp_path / "run"
    for name in (f"model.tmp-{gone.pid}", f"model.old-{gone.pid}"):
        (run_dir / name).mkdir(parents=True)
        (run_dir / name / "config.json").write_text("{}")
    with pytest.raises(SettingsError, match=rf"holds an earlier run \(model.old-{gone.pid}/, model.tmp-{gone.pid}/\)"):
        refuse_earlier_run(str(run_dir))
    remove_earlier_run(str(run_dir))
    remove_stale_staging(str(run_dir))
    assert os.listdir(run_dir) == []


def test_a_sharded_checkpoint_syncs_its_folder_before_the_file_that_names_it(tmp_path, monkeypatch):
    """The folder of shards was never synced before ``checkpoint.pt`` named it (its last entry is renamed into
    it), and the previous shards were then removed: after a power loss the file could name a folder without it."""
    from pipeline.learning import checkpoint

    events: list[str] = []
    sync, replace = checkpoint.sync_path, os.replace
    monkeypatch.setattr(
        checkpoint, "sync_path", lambda where: (events.append(f"sync {os.path.basename(where)}"), sync(where))[1]
    )
    monkeypatch.setattr(
        checkpoint.os, "replace", lambda a, b: (events.append(f"replace {os.path.basename(b)}"), replace(a, b))[1]
    )
    (tmp_path / "checkpoint-3-ab.dcp").mkdir()
    checkpoint.save(str(tmp_path), {"step": 3, checkpoint.SHARDS: "checkpoint-3-ab.dcp"})
    assert events.index("sync checkpoint-3-ab.dcp") < events.index("replace checkpoint.pt")


def test_a_fresh_run_in_a_folder_holding_an_earlier_run_is_refused_and_loses_nothing(tmp_path, capsys):
    """The earlier run's checkpoint was deleted without a word, and its completions, TensorBoard events and model
    stayed beside the new run's; now the run is refused (exit 2, nothing touched) unless --overwrite is given."""
    from pipeline.run._run_dir import refuse_earlier_run, remove_earlier_run

    run_dir = tmp_path / "run"
    (run_dir / "tensorboard").mkdir(parents=True)
    (run_dir / "checkpoint-3.dcp").mkdir()
    for name in ("config.json", "checkpoint.pt", "completions.jsonl", "notes.txt"):
        (run_dir / name).write_text("kept")
    code = main(["--run-dir", str(run_dir), "--steps", "2", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: --run-dir {run_dir} holds an earlier run (config.json, "), err
    assert f"--resume {run_dir}" in err and "--overwrite" in err and "checkpoint-3.dcp/" in err
    assert sorted(os.listdir(run_dir)) == [
        "checkpoint-3.dcp",
        "checkpoint.pt",
        "completions.jsonl",
        "config.json",
        "notes.txt",
        "tensorboard",
    ]
    remove_earlier_run(str(run_dir))
    assert os.listdir(run_dir) == ["notes.txt"], "the earlier run's outputs go; the user's own file stays"
    refuse_earlier_run(str(tmp_path / "new"))  # a folder that does not exist yet is fresh
    with pytest.raises(SettingsError, match="--overwrite with --resume"):
        (run_dir / "config.json").write_text(json.dumps(Config(steps=10, device="cpu").to_dict()))
        parse_args(["--resume", str(run_dir), "--overwrite"])


@pytest.mark.parametrize(
    "value, message", [("{hint: 1}", "'{hint: 1}' is not JSON"), ('["hint"]', """'["hint"]' is not a JSON object""")]
)
def test_chat_template_kwargs_are_a_json_object(tmp_path, capsys, value, message):
    with pytest.raises(SystemExit) as exited:
        main(["--chat-template-kwargs", value, "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and f"argument --chat-template-kwargs: {message}" in err, err
    with pytest.raises(SettingsError, match="--chat-template-kwargs 'hint': a JSON object of the template's variables"):
        check_settings(Config(task="hf", chat_template_kwargs="hint"))  # type: ignore[arg-type]


def test_resume_of_a_folder_that_is_no_run(tmp_path, capsys):
    assert main(["--resume", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: --resume {tmp_path}: not a run folder (it has no config.json)\n"
    (tmp_path / "config.json").write_text("{not json")
    assert main(["--resume", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"error: --resume {tmp_path}: its config.json cannot be read")


@pytest.mark.parametrize("digits, eval_size", [(1, 256), (2, 256), (2, 51), (3, 501)])
def test_a_prompt_space_too_small_for_both_sets_is_refused_before_anything_starts(tmp_path, capsys, digits, eval_size):
    before = actor_pids()
    run_dir = tmp_path / "run"
    code = main(["--digits", str(digits), "--eval-size", str(eval_size), "--run-dir", str(run_dir), "--quiet"])
    err = capsys.readouterr().err
    space = 10**digits
    assert code == 1 and err.count("\n") == 1, err
    assert f"reverse has {space} distinct prompts, too few for {eval_size} held-out ones" in err
    assert f"--eval-size at most {space // 2}" in err
    assert actor_pids() == before


@pytest.mark.parametrize("task, digits, short", [("reverse", 6, 6), ("add", 3, 4)])
def test_a_completion_limit_with_no_room_for_the_answer_and_its_end_is_refused(task, digits, short):
    """The verifier reads the answer's digits and an end token: a shorter ``--max-new-tokens`` trained on with
    nothing ever right (accuracy 0, the target never reached), and with ``--mask-truncated`` only wrong answers
    trained."""
    with pytest.raises(ValueError, match=f"--max-new-tokens {short}: {task}'s answer is {short} digits and an end"):
        DigitsTask(resolve(Config(task=task, digits=digits, max_new_tokens=short)))
    assert DigitsTask(resolve(Config(task=task, digits=digits, max_new_tokens=short + 1))).max_new_tokens == short + 1


@pytest.mark.parametrize("digits, eval_size", [(1, 5), (2, 50)])
def test_a_small_prompt_space_splits_into_disjoint_held_out_and_training_sets(digits, eval_size):
    task = DigitsTask(resolve(Config(digits=digits, eval_size=eval_size, prompts=64)))
    assert len(task.held_out) == eval_size, "the held-out prompts are distinct"
    batch = task.sample(task.build_policy(), torch.Generator().manual_seed(0))
    drawn = {task.problem.key(prompt) for prompt in batch.prompts}
    assert drawn and not drawn & task.held_out
    assert len(drawn) <= 10**digits - eval_size


def test_every_setting_a_run_refuses_is_refused_by_the_api_too():
    with pytest.raises(SettingsError, match="--group 1"):
        check_settings(Config(group=1))
    with pytest.raises(SettingsError, match="--loss ppo: choose one of grpo, dr_grpo, dapo, cispo, sapo, luspo, vespo"):
        check_settings(Config(loss="ppo"))  # type: ignore[arg-type]
    with pytest.raises(SettingsError, match="--scale-rewards mean: choose one of group, batch, none"):
        check_settings(Config(scale_rewards="mean"))  # type: ignore[arg-type]
    with pytest.raises(SettingsError, match="--trainer-shard zero: choose one of ddp, fsdp"):
        check_settings(Config(trainer_ranks=2, trainer_shard="zero"))  # type: ignore[arg-type]
    with pytest.raises(SettingsError, match="--decode fast: choose one of auto, dynamic, static, graphs"):
        check_settings(Config(decode="fast"))  # type: ignore[arg-type]
    check_settings(Config())  # the defaults train


def test_cispo_caps_the_ratio_at_5_unless_given_and_the_trl_flags_reach_the_config():
    """cispo's --epsilon-high is the cap on the ratio itself (ScaleRL's 5 by default), not the clip's 1 + eps."""
    config, _ = parse_args(["--loss", "cispo", "--off-policy-mask-threshold", "0.5", "--use-bias-correction-kl"])
    resolved = resolve(config)
    assert (resolved.loss, resolved.epsilon_high, resolved.clip) == ("cispo", 5.0, 0.2)
    assert resolved.off_policy_mask_threshold == 0.5 and resolved.use_bias_correction_kl
    given, _ = parse_args(["--loss", "cispo", "--epsilon-high", "2"])
    assert resolve(given).epsilon_high == 2.0
    gdpo = Config(task="hf", multi_objective_aggregation="normalize_then_sum")
    assert resolve(gdpo).scale_rewards == "batch", "GDPO normalises the decoupled sum over the batch"


def test_gdpo_is_for_any_task_with_reward_functions_and_resolves_to_the_batchs_std():
    from pipeline.tasks import check_task_settings

    check_task_settings(Config(task="pipeline.tasks:HFTask", multi_objective_aggregation="normalize_then_sum"))
    for loss in ("dapo", "dr_grpo"):
        gdpo = Config(task="hf", loss=loss, multi_objective_aggregation="normalize_then_sum")
        check_settings(gdpo)
        assert resolve(gdpo).scale_rewards == "batch", loss
    check_settings(Config(task="hf", scale_rewards="batch", multi_objective_aggregation="normalize_then_sum"))


def test_the_hugging_face_settings_are_for_any_subclass_of_the_hf_task():
    from pipeline.tasks import check_task_settings

    hf_only = dict(
        num_generations_eval=2, chat_template_kwargs={"enable_thinking": False}, trust_remote_code=True, lora_r=4
    )
    check_task_settings(Config(task="pipeline.tasks:HFTask", **hf_only))  # type: ignore[arg-type]
    for name, value in hf_only.items():
        with pytest.raises(SettingsError, match=f"--{name.replace('_', '-')} .*--task pipeline.tasks:DigitsTask"):
            check_task_settings(Config(task="pipeline.tasks:DigitsTask", **{name: value}))  # type: ignore[arg-type]


def test_vllm_log_probs_of_a_filtered_distribution_anchor_no_clip():
    """With a temperature and a filter vLLM reports the filtered distribution's log-probs: accepted with an
    importance-sampling correction (the clip's anchor is then the trainer's own), or with either alone."""
    hf = dict(task="hf", dataset="prompts.jsonl", rewards=("exact_match",), engine="vllm")
    check_settings(Config(temperature=0.7, min_p=0.1, is_correction="tis", **hf))  # type: ignore[arg-type]
    check_settings(Config(temperature=1.0, top_p=0.9, **hf))  # type: ignore[arg-type]
    check_settings(Config(temperature=0.7, **hf))  # type: ignore[arg-type]
    with pytest.raises(SettingsError, match="add --is-correction tis"):
        check_settings(Config(temperature=0.7, repetition_penalty=1.2, **hf))  # type: ignore[arg-type]
    with pytest.raises(SettingsError, match="--off-policy-mask-threshold measures"):
        check_settings(Config(temperature=0.7, top_k=5, is_correction="tis", off_policy_mask_threshold=0.5, **hf))  # type: ignore[arg-type]


def test_a_run_saved_with_settings_its_switches_never_used_resumes_without_them(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"task": "digits", "is_cap": 3.0, "sapo_temperature_pos": 2.0}))
    config, _ = parse_args(["--resume", str(tmp_path)])
    assert (config.is_correction, config.is_cap, config.sapo_temperature_pos) == ("none", 2.0, 1.0)
    check_settings(config)


def test_a_bandit_run_saved_with_sampler_settings_it_never_used_resumes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"task": "bandit", "temperature": 0.7, "top_p": 0.9}))
    config, _ = parse_args(["--resume", str(tmp_path)])
    assert (config.task, config.temperature, config.top_p) == ("bandit", 1.0, 1.0)


def test_new_flags_reach_the_config_and_its_resolved_defaults():
    config, _ = parse_args(
        ["--loss", "dr_grpo", "--clip", "0.1", "--mask-truncated", "--micro-batch", "64", "--kl-coeff", "0"]
    )
    resolved = resolve(config)
    assert (resolved.loss, resolved.scale_rewards, resolved.epsilon_high) == ("dr_grpo", "none", 0.1)
    assert resolved.mask_truncated and resolved.micro_batch == 64 and resolved.kl_coeff == 0
    assert resolved.off_policy_mask_threshold is None and not resolved.use_bias_correction_kl
    assert (resolved.dual_clip, resolved.max_grad_norm, resolved.lr_schedule, resolved.dtype) == (
        3.0,
        1.0,
        "constant",
        "float32",
    )
    assert resolve(parse_args([])[0]).scale_rewards == "group"
    assert parse_args([])[0].disable_dropout, "--no-disable-dropout reaches the config: refused for a digit task"


def test_the_command_line_refuses_with_one_line_and_no_traceback(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), ROOT]))
    proc = run_python("-m", "pipeline.grpo", "--group", "1", "--run-dir", str(tmp_path / "run"), timeout=60, env=env)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --group 1:") and proc.stderr.count("\n") == 1
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


def test_resume_takes_a_flag_however_it_is_spelt(tmp_path):
    """``--steps=7`` and an abbreviation argparse accepts (``--step 8``) are the flag as much as ``--steps 7``."""
    (tmp_path / "config.json").write_text(json.dumps(Config(steps=10, device="cpu").to_dict()))
    assert parse_args(["--resume", str(tmp_path)])[0].steps == 10
    assert parse_args(["--resume", str(tmp_path), "--steps", "6"])[0].steps == 6
    assert parse_args(["--resume", str(tmp_path), "--steps=7"])[0].steps == 7
    assert parse_args(["--resume", str(tmp_path), "--step", "8"])[0].steps == 8
    assert parse_args([f"--resume={tmp_path}", "--target-score=0.5"])[0].target_score == 0.5
    assert parse_args(["--resume", str(tmp_path), "--stop-grace", "90"])[0].stop_grace == 90, "a run-time setting"


def test_resume_refuses_a_setting_it_would_not_change_by_name(tmp_path):
    """A resumed run keeps its saved settings: a flag it would silently ignore (``--lr``) is refused, naming it and
    the ones that may change (before, ``--resume DIR --lr 1e-3`` trained at the saved rate without a word)."""
    (tmp_path / "config.json").write_text(json.dumps(Config(steps=10, device="cpu").to_dict()))
    with pytest.raises(SettingsError, match=r"--lr, --seed: .*cannot change.*--steps"):
        parse_args(["--resume", str(tmp_path), "--seed", "3", "--lr=1e-3", "--steps", "12"])
    with pytest.raises(SettingsError, match=r"--eval-dataset"):
        parse_args(["--resume", str(tmp_path), "--eval-dataset", "x.jsonl"])
    config, _ = parse_args(["--resume", str(tmp_path), "--quiet", "--trainer-device", "cpu", "--steps", "12"])
    assert config.steps == 12


@pytest.mark.parametrize(
    "name, value",
    [
        ("kl_coeff", float("nan")),
        ("kl_coeff", float("inf")),
        ("max_grad_norm", float("nan")),
        ("lr", float("inf")),
        ("temperature", float("inf")),
        ("clip", float("nan")),
    ],
)
def test_a_setting_that_is_not_a_finite_number_is_refused(name, value):
    """NaN passed every ``value < low`` check: --kl-coeff nan turned the KL term off, --max-grad-norm nan turned
    clipping off, --kl-coeff inf made the first step's loss NaN; all quietly."""
    flag = "--" + name.replace("_", "-")
    with pytest.raises(SettingsError, match=f"{flag} {value}: must be a finite number"):
        check_settings(Config(**{name: value}))  # type: ignore[arg-type]


def test_the_one_process_run_refuses_what_the_task_cannot_honour_as_the_pipeline_does():
    """The one-process run checked only the settings any run needs: a bandit's ignored sampler settings or a
    reference sync with no KL term trained quietly there, while the pipeline refused them."""
    from pipeline.learning import train_one_process

    with pytest.raises(SettingsError, match="--temperature with --task bandit"):
        train_one_process(Config(task="bandit", temperature=0.5, steps=1))
    with pytest.raises(SettingsError, match="--sync-ref-model with --kl-coeff 0"):
        train_one_process(Config(task="bandit", sync_ref_model=True, kl_coeff=0.0, steps=1))


@pytest.mark.parametrize("loss", ["dapo", "dr_grpo", "cispo"])
def test_a_sequence_ratio_with_a_loss_that_sums_tokens_is_trained_with_a_warning(loss):
    """GSPO's sequence ratio with a loss that sums token terms weighs each completion by its length: not GSPO
    (TRL warns the same); the default loss is dapo, so ``--importance-sampling-level sequence`` alone did this."""
    with pytest.warns(UserWarning, match=f"--importance-sampling-level sequence with --loss {loss}: .*(--loss grpo)"):
        check_settings(Config(importance_sampling_level="sequence", loss=loss))  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_settings(Config(importance_sampling_level="sequence", loss="grpo"))


def _documented_commands() -> list[tuple[str, list[str]]]:
    """Every ``python -m pipeline.grpo`` command in a fenced block of the README and docs/: (file, its flags)."""
    import glob
    import re
    import shlex

    found = []
    for path in [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        text = open(path).read()
        for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M):
            for line in block.replace("\\\n", " ").splitlines():
                command = line.split(" #")[0].split("&&")[-1].strip().removeprefix("$ ")
                if command.startswith("python -m pipeline.grpo"):
                    found.append((os.path.basename(path), shlex.split(command)[3:]))
    return found


def test_every_command_line_the_docs_show_takes_its_flags():
    """A flag renamed or removed leaves no documented command that argparse would refuse."""
    from pipeline.run._cli import build_parser

    commands = _documented_commands()
    assert len(commands) >= 6, commands
    for where, flags in commands:
        try:
            build_parser().parse_args(flags)
        except SystemExit:
            pytest.fail(f"{where}: python -m pipeline.grpo {' '.join(flags)}: argparse refuses it")


def test_two_runs_started_in_the_same_second_get_two_run_folders(monkeypatch):
    """The default ``--run-dir`` was ``runs/grpo-<second>``: two runs of a sweep started together shared it, and
    the second one's first row dropped every row the first had written. It names the process now."""
    from pipeline.run import _cli

    monkeypatch.setattr(_cli.time, "strftime", lambda pattern: "grpo-20261129-120000")
    first = parse_args(["--steps", "2"])[0].run_dir
    monkeypatch.setattr(_cli.os, "getpid", lambda: 4242)
    second = parse_args(["--steps", "2"])[0].run_dir
    assert first != second and os.path.dirname(first) == "runs"
    assert os.path.basename(second).startswith("grpo-20261129-120000")


def test_a_resumed_run_drops_the_logged_completions_past_its_checkpoint(tmp_path):
    """A run killed at step 37 after checkpointing at 20 had logged the evaluations at 30: the resumed run
    evaluates step 30 again, and its rows were appended beside the first ones, two copies no reader could tell
    apart. Those past the checkpoint go; rows with no step (an older version's) and the rest stay."""
    from pipeline.run._run_dir import drop_completions_after

    rows = [{"prompt": "old"}, {"step": 10, "prompt": "a"}, {"step": 20, "prompt": "b"}, {"step": 30, "prompt": "c"}]
    path = tmp_path / "completions.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"step": 40, "pro')  # (a torn last row)
    assert drop_completions_after(str(tmp_path), 20) == 2
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:3]
    assert drop_completions_after(str(tmp_path), 20) == 0 and os.listdir(tmp_path) == ["completions.jsonl"]
    assert drop_completions_after(str(tmp_path / "nothing"), 1) == 0


def test_config_json_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    """``config.json`` was rewritten in place on every run, ``--resume`` too: a full disk left it empty and the
    run could never be resumed (``its config.json cannot be read``). It is written beside, then renamed."""
    from pipeline.run import _run_dir

    config = Config(steps=10, device="cpu")
    synced: list[int] = []
    fsync = os.fsync
    monkeypatch.setattr(_run_dir.os, "fsync", lambda fd: synced.append(fd) or fsync(fd))
    _run_dir.write_config(str(tmp_path), config)
    before = (tmp_path / "config.json").read_text()
    assert len(synced) >= 2, "the file on disk before its new name, and the name too (a power loss left it empty)"

    def disk_full(value: object, f: Any, **_: object) -> None:
        f.write("{")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_run_dir.json, "dump", disk_full)
    with pytest.raises(OSError, match="No space"):
        _run_dir.write_config(str(tmp_path), Config(steps=20, device="cpu"))
    assert (tmp_path / "config.json").read_text() == before
    assert os.listdir(tmp_path) == ["config.json"], "no staging file left"
