"""The lean CPU decode step (runtime/cpu_decode.py) against the plain ``decode_step`` of every registered decoder
it takes, at the families' test sizes with an odd vocabulary; the models it does not take get None (the
engine then runs the plain step), and ``generate`` picks it by default."""

import pytest
import torch

import flash_models as fm
from flash_kernels.rotary import apply_rotary_ref
from flash_models.generation.engine import DecodeRunner
from flash_models.registry import get_family, get_preset
from flash_models.runtime import cpu_decode
from flash_models.runtime.cpu_decode import LeanCpuStep, lean_step_unsupported
from flash_models.testing import max_rel_err, randomize_

DECODERS = [n for n in fm.list_models() if get_family(get_preset(n).model_type).hf_auto_class == "AutoModelForCausalLM"]


def sizes(name, **overrides):
    preset = get_preset(name)
    return {**get_family(preset.model_type).tiny(preset.hf_config), "vocab_size": 131, **overrides}


def tiny(name, **overrides):
    return randomize_(fm.create_model(name, **sizes(name, **overrides)), seed=3).eval()


def lean_takes(model) -> bool:
    return model.decoder_config.block == "pre_norm"


PRE_NORM = [n for n in DECODERS if lean_takes(fm.create_model(n, device="meta", **sizes(n)))]


def prefilled(model, ids, mask, max_len):
    cache = model.new_kv_cache(ids.shape[0], max_len)
    logits = model(ids, attention_mask=mask, kv_cache=cache).logits[:, -1]
    return cache, logits


@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize("padded", [False, True], ids=["same-length", "left-padded"])
def test_lean_step_equals_plain_decode_step(name, padded):
    model = tiny(name)
    B, S, steps = 3, 11, 9  # with Mistral's test window of 6, the later steps read only the window's keys
    ids = torch.randint(0, 131, (B, S))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :4] = 0
        mask[2, :1] = 0
    with torch.inference_mode():
        lean_cache, logits = prefilled(model, ids, mask, S + steps)
        plain_cache, _ = prefilled(model, ids, mask, S + steps)
        step = model.lean_decode_step(lean_cache)
        if not lean_takes(model):
            assert step is None and lean_step_unsupported(model, lean_cache) is not None
            return
        assert isinstance(step, LeanCpuStep)
        tables = model.rotary.tables(S + steps, ids.device) if model.rotary is not None else None
        token = logits.argmax(-1)
        for _ in range(steps):
            lean_cache.reserve(1)
            plain_cache.reserve(1)
            lean = step(token[:, None], lean_cache, tables)
            plain = model.decode_step(token[:, None], plain_cache, tables)
            assert lean.shape == plain.shape == (B, 131)
            assert max_rel_err(lean, plain) < 1e-5
            assert torch.equal(lean.argmax(-1), plain.argmax(-1))
            assert torch.equal(lean_cache.seqlens, plain_cache.seqlens)
            token = plain.argmax(-1)
        for layer in range(len(model.blocks)):
            assert max_rel_err(lean_cache.k[layer], plain_cache.k[layer]) < 1e-5
            assert max_rel_err(lean_cache.v[layer], plain_cache.v[layer]) < 1e-5


