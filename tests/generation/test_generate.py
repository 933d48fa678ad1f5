"""The generation engine on the CPU: parity with HF generate, sampling, stops, streaming, speculative."""

import importlib
import itertools

import pytest
import torch
import transformers

import flash_models as fm
from flash_models.generation import TextStream, filter_logits, stream
from flash_models.generation.sampling import apply_repetition_penalty
from flash_models.testing import ours_from_hf, random_hf_model

VOCAB = 257


def llama_hf(seed=0, **overrides):
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=1)
    return random_hf_model(transformers.LlamaConfig(**{**cfg, **overrides}), seed=seed)


def gpt2_hf(seed=0, n_positions=128):
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=n_positions, n_embd=48, n_layer=2, n_head=4, resid_pdrop=0,
                                  embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=1)
    return random_hf_model(cfg, seed=seed)


def left_padded_batch():
    ids = torch.randint(2, VOCAB, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, :3], mask[2, :7] = 0, 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("make_hf", [llama_hf, gpt2_hf])
def test_greedy_batch_with_eos_mid_batch_equals_hf(make_hf):
    hf = make_hf(seed=3)
    ours = ours_from_hf(hf)
    ids, mask = left_padded_batch()
    plain = hf.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    eos = int(plain[1, 9 + 5])  # row 1 reaches this token at its 6th step: make it the EOS
    ref = hf.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=eos, pad_token_id=0)
    out = ours.generate(ids, attention_mask=mask, max_new_tokens=40, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, ref)


def test_sampling_with_a_seed_is_reproducible_and_seeds_differ():
    ours = ours_from_hf(llama_hf(seed=4))
    ids = torch.randint(2, VOCAB, (2, 5))
    kwargs = dict(max_new_tokens=20, do_sample=True, temperature=1.5, top_k=40, top_p=0.9, eos_token_id=[])
    a = ours.generate(ids, generator=torch.Generator().manual_seed(7), **kwargs)
    b = ours.generate(ids, generator=torch.Generator().manual_seed(7), **kwargs)
    c = ours.generate(ids, generator=torch.Generator().manual_seed(8), **kwargs)
    assert torch.equal(a, b) and not torch.equal(a, c)


def reference_filter(logits, top_k, top_p, min_p):
    """Row by row, the plain definition: keep the top-k; then the most likely tokens until their probability
    reaches top_p (the crossing token kept); then those with prob >= min_p * max prob."""
    out = torch.full_like(logits, float("-inf"))
    for r, row in enumerate(logits):
        order = row.argsort(descending=True).tolist()
        if top_k:
            order = order[:top_k]
        probs = torch.softmax(row[order], 0)
        kept, total = [], 0.0
        for idx, p in zip(order, probs.tolist()):
            kept.append(idx)
            total += p
            if total >= top_p:
                break
        probs = torch.softmax(row[kept], 0)
        kept = [i for i, p in zip(kept, probs.tolist()) if p >= min_p * max(probs.tolist())]
        out[r, kept] = row[kept]
    return out


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 0.8, 0.0), (17, 1.0, 0.0), (50, 0.6, 0.0), (0, 1.0, 0.05), (30, 0.9, 0.1)])
def test_filters_match_a_reference_on_random_logits(top_k, top_p, min_p):
    logits = torch.randn(6, 301) * 3
    ours = filter_logits(logits, top_k=top_k, top_p=top_p, min_p=min_p)
    ref = reference_filter(logits, top_k, top_p, min_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    assert torch.equal(ours[~torch.isinf(ours)], ref[~torch.isinf(ref)])


def test_top_p_and_repetition_penalty_match_hf_processors():
    logits = torch.randn(4, 301) * 2
    ids = torch.randint(0, 301, (4, 12))
    hf_top_p = transformers.generation.logits_process.TopPLogitsWarper(0.7)(ids, logits.clone())
    assert torch.equal(torch.isinf(filter_logits(logits, top_p=0.7)), torch.isinf(hf_top_p))
    hf_rep = transformers.generation.logits_process.RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone())
    seen = torch.zeros(4, 301, dtype=torch.bool).scatter_(1, ids, True)
    assert torch.allclose(apply_repetition_penalty(logits, seen, 1.3), hf_rep)


def test_repetition_penalty_and_min_new_tokens_match_hf_greedy():
    hf = llama_hf(seed=5)
    ours = ours_from_hf(hf)
    ids = torch.randint(2, VOCAB, (1, 6))
    eos = int(hf.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)[0, -1])
    kwargs = dict(max_new_tokens=16, repetition_penalty=1.4, min_new_tokens=5, eos_token_id=eos, pad_token_id=0)
    ref = hf.generate(ids, do_sample=False, **kwargs)
    assert torch.equal(ours.generate(ids, **kwargs), ref)


