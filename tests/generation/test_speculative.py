"""Speculative decoding honours every setting plain greedy honours (same tokens, same scores), or refuses
it by name."""

import pytest
import torch

from flash_models.testing import ours_from_hf
from tests.generation.test_generate import VOCAB, gpt2_hf, left_padded_batch, llama_hf

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models stepped one token at a time


@pytest.fixture(scope="module")
def pair():
    return ours_from_hf(llama_hf(seed=30)), ours_from_hf(llama_hf(seed=31, num_hidden_layers=1))


def assert_speculative_equals_greedy(target, draft, ids, mask, **kwargs):
    greedy = target.generate(ids, attention_mask=mask, **kwargs)
    for k in (1, 3):
        spec = target.generate(ids, attention_mask=mask, draft_model=draft, num_draft_tokens=k, **kwargs)
        assert torch.equal(spec, greedy), k
    return greedy


def test_repetition_penalty(pair):
    target, draft = pair
    ids, mask = left_padded_batch()
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=[])
    penalized = assert_speculative_equals_greedy(target, draft, ids, mask, max_new_tokens=24, eos_token_id=[],
                                                 repetition_penalty=1.6)
    assert not torch.equal(penalized, plain)  # the penalty changes what greedy picks


def test_min_new_tokens_holds_eos_back(pair):
    target, draft = pair
    ids, mask = left_padded_batch()
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=[])
    eos = int(plain[0, 9 + 1])  # row 0 would stop at its second token
    early = target.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=eos, pad_token_id=0)
    held = assert_speculative_equals_greedy(target, draft, ids, mask, max_new_tokens=16, eos_token_id=eos,
                                            pad_token_id=0, min_new_tokens=7)
    assert not torch.equal(held, early)


@pytest.mark.parametrize("eos_step", [None, 3])
def test_output_scores_and_return_dict(pair, eos_step):
    target, draft = pair
    ids, mask = left_padded_batch()
    kwargs = dict(max_new_tokens=14, eos_token_id=[], pad_token_id=0)
    if eos_step is not None:  # row 1 stops early: its scores after its end put everything on the pad id
        kwargs["eos_token_id"] = int(target.generate(ids, attention_mask=mask, **kwargs)[1, 9 + eos_step])
    greedy = target.generate(ids, attention_mask=mask, output_scores=True, return_dict_in_generate=True, **kwargs)
    spec = target.generate(ids, attention_mask=mask, output_scores=True, return_dict_in_generate=True,
                           draft_model=draft, num_draft_tokens=3, **kwargs)
    assert torch.equal(spec.sequences, greedy.sequences)
    assert len(spec.scores) == len(greedy.scores) == greedy.sequences.shape[1] - 9
    new = greedy.sequences[:, 9:]
    live = torch.ones_like(new, dtype=torch.bool)
    if eos_step is not None:
        live = (new == kwargs["eos_token_id"]).long().cumsum(1) - (new == kwargs["eos_token_id"]).long() == 0
    for t, (mine, theirs) in enumerate(zip(spec.scores, greedy.scores)):
        assert torch.allclose(mine[live[:, t]], theirs[live[:, t]], atol=1e-4, rtol=1e-4), t
        assert (mine[~live[:, t]].argmax(-1) == 0).all()
    assert torch.allclose(spec.logprobs[live], greedy.logprobs[live], atol=1e-4)
    assert (spec.logprobs[~live] == 0).all()
    dict_only = target.generate(ids, attention_mask=mask, return_dict_in_generate=True, draft_model=draft, **kwargs)
    assert torch.equal(dict_only.sequences, greedy.sequences) and dict_only.scores is None


def test_prompt_and_new_tokens_filling_the_position_table_exactly():
    target, draft = ours_from_hf(gpt2_hf(seed=32, n_positions=40)), ours_from_hf(gpt2_hf(seed=33, n_positions=40))
    ids, mask = left_padded_batch()  # 9 columns
    assert_speculative_equals_greedy(target, draft, ids, mask, max_new_tokens=40 - 9, eos_token_id=[])


def test_right_padded_prompts(pair):
    target, draft = pair
    ids = torch.randint(2, VOCAB, (3, 8))
    mask = torch.ones_like(ids)
    mask[1, 5:], mask[2, 1:] = 0, 0
    assert_speculative_equals_greedy(target, draft, ids.masked_fill(mask == 0, 0), mask, max_new_tokens=12,
                                     eos_token_id=[])


@pytest.mark.parametrize("kwargs,message", [
    (dict(do_sample=True), "speculative decoding here is greedy"),
    (dict(stop_strings=["ab"]), "stop_strings is not supported with draft_model"),
    (dict(kv_block_size=4), "kv_block_size is not supported with draft_model"),
    (dict(compile_decode=True), "compile_decode is not supported with draft_model"),
    (dict(on_token=print), "on_token is not supported with draft_model"),
])
def test_what_it_cannot_honour_is_refused_by_name(pair, kwargs, message):
    target, draft = pair
    with pytest.raises(ValueError, match=message):
        target.generate(torch.tensor([[4, 5, 6]]), max_new_tokens=4, draft_model=draft, **kwargs)


def test_a_draft_that_is_not_a_decoder_is_refused(pair):
    with pytest.raises(ValueError, match="draft_model must be a flash-models decoder LM, got Linear"):
        pair[0].generate(torch.tensor([[4, 5, 6]]), max_new_tokens=4, draft_model=torch.nn.Linear(2, 2))
