"""What HF's tools read on our models: ModelOutput behaviour of outputs, model.config as a config they can set,
HF's packed-row conventions in the causal LM forward."""

import copy
import pickle

import pytest
import torch
import torch.utils._pytree as pytree
import transformers

import flash_models as fm
from flash_models.models.outputs import CausalLMOutput, HeadOutput
from flash_models.testing import ours_from_hf, random_hf_model
from test_hf_trainer import VOCAB, tiny_llama_config


def test_outputs_index_like_hf_model_outputs():
    loss, logits = torch.rand(()), torch.randn(2, 3, 5)
    out = CausalLMOutput(logits=logits, loss=loss)
    assert list(out.keys()) == ["loss", "logits"]  # HF's order; None fields are not keys
    assert out[0] is loss and out["logits"] is logits and out.logits is logits and out[1:] == (logits,)
    assert out.to_tuple() == (loss, logits) and isinstance(out, dict) and "kv_cache" not in out
    with pytest.raises(KeyError):
        out["last_hidden_state"]
    out.last_hidden_state = torch.zeros(1)
    assert list(out) == ["loss", "logits", "last_hidden_state"]
    out["loss"] = None
    assert out.loss is None and list(out) == ["logits", "last_hidden_state"]
    with pytest.raises(KeyError, match="no field"):
        out["logits_"] = logits
    with pytest.raises(TypeError):
        out.update(loss=loss)
    # accelerate's convert_outputs_to_fp32 rebuilds an output as type(out)(dict); pickling and copies keep it.
    rebuilt = HeadOutput({"logits": logits, "loss": loss})
    assert list(rebuilt) == ["loss", "logits"] and rebuilt.logits is logits
    for again in (pickle.loads(pickle.dumps(rebuilt)), copy.deepcopy(rebuilt)):
        assert list(again) == ["loss", "logits"] and torch.equal(again.logits, logits)


def test_outputs_are_pytrees_and_rebuild_from_pairs():
    """DistributedDataParallel hooks the tensors it finds by flattening the output as a pytree (a leaf output left
    static_graph=True runs with unreduced gradients); DataParallel gathers an output as type(out)(pairs)."""
    loss, logits = torch.rand(()), torch.randn(2, 3, 5)
    out = CausalLMOutput(logits=logits, loss=loss, last_hidden_state=torch.randn(2, 3, 4))
    leaves, spec = pytree.tree_flatten(out)
    assert len(leaves) == 3 and leaves[0] is loss and leaves[1] is logits
    doubled = pytree.tree_unflatten([t * 2 for t in leaves], spec)
    assert type(doubled) is CausalLMOutput and list(doubled) == list(out)
    torch.testing.assert_close(doubled.logits, logits * 2)
    gathered = type(out)((name, value) for name, value in out.items())  # torch.nn.parallel.gather's form
    assert list(gathered) == ["loss", "logits", "last_hidden_state"] and gathered.logits is logits
    assert HeadOutput([("logits", logits)]).to_tuple() == (logits,)
    with pytest.raises(ValueError, match="not \\(name, value\\) pairs"):
        CausalLMOutput([logits, logits])
    with pytest.raises(ValueError, match="no fields \\['scores'\\]"):
        CausalLMOutput([("scores", logits)])


def test_model_config_takes_run_time_settings_and_keeps_the_architecture():
    ours = ours_from_hf(random_hf_model(tiny_llama_config(), seed=0))
    config = ours.config
    config.use_cache = False
    config.output_router_logits = False
    assert config.use_cache is False and config.output_router_logits is False
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    assert config.get_text_config() is config and config.is_encoder_decoder is False  # read from HF's config
    with pytest.raises(AttributeError, match="hidden_size.*cannot change"):
        config.hidden_size = 64
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        config.nonsense
    config.eos_token_id = [5, 6]  # TRL aligns token ids with its tokenizer: the typed config is replaced
    assert config.typed.eos_token_id == (5, 6) and config.to_dict()["eos_token_id"] == [5, 6]
    assert config.to_dict()["use_cache"] is False and '"model_type": "llama"' in config.to_json_string()
    assert config == copy.deepcopy(ours).config and config != ours_from_hf(random_hf_model(
        transformers.LlamaConfig(**{**tiny_llama_config().to_dict(), "num_hidden_layers": 1}), seed=0)).config