def test_generation_config_and_scores_match_hf():
    hf = llama_hf(seed=6)
    ours = ours_from_hf(hf)
    ids = torch.randint(2, VOCAB, (2, 7))
    config = transformers.GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = hf.generate(ids, generation_config=config, output_scores=True, return_dict_in_generate=True)
    out = ours.generate(ids, generation_config=config, output_scores=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref.sequences)
    for mine, theirs in zip(out.scores, ref.scores):
        assert torch.allclose(mine, theirs.float(), atol=1e-4)
    assert out.logprobs.shape == (2, 8) and (out.logprobs <= 0).all()


def test_unknown_argument_is_named():
    ours = ours_from_hf(llama_hf())
    with pytest.raises(ValueError, match=r"unknown generation argument\(s\) \['num_beam'\]"):
        ours.generate(torch.tensor([[3, 4]]), num_beam=2)
    with pytest.raises(ValueError, match="num_beams"):
        ours.generate(torch.tensor([[3, 4]]), generation_config=transformers.GenerationConfig(num_beams=4))


def test_prompt_plus_new_tokens_beyond_positions():
    ours = ours_from_hf(gpt2_hf())
    with pytest.raises(ValueError, match="exceeds the model's 128 positions"):
        ours.generate(torch.randint(2, VOCAB, (1, 100)), max_new_tokens=40)


class CharTokenizer:
    """Token t is the UTF-8 byte (t - 2) for t >= 2 (so tokens can split a multi-byte character);
    0 = pad and 1 = EOS are special."""

    eos_token_id = 1

    def decode(self, ids, skip_special_tokens=True):
        data = bytes(t - 2 for t in ids if t >= 2 and t - 2 < 256)
        return data.decode("utf-8", errors="replace")

    def batch_decode(self, rows, skip_special_tokens=False):
        return [self.decode(r) for r in rows]


def test_stream_pieces_join_to_the_decoded_output():
    ours = ours_from_hf(llama_hf(seed=8, vocab_size=258))
    tok = CharTokenizer()
    ids = torch.tensor([[0xC3 + 2, 0xA9 + 2, ord("a") + 2]])
    pieces = list(stream(ours, tok, ids, max_new_tokens=30, eos_token_id=[]))
    full = ours.generate(ids, max_new_tokens=30, eos_token_id=[])
    assert "".join(pieces) == tok.decode(full[0, 3:].tolist())


def test_text_stream_never_splits_a_multibyte_character():
    tok = CharTokenizer()
    text = "caf\u00e9 \u65e5\u672c \U0001F600!"
    stream_ = TextStream(tok)
    pieces = [stream_.push(b + 2) for b in text.encode("utf-8")] + [stream_.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[3] == "" and pieces[4] == "\u00e9"  # the first byte of é waits for the second


def test_stop_strings_end_generation():
    ours = ours_from_hf(llama_hf(seed=9, vocab_size=258))
    tok = CharTokenizer()
    ids = torch.tensor([[ord("x") + 2]])
    free = ours.generate(ids, max_new_tokens=30, eos_token_id=[])
    text = tok.decode(free[0, 1:].tolist())
    stop = text[10:12]
    out = ours.generate(ids, max_new_tokens=30, eos_token_id=[], stop_strings=[stop], tokenizer=tok)
    assert stop in tok.decode(out[0, 1:].tolist()) and out.shape[1] < free.shape[1]
    with pytest.raises(ValueError, match="tokenizer"):
        ours.generate(ids, stop_strings=["ab"])


@pytest.mark.parametrize("batch", [1, 3])
def test_speculative_output_equals_greedy(batch):
    target = ours_from_hf(llama_hf(seed=10))
    draft = ours_from_hf(llama_hf(seed=11, num_hidden_layers=1))
    ids, mask = left_padded_batch()
    ids, mask = ids[:batch], mask[:batch]
    greedy = target.generate(ids, attention_mask=mask, max_new_tokens=33, eos_token_id=[])
    for k in (1, 3, 5):
        spec = target.generate(ids, attention_mask=mask, max_new_tokens=33, eos_token_id=[], draft_model=draft, num_draft_tokens=k)
        assert torch.equal(spec, greedy), k


def test_speculative_with_the_target_as_draft_accepts_everything_and_stops_at_eos():
    target = ours_from_hf(llama_hf(seed=12))
    ids, mask = left_padded_batch()
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=[])
    eos = int(plain[0, 9 + 4])
    greedy = target.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
    spec = target.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=eos, pad_token_id=0, draft_model=target)
    assert torch.equal(spec, greedy)


