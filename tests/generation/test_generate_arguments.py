"""generate's arguments: each checked up front with an error naming it; right-padded prompts."""

import numpy as np
import pytest
import torch
import transformers

from flash_models.testing import ours_from_hf
from tests.generation.test_generate import VOCAB, gpt2_hf, llama_hf

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models stepped one token at a time


@pytest.fixture(scope="module")
def model():
    return ours_from_hf(llama_hf(seed=20))


PROMPT = torch.tensor([[5, 9, 14, 3]])

BAD_ARGUMENTS = [
    (dict(max_new_tokens=2.5), r"max_new_tokens must be an int, got 2\.5"),
    (dict(max_new_tokens=True), "max_new_tokens must be an int"),
    (dict(max_new_tokens=-1), "max_new_tokens must be >= 0"),
    (dict(max_new_tokens=4, min_new_tokens=5), r"min_new_tokens must be in \[0, max_new_tokens=4\]"),
    (dict(min_new_tokens=1.0), "min_new_tokens must be an int"),
    (dict(do_sample=True, temperature=0.0), "temperature must be > 0 with do_sample=True"),
    (dict(temperature=-0.5), "temperature must be > 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature="hot"), "temperature must be a finite number"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(top_k=4.0), "top_k must be an int"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(min_p=1.0), r"min_p must be in \[0, 1\)"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(eos_token_id=VOCAB), r"eos_token_id \[257\] outside the vocabulary \[0, 257\)"),
    (dict(eos_token_id=[1, 2.0]), "eos_token_id must be an int"),
    (dict(pad_token_id=-1), "pad_token_id -1 outside the vocabulary"),
    (dict(do_sample="yes"), "do_sample must be True or False"),
    (dict(output_scores=1), "output_scores must be True or False"),
    (dict(stop_strings=[""]), "stop_strings must be a non-empty string or a list of them"),
    (dict(stop_strings=5), "stop_strings must be a non-empty string"),
    (dict(num_draft_tokens=0), "num_draft_tokens must be >= 1"),
    (dict(kv_block_size=0), "kv_block_size must be >= 1"),
    (dict(generator=7), "generator must be a torch.Generator"),
    (dict(on_token="print"), "on_token must be callable"),
]


@pytest.mark.parametrize("kwargs,message", BAD_ARGUMENTS, ids=[repr(kwargs) for kwargs, _ in BAD_ARGUMENTS])
def test_a_bad_argument_is_named(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        model.generate(PROMPT, **kwargs)


@pytest.mark.parametrize("input_ids,message", [
    (torch.tensor([[5.0, 9.0]]), "input_ids must hold integer token ids .* got dtype torch.float32"),
    (torch.tensor([[True, False]]), "input_ids must hold integer token ids"),
    ([[5, 9]], "input_ids must be a tensor of token ids, got list"),
    (transformers.BatchEncoding({"input_ids": torch.tensor([[5, 9]])}), r"tokenizer's output \(BatchEncoding\): unpack it"),
    (torch.tensor([[5, VOCAB]]), r"input_ids must lie in the vocabulary \[0, 257\), got 257"),
    (torch.tensor([[5, -3]]), "input_ids must lie in the vocabulary"),
    (torch.zeros(1, 0, dtype=torch.long), "input_ids must be a non-empty"),
])
def test_a_bad_prompt_is_named(model, input_ids, message):
    with pytest.raises(ValueError, match=message):
        model.generate(input_ids, max_new_tokens=3)


@pytest.mark.parametrize("mask,message", [
    (torch.ones(1, 3, dtype=torch.long), r"attention_mask shape \(1, 3\) != input_ids \(1, 4\)"),
    (torch.tensor([[0, 1, 2, 1]]), "attention_mask must hold only 0 .* and 1"),
    (torch.tensor([[0, 0, 0, 0]]), "a row of attention_mask has no real token"),
    ([[1, 1, 1, 1]], "attention_mask must be a tensor"),
])
def test_a_bad_attention_mask_is_named(model, mask, message):
    with pytest.raises(ValueError, match=message):
        model.generate(PROMPT, attention_mask=mask, max_new_tokens=3)


def test_integer_like_values_bool_and_float_masks_and_greedy_temperature_zero_are_accepted(model):
    want = model.generate(PROMPT, max_new_tokens=5, eos_token_id=[])
    mask = torch.tensor([[0, 1, 1, 1]])
    masked = model.generate(PROMPT, attention_mask=mask, max_new_tokens=5, eos_token_id=[])
    assert torch.equal(model.generate(PROMPT.int(), max_new_tokens=np.int64(5), eos_token_id=[], temperature=0), want)
    for as_type in (torch.bool, torch.float32, torch.int32):
        got = model.generate(PROMPT, attention_mask=mask.to(as_type), max_new_tokens=5, eos_token_id=[])
        assert torch.equal(got, masked), as_type


@pytest.mark.parametrize("make_hf", [llama_hf, gpt2_hf])
def test_a_right_padded_batch_gives_each_row_what_it_gives_alone(make_hf):
    """Each row continues from its own last real token; its new tokens follow the prompt's columns."""
    model = ours_from_hf(make_hf(seed=21))
    ids = torch.randint(2, VOCAB, (4, 11))
    mask = torch.ones_like(ids)
    mask[1, 6:], mask[2, 1:] = 0, 0  # right-padded rows, one of a single token
    mask[3, :4], mask[3, 9:] = 0, 0  # padding on both sides
    ids = ids.masked_fill(mask == 0, 0)
    kwargs = dict(max_new_tokens=9, eos_token_id=[], repetition_penalty=1.3)
    out = model.generate(ids, attention_mask=mask, **kwargs)
    for row in range(4):
        alone = model.generate(ids[row:row + 1, mask[row].bool()], **kwargs)
        assert torch.equal(out[row, 11:], alone[0, -9:]), row
    assert torch.equal(out[:, :11], ids)


def test_the_position_limit_counts_real_tokens():
    """Positions count each row's real tokens, so a padded batch may reach the table's end in every row."""
    model = ours_from_hf(gpt2_hf(seed=22, n_positions=24))
    ids = torch.randint(2, VOCAB, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    ids[0, :4], mask[0, :4] = 0, 0  # both rows hold 6 real tokens: 6 + 18 fill the 24 positions
    out = model.generate(ids, attention_mask=mask, max_new_tokens=18, eos_token_id=[])
    for row in range(2):
        alone = model.generate(ids[row:row + 1, mask[row].bool()], max_new_tokens=18, eos_token_id=[])
        assert torch.equal(out[row, 10:], alone[0, 6:])
    with pytest.raises(ValueError, match=r"prompt \(6 tokens\) \+ max_new_tokens \(19\) exceeds the model's 24 positions"):
        model.generate(ids, attention_mask=mask, max_new_tokens=19)


def test_a_prompt_mask_of_ones_prefills_without_a_mask(model, monkeypatch):
    """A tokenizer's mask for an unpadded prompt is all ones: the prefill drops it (the maskless attention) and
    generates what no mask gives. (The CPU's lean step is set aside: the forward, as on a GPU, prefills.)"""
    monkeypatch.setattr(type(model), "lean_decode_step", lambda self, cache: None)
    want = model.generate(PROMPT, max_new_tokens=4, eos_token_id=[])
    masks = []
    forward = type(model).forward
    monkeypatch.setattr(type(model), "forward",
                        lambda self, *args, **kwargs: masks.append(kwargs.get("attention_mask")) or forward(self, *args, **kwargs))
    got = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=4, eos_token_id=[])
    assert torch.equal(got, want)
    assert masks and all(mask is None for mask in masks)
