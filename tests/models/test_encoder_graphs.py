"""Graphed encoder inference (BERT) on padded batches: the packing done on the device finds the real tokens and
their sequences, the bucket padding leaves the real tokens' outputs unchanged, and the static buffers are
refilled correctly from one batch to the next. Off CUDA the GraphedEncoder runs its static buffers eagerly,
which is what these CPU tests check; the GPU test compares captured graphs with eager."""

import random

import pytest
import torch
import transformers

from flash_models.modules.attention import build_attention_mask
from flash_models.runtime.encoder_graphs import GraphedEncoder, GraphKey, bucket_for, graph_key, packed_layout
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
    assert b.sequences == len(lengths) + 1  # one per row, then the padding sequence


@pytest.mark.parametrize("seed", range(20))
def test_packed_layout_finds_the_real_tokens_on_the_device(seed):
    """Any pattern of real tokens (right, left or scattered padding, empty rows): the index lists each row's
    real positions in order, then the dummy slot; the offsets bound each row's run, then the padding sequence
    (shorter than max_seqlen) and empty ones."""
    rng = random.Random(seed)
    rows, columns = rng.randint(1, 9), rng.randint(1, 40)
    real = torch.rand(rows, columns, generator=torch.Generator().manual_seed(seed)) < rng.random()
    lengths = real.sum(1).tolist()
    b = bucket_for(lengths, seq_limit=64)
    index, offsets, slot = packed_layout(real, b)
    flat = real.flatten().nonzero().squeeze(1).tolist()
    assert index.tolist() == flat + [real.numel()] * (b.tokens - len(flat))
    assert slot.shape == real.shape and slot[~real].eq(b.tokens).all()
    assert slot[real].tolist() == list(range(len(flat)))  # slot inverts index
    sizes = offsets.diff().tolist()
    assert offsets.dtype == torch.int32 and offsets.numel() == b.sequences + 1 and offsets[-1] == b.tokens
    assert sizes[:rows] == lengths and 0 <= sizes[rows] <= b.max_seqlen and sizes[rows + 1:] == [0] * (b.sequences - rows - 1)


def test_graph_keys_round_the_batch_up():
    key = graph_key([5, 0, 9], 20, seq_limit=64)
    assert key == GraphKey(rows=4, columns=32, bucket=bucket_for([5, 0, 9, 0], seq_limit=64))
    assert graph_key([9, 5, 0], 17, seq_limit=64) == key  # another batch of the same bucket
    assert graph_key([3], 5, seq_limit=64).columns == 16 and graph_key([3], 60, seq_limit=60).columns == 60
    with pytest.raises(ValueError, match="exceeds the model's 64 positions"):
        graph_key([3], 65, seq_limit=64)
    assert graph_key([5, 0, 9], 20, seq_limit=64, positions_given=True) != key  # another graph: static positions


def test_bucket_refuses_too_long_sequences():
    with pytest.raises(ValueError, match="exceeds the model's 64 positions"):
        bucket_for([65], seq_limit=64)


def model_and_batch_maker():
    model = ours_from_hf(random_hf_model(transformers.BertConfig(**CONFIG), seed=0, auto_class="AutoModel"), attn_impl="sdpa").eval()
    gen = torch.Generator().manual_seed(0)

    def batch(lengths, columns, left=False):
        """Padded (B, columns) ids, positions, token types and mask with ``lengths`` real tokens per row."""
        B = len(lengths)
        ids = torch.randint(1, CONFIG["vocab_size"], (B, columns), generator=gen)
        arange = torch.arange(columns)[None]
        mask = (arange >= columns - torch.tensor(lengths)[:, None]) if left else (arange < torch.tensor(lengths)[:, None])
        positions = arange.expand(B, columns)
        types = torch.randint(0, 2, (B, columns), generator=gen)
        return ids, positions, types, mask.long()

    return model, batch