def test_embedded_smollm2_greedy_equals_hf_over_32_tokens_batched():
    path = fm.smollm2_gguf()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok.padding_side = "left"
    batch = tok(["The weather today is", "My favourite recipe for a quick dinner uses"], return_tensors="pt", padding=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    ours = fm.from_pretrained(path)
    kwargs = dict(attention_mask=batch.attention_mask, max_new_tokens=32, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id or 0)
    ref = hf.generate(batch.input_ids, do_sample=False, **kwargs)
    assert torch.equal(ours.generate(batch.input_ids, **kwargs), ref)


def test_two_interleaved_streams_do_not_share_state():
    ours = ours_from_hf(llama_hf(seed=13, vocab_size=258))
    tok = CharTokenizer()
    a, b = torch.tensor([[ord("a") + 2, ord("b") + 2]]), torch.tensor([[ord("x") + 2, ord("y") + 2]])
    alone_a = "".join(stream(ours, tok, a, max_new_tokens=12, eos_token_id=[]))
    alone_b = "".join(stream(ours, tok, b, max_new_tokens=12, eos_token_id=[]))
    it_a, it_b = stream(ours, tok, a, max_new_tokens=12, eos_token_id=[]), stream(ours, tok, b, max_new_tokens=12, eos_token_id=[])
    pieces = list(itertools.zip_longest(it_a, it_b, fillvalue=""))  # both live at once, stepped in turn
    assert "".join(p for p, _ in pieces) == alone_a and "".join(p for _, p in pieces) == alone_b


def test_finished_rows_leave_the_sampling_work(monkeypatch):
    gen = importlib.import_module("flash_models.generation.generate")  # the module, not the function it exports

    ours = ours_from_hf(llama_hf(seed=14))
    ids = torch.randint(2, VOCAB, (3, 5))
    sampled_rows = []
    original = gen.process_logits

    def spy(logits, settings, **kwargs):
        sampled_rows.append(logits.shape[0])
        return original(logits, settings, **kwargs)

    monkeypatch.setattr(gen, "process_logits", spy)
    # Row 0 finishes at once: its first token is made the only allowed EOS by a top-k of 1 on its logits.
    first = ours.generate(ids, max_new_tokens=1, do_sample=True, top_k=1, eos_token_id=[])[:, -1]
    eos = int(first[0])
    sampled_rows.clear()
    out = ours.generate(ids, max_new_tokens=10, do_sample=True, top_k=1, eos_token_id=eos, pad_token_id=0,
                        generator=torch.Generator().manual_seed(0))
    assert out[0, 5] == eos and (out[0, 6:] == 0).all()
    assert not bool((out[1:, 5:] == eos).any()), "setup: only row 0 may finish"
    assert sampled_rows[0] == 3 and sampled_rows[-1] == 2  # row 0 stopped costing sampling work


@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_paged_kv_cache_generates_what_the_static_cache_does(block_size):
    ours = ours_from_hf(llama_hf(seed=15))
    ids, mask = left_padded_batch()
    static = ours.generate(ids, attention_mask=mask, max_new_tokens=21, eos_token_id=[])
    paged = ours.generate(ids, attention_mask=mask, max_new_tokens=21, eos_token_id=[], kv_block_size=block_size)
    assert torch.equal(paged, static)


def test_paged_kv_cache_hands_out_blocks_as_it_grows_and_says_when_the_pool_is_dry():
    ours = ours_from_hf(llama_hf(seed=16))
    cache = ours.new_kv_cache(2, 40, block_size=8, num_blocks=6)  # room for 3 blocks per row, not 5
    with torch.no_grad():
        ours(torch.randint(2, VOCAB, (2, 9)), kv_cache=cache)
        assert len(cache.free_blocks) == 6 - 2 * 2  # 9 tokens -> 2 blocks per row
        assert len(set(cache.block_table[:, :2].flatten().tolist())) == 4  # no block shared between rows
        ours(torch.randint(2, VOCAB, (2, 15)), kv_cache=cache)  # 24 tokens -> 3 blocks per row
        with pytest.raises(ValueError, match="paged KV cache pool exhausted"):
            ours(torch.randint(2, VOCAB, (2, 1)), kv_cache=cache)


@pytest.mark.parametrize("make_hf", [llama_hf, gpt2_hf])
def test_compiled_decode_step_traces_as_one_graph_and_generates_the_same(make_hf):
    """torch.compile(fullgraph=True) of the decode step (the 'eager' backend: dynamo's tracing without code
    generation, fast enough for CI) raises on any graph break."""
    import torch._dynamo

    ours = ours_from_hf(make_hf(seed=17))
    ids, mask = left_padded_batch()
    plain = ours.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[])
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = ours.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[], compile_decode="eager")
    assert torch.equal(compiled, plain)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # no recompilation from step to step


def test_a_model_that_generated_trains_next():
    """Generation (under torch.inference_mode) past the rotary tables' length grows them; the training forward
    after it (TRL's on-policy loop: generate, then train) reads the same tables, and on CUDA our rotary saves
    them for the backward, which refuses inference tensors: the tables are never made as such."""
    ours = ours_from_hf(llama_hf(seed=5, max_position_embeddings=16))
    ids = torch.randint(2, VOCAB, (2, 9))
    ours.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=[])
    cos, sin = ours.rotary.tables(29, ids.device)
    assert cos.shape[0] >= 29 and not cos.is_inference() and not sin.is_inference()
    ours.train()
    ours(ids, labels=ids).loss.backward()
    assert ours.blocks[0].attn.qkv.weight.grad is not None