@pytest.mark.parametrize("name", PRE_NORM)
@pytest.mark.parametrize("S", [1, 11])
def test_lean_prefill_equals_the_plain_prefill(name, S):
    """Unpadded prompts into an empty cache (what generate's prefill gives the lean step): the last token's
    logits and every cached key and value as the plain forward leaves them; Mistral's window of 6 is shorter
    than the 11-token prompt."""
    model = tiny(name)
    ids = torch.randint(0, 131, (2, S))
    with torch.inference_mode():
        plain_cache, plain = prefilled(model, ids, None, S + 2)
        lean_cache = model.new_kv_cache(2, S + 2)
        lean_cache.reserve(S)
        tables = model.rotary.tables(S, ids.device) if model.rotary is not None else None
        lean = model.lean_decode_step(lean_cache)(ids, lean_cache, tables)
    assert max_rel_err(lean, plain) < 1e-5
    assert torch.equal(lean_cache.seqlens, plain_cache.seqlens) and lean_cache.upper_bound == plain_cache.upper_bound
    for layer in range(len(model.blocks)):
        assert max_rel_err(lean_cache.k[layer], plain_cache.k[layer]) < 1e-5
        assert max_rel_err(lean_cache.v[layer], plain_cache.v[layer]) < 1e-5


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [24, 14])
def test_rotation_is_the_rotary_reference(interleaved, rotary_dim):
    """The step's rotation matrix against apply_rotary_ref, also for the layouts no pre-norm family has yet:
    interleaved pairs and a partial rotary dim (channels past it pass through)."""
    model = tiny("llama-1b", hidden_size=72, num_attention_heads=3, num_key_value_heads=1)  # head dim 24
    with torch.inference_mode():
        cache = model.new_kv_cache(2, 20)
        step = model.lean_decode_step(cache)
        step.rotary_dim, step.interleaved = rotary_dim, interleaved
        cos, sin = torch.randn(20, rotary_dim // 2), torch.randn(20, rotary_dim // 2)
        positions = torch.tensor([3, 17])
        x = torch.randn(2, 5, 24)  # (B, heads, D)
        rotated = torch.matmul(x, step._rotation(positions, (cos, sin)))
        expected = apply_rotary_ref(x.unsqueeze(1), cos, sin, interleaved=interleaved, position_ids=positions[:, None])
    torch.testing.assert_close(rotated, expected.squeeze(1), rtol=1e-6, atol=1e-6)


def greedy_without_cache(model, ids, new_tokens):
    """The reference continuation: a full forward over the whole sequence for every token."""
    with torch.no_grad():
        for _ in range(new_tokens):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen3-0.6b", "gpt2"])
def test_generate_takes_the_lean_step_by_default(name):
    model = tiny(name)
    ids = torch.randint(0, 131, (1, 7))
    with torch.inference_mode():
        cache = model.new_kv_cache(1, 20)
        model(ids, kv_cache=cache)
        assert isinstance(DecodeRunner(model, cache, use_cuda_graph=False).step, LeanCpuStep)
    out = model.generate(ids, max_new_tokens=12, eos_token_id=[])
    assert torch.equal(out, greedy_without_cache(model, ids, 12))


def test_weights_updated_in_place_are_seen():
    model = tiny("llama-1b")
    ids = torch.randint(0, 131, (2, 6))
    before = model.generate(ids, max_new_tokens=6, eos_token_id=[])
    with torch.no_grad():
        for block in model.blocks:
            block.mlp.down.weight.mul_(-3.0)  # the transposed copies made by the first generate are stale now
        model.embed.tokens.weight.add_(torch.randn_like(model.embed.tokens.weight))
    after = model.generate(ids, max_new_tokens=6, eos_token_id=[])
    assert torch.equal(after, greedy_without_cache(model, ids, 6))
    assert not torch.equal(after, before)


@pytest.mark.parametrize("budget", [0, 1 << 40], ids=["over-budget", "within-budget"])
def test_copies_only_within_the_memory_budget(monkeypatch, budget):
    """Over the budget for transposed copies the step multiplies by the weights' own transposed views: no second
    copy of the weights, the same logits."""
    monkeypatch.setattr(cpu_decode, "_copy_budget", lambda: budget)
    model = tiny("llama-1b")
    ids = torch.randint(0, 131, (2, 6))
    with torch.inference_mode():
        cache, logits = prefilled(model, ids, torch.ones_like(ids), 8)
        step = model.lean_decode_step(cache)
        weights = [model.blocks[0].attn.qkv.weight, model.blocks[0].mlp.down.weight, model.output_embeddings()]
        forms = [cpu_decode._TRANSPOSED[model][w] for w in weights]
        assert all((f.data_ptr() == w.data_ptr()) == (budget == 0) for f, w in zip(forms, weights))
        plain_cache, _ = prefilled(model, ids, torch.ones_like(ids), 8)
        token = logits.argmax(-1)[:, None]
        cache.reserve(1)
        plain_cache.reserve(1)
        tables = model.rotary.tables(8, ids.device)
        assert max_rel_err(step(token, cache, tables), model.decode_step(token, plain_cache, tables)) < 1e-5


def test_prepare_makes_the_copies_generate_then_uses():
    model = tiny("llama-1b")
    assert cpu_decode.prepare_lean_step(model)
    head = model.output_embeddings()
    prepared = cpu_decode._TRANSPOSED[model][head]
    model.generate(torch.randint(0, 131, (1, 5)), max_new_tokens=3, eos_token_id=[])
    assert cpu_decode._TRANSPOSED[model][head] is prepared  # kept, not made again
    assert not cpu_decode.prepare_lean_step(tiny("llama-1b").to(torch.bfloat16))


def refusal(model, cache_kwargs=None):
    with torch.inference_mode():
        cache = model.new_kv_cache(1, 16, **(cache_kwargs or {}))
        return lean_step_unsupported(model, cache), model.lean_decode_step(cache)


@pytest.mark.parametrize("case", ["bfloat16", "kernel_backend=triton", "attn_impl=eager", "parallel block",
                                  "paged cache", "hooked block", "training with dropout", "grad mode"])
def test_what_the_lean_step_does_not_take(case):
    """Each of these decodes through the plain step: the predicate names the reason and no lean step is made."""
    name, kwargs, cache_kwargs = "llama-1b", {}, None
    if case == "bfloat16":
        kwargs = dict(dtype=torch.bfloat16)
    elif case == "kernel_backend=triton":
        kwargs = dict(kernel_backend="triton")
    elif case == "attn_impl=eager":
        kwargs = dict(attn_impl="eager")
    elif case == "parallel block":
        name = "pythia-160m"
    elif case == "paged cache":
        cache_kwargs = dict(block_size=4)
    elif case == "training with dropout":
        name, kwargs = "gpt2", dict(resid_pdrop=0.1)
    model = tiny(name, **kwargs) if case != "bfloat16" else tiny(name).to(torch.bfloat16)
    if case == "hooked block":
        model.blocks[1].register_forward_hook(lambda *args: None)
    if case == "training with dropout":
        model.train()
    if case == "grad mode":
        cache = model.new_kv_cache(1, 16)
        assert lean_step_unsupported(model, cache) == "grad mode is on"
        return
    reason, step = refusal(model, cache_kwargs)
    assert reason is not None and step is None


def test_eval_float32_llama_is_taken():
    reason, step = refusal(tiny("llama-1b"))
    assert reason is None and isinstance(step, LeanCpuStep)
