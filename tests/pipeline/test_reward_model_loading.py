"""A reward model's weights load before its first timed call: a load slower than ``--reward-timeout`` is not a
reward that missed its deadline, and a load that fails says so, naming the reward model."""

from __future__ import annotations

import re
import time

import pytest

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

import transformers
from pipeline_support import tiny_qwen2

from pipeline.tasks import RewardError, RewardSet

TIMEOUT = 1.0  # --reward-timeout: scoring two rows with the tiny model takes far less


@pytest.fixture(scope="module")
def judge(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A random one-label Qwen2 sequence classifier and a word-level tokenizer: a reward model's folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("reward-model-loading") / "judge"
    words = {"<pad>": 0, "<unk>": 1, **{w: n + 2 for n, w in enumerate("abcdefgh")}}
    core = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>")
    config = tiny_qwen2(len(words), num_labels=1, pad_token_id=0).config
    transformers.Qwen2ForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _loads(monkeypatch, effect):  # type: ignore[no-untyped-def]
    """from_pretrained of a sequence classifier runs ``effect`` first; the list of the sources it loaded."""
    real = transformers.AutoModelForSequenceClassification.from_pretrained
    loaded: list[str] = []

    def from_pretrained(source, *args, **kwargs):  # type: ignore[no-untyped-def]
        effect()
        loaded.append(source)
        return real(source, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForSequenceClassification, "from_pretrained", from_pretrained)
    return loaded


async def test_a_reward_model_that_loads_slower_than_the_reward_timeout_still_scores(judge, monkeypatch):
    loaded = _loads(monkeypatch, lambda: time.sleep(2 * TIMEOUT))  # the slow load simulated, not a wait on it
    rewards = RewardSet([judge], timeout=TIMEOUT)
    assert loaded == [], "naming a reward model loads no weights (the launcher's check builds a RewardSet too)"
    first = await rewards.score(["a b", "c"], [" d", " e f"], {})
    again = await rewards.score(["a b", "c"], [" d", " e f"], {})
    assert first.shape == (1, 2) and not first.isnan().any()
    assert again.tolist() == first.tolist() and loaded == [judge], "loaded once, before the first timed call"


async def test_a_reward_model_whose_weights_fail_to_load_is_named(judge, monkeypatch):
    def fail() -> None:
        raise OSError("the disk went away")

    _loads(monkeypatch, fail)
    rewards = RewardSet([f"{judge}=2"], timeout=TIMEOUT)
    with pytest.raises(
        RewardError, match=rf"--reward {re.escape(judge)}: its weights cannot be loaded \(OSError: the disk went"
    ):
        await rewards.score(["a"], [" b"], {})
