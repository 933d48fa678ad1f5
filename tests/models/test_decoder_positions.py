"""The plain forward numbers positions as each family's HF forward does (0..S-1 for most, counted from the
mask for OPT), for every registered decoder family, on left- and right-padded batches; ``mask_positions``
switches rule."""

import pytest
import torch

import flash_models as fm
from flash_models.registry import get_preset
from flash_models.testing import max_rel_err, ours_from_hf, random_hf_model
from tests.models.test_contract import DECODERS, tiny_overrides

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models stepped one token at a time

ONE_PER_FAMILY = list({get_preset(name).model_type: name for name in DECODERS}.values())


def padded_batch():
    ids = torch.randint(0, 128, (3, 12))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    mask[1, 7:] = 0  # right padding
    return ids, mask


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_default_positions_match_hf_without_position_ids(name):
    tiny = fm.create_model(name, **tiny_overrides(get_preset(name)))
    hf = random_hf_model(tiny.config.to_hf(), seed=3, attn_implementation="eager")
    ours = ours_from_hf(hf)
    ids, mask = padded_batch()
    real = mask.bool()
    counted = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).logits
        out = ours(ids, attention_mask=mask).logits
        assert max_rel_err(out[real], ref[real]) < 1e-5
        ref = hf(ids, attention_mask=mask, position_ids=counted).logits
        out = ours(ids, attention_mask=mask, mask_positions=True).logits
        assert max_rel_err(out[real], ref[real]) < 1e-5
        ref = hf(ids, attention_mask=mask, position_ids=torch.arange(12).expand(3, 12)).logits
        out = ours(ids, attention_mask=mask, mask_positions=False).logits
        assert max_rel_err(out[real], ref[real]) < 1e-5


def test_mask_positions_false_with_a_kv_cache_is_refused():
    model = fm.create_model("gpt2", n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=32)
    with pytest.raises(ValueError, match="mask_positions=False cannot be combined with a KV cache"):
        model(torch.tensor([[1, 2, 3]]), kv_cache=model.new_kv_cache(1, 8), mask_positions=False)


@pytest.mark.parametrize("cached", [False, True])
def test_a_mask_that_is_not_batch_by_keys_is_named(cached):
    """4-D, 1-D, another batch, or fewer columns than new tokens: a ValueError saying what the mask must be, not a
    broadcast or indexing error from inside the attention."""
    model = fm.create_model("gpt2", n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=32)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    for mask in (torch.ones(2, 1, 3, 3), torch.ones(3), torch.ones(3, 3), torch.ones(2, 2)):
        with pytest.raises(ValueError, match=r"attention_mask must be \(batch, keys\)"):
            model(ids, attention_mask=mask, kv_cache=model.new_kv_cache(2, 8) if cached else None)
