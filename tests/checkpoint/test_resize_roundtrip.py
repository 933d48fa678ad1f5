"""Every decoder family, tied and untied: a vocabulary grown by resize_token_embeddings survives save_pretrained
into transformers, and transformers' own resized checkpoint loads here, with the same logits."""

import pytest
import torch
import transformers

import flash_models as fm
from flash_models.registry import families, get_family
from flash_models.testing import max_rel_err

CASES = [(name, tied) for name in families() if get_family(name).hf_auto_class == "AutoModelForCausalLM"
         for tied in (True, False) if not (name == "gptj" and tied)]  # GPT-J's head has a bias: never tied


def _hf_model(name, tied):
    family = get_family(name)
    preset = family.presets[0].hf_config
    config = transformers.AutoConfig.for_model(name, **{**preset, **family.tiny(preset), "tie_word_embeddings": tied})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("name, tied", CASES)
def test_resized_vocabulary_round_trips_with_transformers(name, tied, tmp_path):
    hf = _hf_model(name, tied)
    vocab = hf.config.vocab_size
    hf.save_pretrained(tmp_path / "hf")
    ours = fm.from_pretrained(tmp_path / "hf")
    ours.resize_token_embeddings(vocab + 5)
    ours.save_pretrained(tmp_path / "ours")
    reread = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert reread.config.tie_word_embeddings == tied and reread.config.vocab_size == vocab + 5
    ids = torch.randint(0, vocab + 5, (2, 9))
    with torch.no_grad():
        assert max_rel_err(ours(ids).logits, reread(ids).logits) < 1e-5
    hf.resize_token_embeddings(vocab + 7)
    hf.save_pretrained(tmp_path / "hf-resized")
    again = fm.from_pretrained(tmp_path / "hf-resized")
    assert again.config.tie_word_embeddings == tied
    ids = torch.randint(0, vocab + 7, (2, 9))
    with torch.no_grad():
        assert max_rel_err(again(ids).logits, hf(ids).logits) < 1e-5
