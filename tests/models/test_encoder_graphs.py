"""Graphed packed-encoder inference (BERT): the bucket padding leaves the real tokens' outputs unchanged, and
the static buffers are refilled correctly from one batch to the next. Off CUDA the GraphedEncoder runs its
static buffers eagerly, which is what these CPU tests check; the GPU test compares captured graphs with eager."""

import random

import pytest
import torch
import transformers

from flash_models.modules.attention import build_attention_mask
from flash_models.modules.encoder_graphs import GraphedEncoder, bucket_for, padded_offsets
from flash_models.testing import ours_from_hf, random_hf_model

CONFIG = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
              max_position_embeddings=64, type_vocab_size=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@pytest.mark.parametrize("seed", range(20))
def test_buckets_hold_the_batch_and_pad_with_one_sequence(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(0, 64) for _ in range(rng.randint(1, 9))]
    b = bucket_for(lengths, seq_limit=64)
    assert max(lengths) <= b.max_seqlen <= 64 and b.max_seqlen >= 16
    assert b.tokens % b.max_seqlen == 0 and 0 <= b.tokens - sum(lengths) < b.max_seqlen or b.tokens == b.max_seqlen
    assert b.sequences > len(lengths) and b.sequences & (b.sequences - 1) == 0
    offsets = padded_offsets(lengths, b)
    assert len(offsets) == b.sequences + 1 and offsets[0] == 0 and offsets[-1] == b.tokens
    sizes = [y - x for x, y in zip(offsets, offsets[1:])]
    assert sizes[:len(lengths)] == lengths and all(0 <= n <= b.max_seqlen for n in sizes)


def test_bucket_refuses_too_long_sequences():
    with pytest.raises(ValueError, match="exceeds the model's 64 positions"):
        bucket_for([65], seq_limit=64)


def model_and_batch_maker():
    model = ours_from_hf(random_hf_model(transformers.BertConfig(**CONFIG), seed=0, auto_class="AutoModel"), attn_impl="sdpa").eval()
    gen = torch.Generator().manual_seed(0)

    def batch(lengths):
        total = sum(lengths)
        ids = torch.randint(1, CONFIG["vocab_size"], (total,), generator=gen)
        positions = torch.cat([torch.arange(n) for n in lengths])
        types = torch.randint(0, 2, (total,), generator=gen)
        return ids, positions, types

    return model, batch


def eager_packed(model, ids, positions, types, lengths):
    offsets = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))], dtype=torch.int32)
    mask = build_attention_mask(None, q_len=ids.numel(), past_len=0, causal=False, sliding_window=None, cu_seqlens=offsets)
    return model._encode(ids[None], positions[None], types[None], mask)


@torch.no_grad()
def test_padded_bucket_runs_give_the_unpadded_outputs():
    model, batch = model_and_batch_maker()
    graphed = GraphedEncoder(model._encode, model, seq_limit=64, max_graphs=2)
    batches = [[5, 17, 0, 9], [12, 3, 30, 1], [40, 2], [7]]  # the first two share a bucket
    for lengths in batches:
        inputs = batch(lengths)
        got = graphed(*inputs, lengths)
        assert got.shape == (1, sum(lengths), CONFIG["hidden_size"]) and not got.is_inference()
        torch.testing.assert_close(got, eager_packed(model, *inputs, lengths), rtol=1e-5, atol=1e-5)
    assert len(graphed.graphs) == 2  # four batches, three buckets, at most two kept
    assert list(graphed.graphs)[-1] == bucket_for([7], seq_limit=64)


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_bert_with_graphs_equals_eager():
    hf = random_hf_model(transformers.BertConfig(**{**CONFIG, "hidden_size": 128, "num_attention_heads": 2,
                                                    "intermediate_size": 256}), seed=0, auto_class="AutoModel")
    model = ours_from_hf(hf, attn_impl="flash").to("cuda", torch.bfloat16).eval()
    eager = {}
    gen = torch.Generator().manual_seed(1)
    batches = [[64, 20, 33], [60, 2, 40], [9, 9, 9, 9, 9]]
    inputs = []
    for lengths in batches:
        S = max(lengths)
        ids = torch.randint(1, CONFIG["vocab_size"], (len(lengths), S), generator=gen)
        mask = (torch.arange(S)[None] < torch.tensor(lengths)[:, None]).long()
        inputs.append((ids.cuda(), mask.cuda()))
    for i, (ids, mask) in enumerate(inputs):
        eager[i] = model(ids, attention_mask=mask).last_hidden_state
    model.use_cuda_graphs()
    for _ in range(2):  # the second round replays the graphs captured in the first
        for i, (ids, mask) in enumerate(inputs):
            out = model(ids, attention_mask=mask).last_hidden_state
            real = mask.bool()
            torch.testing.assert_close(out[real].float(), eager[i][real].float(), rtol=2e-2, atol=2e-2)
            assert (out[~real] == 0).all()
    assert len(model.graphed.graphs) == 2


def test_heads_pass_the_switch_to_their_encoder():
    config = transformers.BertConfig(**CONFIG, architectures=["BertForSequenceClassification"])
    model = ours_from_hf(random_hf_model(config, seed=0, auto_class="AutoModelForSequenceClassification"))
    assert model.use_cuda_graphs() is model and model.bert.graphed is not None
    assert model.use_cuda_graphs(False).bert.graphed is None
