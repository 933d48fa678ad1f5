"""BERT on packed input (``cu_seqlens``, FlashAttention's varlen convention): outputs and gradients equal the
padded batch's on the real tokens, bucket padding sequences change nothing, and ``max_seqlen`` makes the call
read nothing back from the device (what a CUDA graph needs)."""

import pytest
import torch

from flash_models.testing import ours_from_hf
from flash_models.train.classification import collate_packed_classification
from tests.models.test_bert import hf_bert, padded_batch


def packed_from_padded(ids, mask, types, *, extra_tokens=0, empty_sequences=0):
    """The padded batch's real tokens back to back, then ``extra_tokens`` of one padding sequence (id 0) and
    ``empty_sequences`` empty ones, as a CUDA-graph bucket lays them out. Positions are the padded batch's (a
    left-padded row's first real token sits at its padded index, as HF's BERT counts)."""
    real = mask.bool()
    lengths = real.sum(1).tolist() + ([extra_tokens] if extra_tokens else []) + [0] * empty_sequences
    pad = torch.zeros(extra_tokens, dtype=torch.long)
    positions = torch.arange(ids.shape[1]).expand_as(ids)[real]
    offsets = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return dict(input_ids=torch.cat([ids[real], pad])[None], token_type_ids=torch.cat([types[real], pad])[None],
                position_ids=torch.cat([positions, torch.arange(extra_tokens)])[None], cu_seqlens=offsets)


@pytest.mark.parametrize("max_seqlen", [None, 19])
def test_packed_outputs_equal_padded_on_real_tokens(max_seqlen):
    ours = ours_from_hf(hf_bert(seed=3))
    ids, mask, types = padded_batch(3)
    with torch.no_grad():
        padded = ours(ids, attention_mask=mask, token_type_ids=types)
        packed = ours(**packed_from_padded(ids, mask, types, extra_tokens=7, empty_sequences=2), max_seqlen=max_seqlen)
    total = int(mask.sum())
    assert packed.last_hidden_state.shape == (1, total + 7, 64)
    torch.testing.assert_close(packed.last_hidden_state[0, :total], padded.last_hidden_state[mask.bool()])
    assert packed.pooler_output.shape == (3 + 1 + 2, 64)
    # Row 2 is left-padded: HF's pooler reads its position 0 (a padding token); the packed sequence starts at
    # its first real token. The right-padded and unpadded rows agree.
    torch.testing.assert_close(packed.pooler_output[:2], padded.pooler_output[:2])


def test_packed_classification_loss_and_gradients_equal_padded():
    hf = hf_bert("BertForSequenceClassification", seed=6, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ours = ours_from_hf(hf)
    ids, mask, types = padded_batch(6)
    mask[2] = 1  # no left padding: HF-style pooling reads position 0, which packing keeps as the first token
    labels = torch.tensor([2, 0, 1])
    grads = []
    for inputs in (dict(input_ids=ids, attention_mask=mask, token_type_ids=types),
                   dict(**packed_from_padded(ids, mask, types, extra_tokens=5, empty_sequences=1), max_seqlen=19)):
        ours.zero_grad()
        out = ours(**inputs, labels=labels)
        out.loss.backward()
        grads.append((out.loss.detach(), out.logits[:3].detach(),
                      {n: p.grad.clone() for n, p in ours.named_parameters() if p.grad is not None}))
    (loss_a, logits_a, grads_a), (loss_b, logits_b, grads_b) = grads
    torch.testing.assert_close(loss_b, loss_a)
    torch.testing.assert_close(logits_b, logits_a)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6, msg=name)


def test_collated_buckets_train_like_the_padded_batch():
    """collate_packed_classification's layout (positions restart per row, padding sequences after the rows)
    gives the padded batch's loss."""
    ours = ours_from_hf(hf_bert("BertForSequenceClassification", seed=8, hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0))
    gen = torch.Generator().manual_seed(8)
    rows = [torch.randint(1, 151, (n,), generator=gen).tolist() for n in (19, 4, 11)]
    items = [{"input_ids": r, "token_type_ids": [0] * len(r), "labels": i, "pad_id": 0} for i, r in enumerate(rows)]
    batch = collate_packed_classification(items, seq_len=19)
    labels = batch.pop("labels")
    packed = ours(**batch, max_seqlen=19, labels=labels)
    ids = torch.zeros(3, 19, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    padded = ours(ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(packed.loss, padded.loss)


def test_packed_input_errors_name_the_fix():
    ours = ours_from_hf(hf_bert(seed=1))
    ids, mask, types = padded_batch(1)
    packed = packed_from_padded(ids, mask, types)
    with pytest.raises(ValueError, match="not both"):
        ours(packed["input_ids"], attention_mask=torch.ones_like(packed["input_ids"]), cu_seqlens=packed["cu_seqlens"])
    with pytest.raises(ValueError, match=r"one packed row \(1, total\)"):
        ours(ids, cu_seqlens=packed["cu_seqlens"])
    with pytest.raises(ValueError, match="exceeds BERT's 40 positions"):
        ours(packed["input_ids"], cu_seqlens=packed["cu_seqlens"], max_seqlen=41)
    with pytest.raises(ValueError, match="int32"):
        ours(packed["input_ids"], cu_seqlens=packed["cu_seqlens"].long(), max_seqlen=19)
    with pytest.raises(ValueError, match="cu_seqlens must be"):  # checked on the host without max_seqlen
        ours(packed["input_ids"], cu_seqlens=packed["cu_seqlens"][:-1])


def test_positions_restart_per_sequence_when_not_given():
    ours = ours_from_hf(hf_bert(seed=2))
    ids, mask, types = padded_batch(2)
    mask[2] = 1
    packed = packed_from_padded(ids, mask, types, extra_tokens=3)  # positions: each row's 0.., then 0, 1, 2
    with torch.no_grad():
        given = ours(**packed, max_seqlen=19).last_hidden_state
        packed.pop("position_ids")
        derived = ours(**packed, max_seqlen=19).last_hidden_state
    torch.testing.assert_close(derived, given)


def test_flash_kernels_on_a_packed_bucket_match_the_padded_batch():
    """attn_impl='flash' (Triton's interpreter on a CPU): the varlen kernel with max_seqlen from the caller and
    bucket padding sequences gives the padded batch's real-token outputs."""
    ours = ours_from_hf(hf_bert(seed=5, num_attention_heads=2), attn_impl="flash", dtype=torch.bfloat16)
    ids, mask, types = padded_batch(5)
    with torch.no_grad():
        padded = ours(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        packed = ours(**packed_from_padded(ids, mask, types, extra_tokens=6, empty_sequences=1), max_seqlen=19)
    total = int(mask.sum())
    torch.testing.assert_close(packed.last_hidden_state[0, :total].float(), padded[mask.bool()].float(),
                               rtol=2e-2, atol=2e-2)
