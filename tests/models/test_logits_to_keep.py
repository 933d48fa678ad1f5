"""``logits_to_keep`` (HF's argument): the logits of the last positions only, equal to the full forward's."""

import pytest
import torch
import transformers

from flash_models.testing import ours_from_hf, random_hf_model


@pytest.fixture(scope="module")
def model():
    config = transformers.LlamaConfig(vocab_size=123, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return ours_from_hf(random_hf_model(config, seed=5))


@pytest.mark.parametrize("keep", [1, 3, 11])
def test_last_positions_equal_the_full_forward(model, keep):
    ids = torch.randint(0, 123, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        kept = model(ids, attention_mask=mask, logits_to_keep=keep).logits
    assert kept.shape == (2, keep, 123)
    torch.testing.assert_close(kept, full[:, -keep:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [-1, True, 1.0])
def test_bad_values_are_refused(model, bad):
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(torch.randint(0, 123, (1, 5)), logits_to_keep=bad)


def test_not_with_labels(model):
    ids = torch.randint(0, 123, (1, 5))
    with pytest.raises(ValueError, match="cannot go with labels"):
        model(ids, labels=ids, logits_to_keep=1)
