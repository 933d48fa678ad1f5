"""Weights a checkpoint may lack (``RuleSet.fresh``): transformers' ``BertModel(add_pooling_layer=False)`` saves no
pooler, and transformers loads such a checkpoint as a BertModel whose pooler starts from random init, with a
warning. So does ``from_pretrained`` here, and the task heads load from it; any other missing key still raises."""

import logging

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import flash_models as fm
from flash_models.checkpoint.remap import CheckpointKeyError
from flash_models.models.bert import BertForSequenceClassification, BertModel
from flash_models.testing import max_rel_err, randomize_

STD = 0.05


@pytest.fixture
def poolerless(tmp_path):
    """A pooler-less HF BertModel with random weights, saved by transformers; (model, folder)."""
    config = transformers.BertConfig(vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=80, max_position_embeddings=24, initializer_range=STD)
    torch.manual_seed(0)
    hf = randomize_(transformers.BertModel(config, add_pooling_layer=False), seed=3).eval()
    hf.save_pretrained(tmp_path)
    assert not any(k.startswith("pooler.") for k in load_file(tmp_path / "model.safetensors"))
    return hf, tmp_path


def batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (3, 11), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    return ids, mask


def test_a_checkpoint_without_pooler_loads_with_a_fresh_pooler(poolerless, caplog):
    hf, path = poolerless
    with caplog.at_level(logging.WARNING, logger="flash_models.checkpoint.loader"):
        ours = fm.from_pretrained(path)
    assert "holds no pooler.dense.bias, pooler.dense.weight" in caplog.text and "randomly initialised" in caplog.text
    assert type(ours) is BertModel and not ours.training
    ids, mask = batch()
    with torch.no_grad():
        out, ref = ours(ids, attention_mask=mask), hf(ids, attention_mask=mask)
    real = mask.bool()
    assert max_rel_err(out.last_hidden_state[real], ref.last_hidden_state[real]) < 1e-5
    # The pooler as transformers initialises it: N(0, initializer_range) weights, zero bias.
    weight, bias = ours.pooler.weight, ours.pooler.bias
    assert not weight.is_meta and torch.count_nonzero(bias) == 0
    assert abs(weight.std().item() - STD) < 0.2 * STD
    expected = torch.tanh(out.last_hidden_state[:, 0] @ weight.T + bias)
    torch.testing.assert_close(out.pooler_output, expected)


def test_a_task_head_loads_from_a_checkpoint_without_pooler(poolerless):
    hf, path = poolerless
    model = BertForSequenceClassification.from_pretrained(path, num_labels=3, dtype=torch.bfloat16)
    assert model.config.num_labels == 3 and model.bert.pooler.weight.dtype == torch.bfloat16
    ids, mask = batch(1)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        hidden = model.bert(ids, attention_mask=mask).last_hidden_state.float()
        ref = hf(ids, attention_mask=mask).last_hidden_state
    assert logits.shape == (3, 3) and torch.isfinite(logits).all()
    assert max_rel_err(hidden[mask.bool()], ref[mask.bool()]) < 2e-2  # bf16


def test_other_missing_weights_still_raise(poolerless):
    _, path = poolerless
    state = load_file(path / "model.safetensors")
    del state["encoder.layer.1.output.dense.bias"]
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointKeyError, match=r"missing keys \(3\): encoder\.layer\.1\.output\.dense\.bias, pooler"):
        fm.from_pretrained(path)
