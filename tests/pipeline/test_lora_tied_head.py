"""LoRA targets that include a tied output head are refused, naming it: the generators' tied model holds one matrix
for the embeddings and the head, so a merged W + BA for the head alone cannot reach them."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("peft", reason="needs the hf extra: pip install -e '.[hf]'")

import transformers
from pipeline_support import tiny_qwen2

from pipeline.models import LoraAdapter, ModelError, check_lora_targets

TIED = r"--lora-target-modules {}: lm_head is the model's output head, tied to its input embeddings .*untie"


@pytest.mark.parametrize("targets", ["q_proj,lm_head", "lm_head", "v_proj, lm_head "])
def test_lora_on_a_tied_head_is_refused_naming_it(targets):
    model = tiny_qwen2()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(ModelError, match=TIED.format(re.escape(targets))):
        LoraAdapter(model, 4, 8.0, targets)
    assert not any(".lora_" in name for name, _ in model.named_parameters()), "refused before any adapter is injected"


def test_lora_target_modules_with_a_tied_head_are_refused_before_the_run(tmp_path):
    """The launcher's check (HFTask.check, on the meta device: no weights load) refuses it as the learner would."""
    tiny_qwen2().save_pretrained(tmp_path / "tied")
    with pytest.raises(ModelError, match=TIED.format("q_proj,lm_head")):
        check_lora_targets(str(tmp_path / "tied"), "q_proj,lm_head")
    check_lora_targets(str(tmp_path / "tied"), "all-linear")  # PEFT's all-linear leaves the output head out


def test_lora_on_an_untied_head_and_all_linear_on_a_tied_model_are_taken():
    config = tiny_qwen2().config
    config.tie_word_embeddings = False
    untied = transformers.Qwen2ForCausalLM(config)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    merged = LoraAdapter(untied, 4, 8.0, "q_proj,lm_head").merged_state()
    assert "lm_head.weight" in merged and "model.embed_tokens.weight" in merged
    tied = tiny_qwen2()
    merged = LoraAdapter(tied, 4, 8.0, "all-linear").merged_state()
    head, embeddings = merged["lm_head.weight"], merged["model.embed_tokens.weight"]
    assert head.data_ptr() == embeddings.data_ptr(), "the tied head is the embeddings, unadapted"
