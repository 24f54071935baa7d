"""LoRA targets that include a tied output head or the input embeddings it is tied to are refused, naming it: the
generators' tied model holds one matrix for the embeddings and the head, so a merged W + BA for one alone cannot
reach them."""

from __future__ import annotations

import re

import pytest
import torch

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


@pytest.mark.parametrize("targets", ["q_proj,embed_tokens", "embed_tokens"])
def test_lora_on_the_embeddings_a_head_is_tied_to_is_refused_naming_them(targets, tmp_path):
    """Before, taken: the trainer embedded with W + BA and decoded with W while the generators' tied model got one
    of the two (the head's, loaded last), so they sampled from another policy and the export lost the adapter."""
    embeddings = rf"--lora-target-modules {re.escape(targets)}: model.embed_tokens is the model's input embeddings, "
    with pytest.raises(ModelError, match=embeddings + "tied to its output head .*untie"):
        LoraAdapter(tiny_qwen2(), 4, 8.0, targets)
    tiny_qwen2().save_pretrained(tmp_path / "tied")
    with pytest.raises(ModelError, match=embeddings):
        check_lora_targets(str(tmp_path / "tied"), targets)


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
    adapter = LoraAdapter(untied, 4, 8.0, "q_proj,lm_head,embed_tokens")
    with torch.no_grad():
        for name, weight in untied.named_parameters():
            if ".lora_" in name:
                weight.normal_(0, 0.5)  # B starts at 0: a trained adapter's pair is not
    merged = adapter.merged_state()
    assert "lm_head.weight" in merged and "model.embed_tokens.weight" in merged
    plain = transformers.Qwen2ForCausalLM(config)
    plain.load_state_dict(merged)
    tokens = torch.arange(1, 9).view(1, 8)
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens).logits, untied(tokens).logits, atol=1e-5, rtol=1e-5)
    tied = tiny_qwen2()
    merged = LoraAdapter(tied, 4, 8.0, "all-linear").merged_state()
    head, embeddings = merged["lm_head.weight"], merged["model.embed_tokens.weight"]
    assert head.data_ptr() == embeddings.data_ptr(), "the tied head is the embeddings, unadapted"