def eager_packed(model, ids, positions, types, mask):
    """The real tokens of each row encoded as one packed batch, eagerly: (total, hidden) in row order."""
    real = mask.bool()
    lengths = real.sum(1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
    packed = build_attention_mask(None, q_len=int(lengths.sum()), past_len=0, causal=False, sliding_window=None,
                                  cu_seqlens=offsets)
    return model._encode(ids[real][None], positions[real][None], types[real][None], packed)[0]


@torch.no_grad()
def test_padded_bucket_runs_give_the_unpadded_outputs():
    model, batch = model_and_batch_maker()
    graphed = GraphedEncoder(model._encode, model, seq_limit=64, max_graphs=2)
    # (lengths, columns, left-padded, graphs kept after it): the first two share a graph (4 rows x 32 columns,
    # 32 packed tokens, sequences up to 32); four batches, three graphs, at most two kept.
    batches = [([5, 17, 0, 9], 20, False, 1), ([20, 3, 8], 30, True, 1), ([40, 2], 41, False, 2), ([7], 9, True, 2)]
    for lengths, columns, left, kept in batches:
        inputs = batch(lengths, columns, left)
        got = graphed(*inputs)
        real = inputs[3].bool()
        assert got.shape == (len(lengths), columns, CONFIG["hidden_size"]) and not got.is_inference()
        torch.testing.assert_close(got[real], eager_packed(model, *inputs), rtol=1e-5, atol=1e-5)
        assert (got[~real] == 0).all()
        assert len(graphed.graphs) == kept
    assert list(graphed.graphs)[-1] == graph_key([7], 9, seq_limit=64, positions_given=True, token_types_given=True)


@torch.no_grad()
def test_a_batch_without_padding_gets_a_graph_without_the_zero_row():
    """A batch whose every row is full gathers its output from the encoder's own rows: its graph appends no zero
    row (a copy of the whole output). A padded batch of the same bucket gets its own graph, with the row."""
    model, batch = model_and_batch_maker()
    graphed = GraphedEncoder(model._encode, model, seq_limit=64)
    full = batch([20, 20, 20], 20)
    padded = batch([20, 19, 20, 1], 20)  # the same bucket: 4 rows x 32 columns, 64 packed tokens
    full_key, padded_key = (graph_key(lengths, 20, seq_limit=64, positions_given=True, token_types_given=True)
                            for lengths in ([20, 20, 20], [20, 19, 20, 1]))
    assert full_key.bucket == padded_key.bucket and not full_key.has_padding and padded_key.has_padding
    for inputs, key in ((full, full_key), (padded, padded_key), (full, full_key)):
        got = graphed(*inputs)
        real = inputs[3].bool()
        torch.testing.assert_close(got[real], eager_packed(model, *inputs), rtol=1e-5, atol=1e-5)
        assert (got[~real] == 0).all()
        assert graphed.graphs[key].packed.shape[0] == key.bucket.tokens + key.has_padding
    assert list(graphed.graphs) == [padded_key, full_key]


@torch.no_grad()
def test_a_shape_whose_last_batch_was_unpadded_replays_before_reading_the_lengths():
    """After a batch without padding, the next batch of its (B, S) runs in the same graph first, its count read
    after the replay. A padded batch there is found out by that count and runs again, read first, in its own
    graph (right outputs, zeros at the padding); its (B, S) then reads first until an unpadded batch comes."""
    model, batch = model_and_batch_maker()
    graphed = GraphedEncoder(model._encode, model, seq_limit=64, max_graphs=2)
    shape = (3, 20, True, True)
    full_key = graph_key([20, 20, 20], 20, seq_limit=64, positions_given=True, token_types_given=True)
    reads = []
    count_nonzero = torch.count_nonzero
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "count_nonzero", lambda t, dim=None: reads.append(dim) or count_nonzero(t, dim=dim))
        # (lengths, left-padded, what the call reads: the total after a replay (None), the rows before one (1))
        for lengths, left, expected in (([20, 20, 20], False, [1]), ([20, 20, 20], False, [None]),
                                        ([1, 20, 2], True, [None, 1]), ([1, 20, 2], False, [1]),
                                        ([20, 20, 20], False, [1]), ([20, 20, 20], False, [None])):
            reads.clear()
            inputs = batch(lengths, 20, left)
            got = graphed(*inputs)
            real = inputs[3].bool()
            torch.testing.assert_close(got[real], eager_packed(model, *inputs), rtol=1e-5, atol=1e-5)
            assert (got[~real] == 0).all() and reads == expected
            assert graphed.unpadded.get(shape) == (None if 1 in lengths else full_key)
    assert len(graphed.graphs) == 2
    for lengths, columns in (([5, 7], 9), ([3], 5)):  # two more graphs evict the padded batch's, then the full one's
        graphed(*batch(lengths, columns))
    assert full_key not in graphed.graphs and shape not in graphed.unpadded