def test_packed_row_positions_mark_documents():
    """Without cu_seqlens, a (1, S) row whose position_ids restart is documents that do not see each other."""
    ours = ours_from_hf(random_hf_model(tiny_llama_config(), seed=1))
    lengths = [5, 3, 6]
    docs = [torch.randint(0, VOCAB, (1, n)) for n in lengths]
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with torch.no_grad():
        alone = torch.cat([ours(doc).logits[0] for doc in docs])
        packed = ours(torch.cat(docs, 1), position_ids=positions).logits[0]
        offsets = torch.tensor([0, 5, 8, 14], dtype=torch.int32)
        given = ours(torch.cat(docs, 1), cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=6,
                     max_length_k=6, use_cache=False).logits[0]
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(given, alone, atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['bogus'\\]"):
        ours(docs[0], bogus=1)
    with pytest.raises(ValueError, match="output_hidden_states"):
        ours(docs[0], output_hidden_states=True)


def test_frozen_embeddings_with_checkpointing_still_train_the_blocks():
    """PEFT's set-up: embeddings frozen, blocks checkpointed; enable_input_require_grads keeps a backward."""
    ours = ours_from_hf(random_hf_model(tiny_llama_config(), seed=2))
    ours.get_input_embeddings().weight.requires_grad_(False)
    ours.gradient_checkpointing_enable()
    ours.enable_input_require_grads()
    ids = torch.randint(0, VOCAB, (2, 6))
    ours(ids, labels=ids).loss.backward()
    assert ours.blocks[0].attn.qkv.weight.grad is not None
    ours.disable_input_require_grads()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_resize_token_embeddings_as_hf(tied, tmp_path):
    """Tokens added to the tokenizer: the old ids' logits stay, new rows start at the mean (HF's mean_resizing,
    which draws within 1e-9 of it), config.vocab_size follows, and the saved model loads in transformers."""
    config = transformers.LlamaConfig(**{**tiny_llama_config().to_dict(), "tie_word_embeddings": tied})
    hf = random_hf_model(config, seed=3)
    ours = ours_from_hf(hf)
    ids = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        before = ours(ids).logits
        ours.resize_token_embeddings(VOCAB + 5)
        hf.resize_token_embeddings(VOCAB + 5)
        after = ours(ids).logits
        assert ours.config.vocab_size == VOCAB + 5 and after.shape[-1] == VOCAB + 5
        torch.testing.assert_close(after[..., :VOCAB], before, atol=0, rtol=0)
        torch.testing.assert_close(after, hf(ids).logits, atol=1e-4, rtol=0)
        new_ids = torch.tensor([[VOCAB + 4, 3, VOCAB]])
        ours.save_pretrained(tmp_path)
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
        torch.testing.assert_close(reloaded(new_ids).logits, ours(new_ids).logits, atol=1e-5, rtol=0)
        ours.resize_token_embeddings(40, pad_to_multiple_of=16)
        assert ours(torch.tensor([[0, 47]])).logits.shape == (1, 2, 48)
        torch.testing.assert_close(ours(ids % 40).logits[..., :40], hf(ids % 40).logits[..., :40], atol=1e-4, rtol=0)


def test_an_hf_style_decode_loop_with_past_key_values():
    """HF's manual loop: the cache given as ``past_key_values`` comes back as ``out.past_key_values`` and takes
    the next token alone (with HF's growing attention mask), as HF's own model does; without a cache given, the
    attribute names how to keep one, and HF's cache objects are refused by name. (Row 0 is left-padded: our cached
    positions count its real tokens, HF's forward counts the padding too, so only row 1 is compared.)"""
    hf = random_hf_model(tiny_llama_config(), seed=3)
    ours = ours_from_hf(hf).eval()
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        out = ours(ids, attention_mask=mask, past_key_values=ours.new_kv_cache(batch_size=2, max_len=16))
        theirs = hf(ids, attention_mask=mask, use_cache=True)
        for _ in range(3):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(token)], 1)
            out = ours(token, attention_mask=mask, past_key_values=out.past_key_values)
            theirs = hf(token, attention_mask=mask, past_key_values=theirs.past_key_values, use_cache=True)
            torch.testing.assert_close(out.logits[1], theirs.logits[1], rtol=1e-4, atol=1e-4)
        plain = ours(ids)
        assert getattr(plain, "past_key_values", None) is None and getattr(plain, "cache", None) is None
        with pytest.raises(AttributeError, match="use_cache=True"):
            plain.past_key_values
        with pytest.raises(ValueError, match="past_key_values must be a flash-models KVCache, got DynamicCache"):
            ours(ids, past_key_values=theirs.past_key_values)


@pytest.mark.parametrize("name", ["past_key_values", "cache"])
def test_use_cache_keeps_a_cache_that_grows(name):
    """HF's loop with ``use_cache=True`` and nothing else: the first call makes the cache, each later call passes
    it back (as ``past_key_values`` or transformers' newer ``cache``) with the next token alone, past the length
    the cache was made for; the greedy tokens are HF's own loop's."""
    hf = random_hf_model(tiny_llama_config(), seed=4)
    ours = ours_from_hf(hf).eval()
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))

    def greedy(model, steps=20):
        out, tokens = model(ids, use_cache=True), []
        for _ in range(steps):
            tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
            out = model(tokens[-1], use_cache=True, **{name: getattr(out, name)})
        return torch.cat(tokens, 1), getattr(out, name)

    with torch.no_grad():
        want, _ = greedy(hf)
        got, cache = greedy(ours)
    assert torch.equal(got, want)
    assert cache.growable and cache.max_len >= 5 + 20 and cache.upper_bound == 5 + 20
    with pytest.raises(ValueError, match="pass the cache once"):
        ours(ids[:, :1], past_key_values=cache, cache=ours.new_kv_cache(batch_size=2, max_len=8))
    ours.train()
    assert getattr(ours(ids, use_cache=True), "cache", None) is None  # a training forward keeps none


@pytest.mark.parametrize("family", ["llama-untied", "gpt2-tied", "bert-classifier"])
def test_num_parameters_counts_as_hf(family):
    """HF's num_parameters, which the Trainer's total_flos reads: the real vocabulary (97, padded to 128 inside),
    tied weights once, nn.Embedding tables (positions, token types too) out with exclude_embeddings, frozen ones out
    with only_trainable."""
    if family == "llama-untied":
        hf = random_hf_model(tiny_llama_config(), seed=4)
    elif family == "gpt2-tied":
        hf = random_hf_model(transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=24), seed=4)
    else:
        hf = random_hf_model(transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                     intermediate_size=48, max_position_embeddings=24, num_labels=3,
                                                     architectures=["BertForSequenceClassification"]),
                             seed=4, auto_class="AutoModelForSequenceClassification")
    ours = ours_from_hf(hf)
    if family != "bert-classifier":  # decoders pad their vocabulary inside
        assert sum(p.numel() for p in ours.parameters()) > hf.num_parameters()
    for model in (hf, ours):
        model.get_input_embeddings().weight.requires_grad_(False)
        next(p for p in model.parameters() if p.dim() == 1).requires_grad_(False)
    for options in ({}, {"exclude_embeddings": True}, {"only_trainable": True}, {"only_trainable": True, "exclude_embeddings": True}):
        assert ours.num_parameters(**options) == hf.num_parameters(**options), options


def test_trl_clone_chat_template_resizes_as_for_hf(tmp_path):
    """TRL's clone_chat_template (SFTConfig(chat_template_path=a tokenizer)) adds the source tokenizer's tokens,
    resizes to a multiple of 64 and reads model.vocab_size to pad the tokenizer to it: ours ends where HF's does."""
    from trl.chat_template_utils import clone_chat_template

    from flash_models.checkpoint.tokenizer import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(fm.smollm2_gguf())
    source = copy.deepcopy(tokenizer)
    source.add_special_tokens({"additional_special_tokens": ["<|tool|>", "<|think|>", "<|end|>"]})
    source.eos_token = "<|end|>"
    source.save_pretrained(tmp_path)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    hf = random_hf_model(config, seed=5)
    ours = ours_from_hf(hf)
    results = [clone_chat_template(model, copy.deepcopy(tokenizer), str(tmp_path)) for model in (hf, ours)]
    (hf, hf_tokenizer, _), (ours, ours_tokenizer, _) = results
    assert ours.vocab_size == ours.config.vocab_size == len(ours_tokenizer) == hf.vocab_size == len(hf_tokenizer) > len(tokenizer) + 3
    assert ours.config.eos_token_id == ours.generation_config.eos_token_id == hf.config.eos_token_id
    ids = torch.randint(0, len(tokenizer) + 3, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, atol=1e-4, rtol=0)