@torch.no_grad()
def test_default_positions_and_types_are_made_in_the_graph():
    """Without positions and token types the graph makes them: each token's column and zeros, as BERT's
    forward defaults them (left padding keeps the column as the position, as HF does)."""
    model, batch = model_and_batch_maker()
    graphed = GraphedEncoder(model._encode, model, seq_limit=64)
    for left in (False, True):
        ids, positions, types, mask = batch([5, 17, 0, 9], 20, left)
        got = graphed(ids, None, None, mask)
        real = mask.bool()
        torch.testing.assert_close(got[real], eager_packed(model, ids, positions, torch.zeros_like(types), mask),
                                   rtol=1e-5, atol=1e-5)
    assert list(graphed.graphs)[-1] == graph_key([5, 17, 0, 9], 20, seq_limit=64)


@torch.no_grad()
def test_the_graph_checks_each_batch_it_runs():
    """The ids are checked inside the graph, on its static buffers: a later batch of the same bucket with a bad
    id is refused (off CUDA a ValueError; in a CUDA graph a device assert)."""
    model, batch = model_and_batch_maker()
    seen = []
    graphed = GraphedEncoder(model._encode, model, seq_limit=64, check=lambda ids, positions, types: (
        seen.append(ids), model.embed.check_ids(ids, types, positions)))
    ids, positions, types, mask = batch([5, 17], 20)
    graphed(ids, positions, types, mask)
    assert seen[-1] is graphed.graphs[graph_key([5, 17], 20, seq_limit=64, positions_given=True,
                                                token_types_given=True)].ids
    ids[1, 3] = CONFIG["vocab_size"]
    with pytest.raises(ValueError, match="input_ids must lie in"):
        graphed(ids, positions, types, mask)
    types[0, 0] = 2
    with pytest.raises(ValueError, match="token_type_ids must lie in"):
        graphed(ids.clamp(max=5), positions, types, mask)
    positions = positions.clone()
    positions[1, 0] = CONFIG["max_position_embeddings"]
    with pytest.raises(ValueError, match="position_ids must lie in"):
        graphed(ids.clamp(max=5), positions, types.clamp(max=1), mask)


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_bert_with_graphs_equals_eager():
    hf = random_hf_model(transformers.BertConfig(**{**CONFIG, "hidden_size": 128, "num_attention_heads": 2,
                                                    "intermediate_size": 256, "max_position_embeddings": 128}),
                         seed=0, auto_class="AutoModel")
    model = ours_from_hf(hf, attn_impl="flash").to("cuda", torch.bfloat16).eval()
    eager = {}
    gen = torch.Generator().manual_seed(1)
    # The last two share a shape: the padded one first replays in the full one's graph, is found out by its
    # count and runs again in its own (on the Hopper forward where there is one).
    batches = [[64, 20, 33], [60, 2, 40], [9, 9, 9, 9, 9], [128] * 4, [128, 1, 1, 1]]
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
    assert len(model.graphed.graphs) == 4


def test_heads_pass_the_switch_to_their_encoder():
    config = transformers.BertConfig(**CONFIG, architectures=["BertForSequenceClassification"])
    model = ours_from_hf(random_hf_model(config, seed=0, auto_class="AutoModelForSequenceClassification"))
    assert model.use_cuda_graphs() is model and model.bert.graphed is not None
    assert model.use_cuda_graphs(False).bert.graphed is None
