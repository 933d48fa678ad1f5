"""CUDA-only generation checks (run on the device machine): graph replay equals eager decoding."""

import pytest
import torch

import flash_models as fm
from flash_models.generation.engine import DecodeRunner
from flash_models.models import GPT2LMHeadModel

pytestmark = pytest.mark.gpu


def small(preset, **overrides):
    sizes = {
        "gpt2": dict(n_layer=4, n_embd=256, n_head=4, vocab_size=1000, n_positions=512),
        "llama-1b": dict(num_hidden_layers=4, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512),
    }[preset]
    torch.manual_seed(0)
    return fm.create_model(preset, dtype=torch.bfloat16, device="cuda", **{**sizes, **overrides}).eval()


@pytest.mark.parametrize("preset", ["gpt2", "llama-1b"])
@torch.inference_mode()
def test_graph_decode_logits_equal_eager_decode_logits(preset):
    model = small(preset)
    prompt = torch.randint(0, 1000, (3, 37), device="cuda")
    runs = {}
    for graph in (False, True):
        cache = model.new_kv_cache(3, 128)
        logits = model(prompt, kv_cache=cache).logits[:, -1]
        runner = DecodeRunner(model, cache, use_cuda_graph=graph)
        assert (runner.graph is not None) == graph
        steps = []
        for _ in range(20):
            token = logits.argmax(-1)
            logits = runner(token)
            steps.append(logits.float().clone())
        runs[graph] = torch.stack(steps)
    torch.testing.assert_close(runs[True], runs[False], rtol=0, atol=1e-2)


@pytest.mark.parametrize("preset", ["gpt2", "llama-1b"])
def test_generate_with_graphs_equals_without_and_reuses_the_graph(preset):
    model = small(preset)
    prompt = torch.randint(0, 1000, (2, 21), device="cuda")
    mask = torch.ones_like(prompt)
    mask[1, :5] = 0
    eager = model.generate(prompt, attention_mask=mask, max_new_tokens=40, eos_token_id=[], use_cuda_graph=False)
    graphed = model.generate(prompt, attention_mask=mask, max_new_tokens=40, eos_token_id=[])
    again = model.generate(prompt, attention_mask=mask, max_new_tokens=40, eos_token_id=[])
    assert torch.equal(graphed, eager) and torch.equal(again, eager)


def test_speculative_equals_greedy_on_gpu():
    target, draft = small("llama-1b"), small("llama-1b", num_hidden_layers=1)
    prompt = torch.randint(0, 1000, (4, 16), device="cuda")
    greedy = target.generate(prompt, max_new_tokens=48, eos_token_id=[], use_cuda_graph=False)
    spec = target.generate(prompt, max_new_tokens=48, eos_token_id=[], draft_model=draft, num_draft_tokens=4)
    assert torch.equal(spec, greedy)


def test_interleaved_generations_of_one_shape_get_separate_pooled_caches():
    from flash_models.generation import Generation, resolve_settings

    model = small("gpt2")
    prompts = [torch.randint(0, 1000, (1, 12), device="cuda") for _ in range(2)]
    alone = [model.generate(p, max_new_tokens=20, eos_token_id=[]) for p in prompts]
    settings = resolve_settings(model.config, 1000, max_new_tokens=20, eos_token_id=[])
    runs = [Generation(model, p, settings=settings) for p in prompts]
    iters = [iter(r) for r in runs]
    for _ in range(20):  # step the two generations in turn
        for it in iters:
            next(it)
    for run, ref in zip(runs, alone):
        assert torch.equal(run.output(), ref)


def test_compiled_and_graphed_decode_generates_what_eager_does():
    model = small("llama-1b")
    prompt = torch.randint(0, 1000, (2, 19), device="cuda")
    # A compiled step launches plainly (programmatic launch is for our own kernels): the plain eager step's tokens.
    eager = model.generate(prompt, max_new_tokens=24, eos_token_id=[], use_cuda_graph=False, programmatic_launch=False)
    compiled = model.generate(prompt, max_new_tokens=24, eos_token_id=[], compile_decode=True)
    assert torch.equal(compiled, eager)


def test_paged_cache_with_graphs_generates_what_the_static_cache_does():
    model = small("llama-1b")
    prompt = torch.randint(0, 1000, (3, 21), device="cuda")
    static = model.generate(prompt, max_new_tokens=40, eos_token_id=[])
    paged = model.generate(prompt, max_new_tokens=40, eos_token_id=[], kv_block_size=16)
    assert torch.equal(paged, static)


@pytest.mark.parametrize("vocab_multiple", [1, 128])
@pytest.mark.parametrize("vocab,bias", [(50257, False), (1000, True), (1024, False)])
@torch.inference_mode()
def test_head_logits_equal_the_plain_head(vocab, bias, vocab_multiple):
    """The head over an odd vocabulary: padded (the default), one aligned GEMM cut to the real vocabulary;
    unpadded, two GEMMs (aligned rows, then the rest). Either gives the plain linear's logits, with or without a
    head bias, for decode-step and prompt shapes."""
    config = small("gpt2", vocab_size=vocab).config.typed
    with torch.device("cuda"):
        model = GPT2LMHeadModel(config, vocab_multiple=vocab_multiple).to(torch.bfloat16).eval()
    if bias:  # a head with a bias (GPT-J's), on this GPT-2 for the test
        model.lm_head = torch.nn.Linear(256, model.embed.tokens.num_embeddings, bias=True, device="cuda",
                                        dtype=torch.bfloat16)
    weight = model.output_embeddings()
    head_bias = model.lm_head.bias if bias else None
    for shape in ((16, 256), (2, 9, 256)):
        hidden = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        got = model._logits(hidden)
        assert got.shape == (*shape[:-1], vocab)
        want = torch.nn.functional.linear(hidden, weight, head_bias)[..., :vocab]
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)  # other kernels: bf16 rounding


@pytest.mark.parametrize("batch", [1, 3])  # the early trigger and the key prefetch at batch 1, neither past it
@pytest.mark.parametrize("preset", ["gpt2", "llama-1b"])
@torch.inference_mode()
def test_programmatic_launch_decode_gives_the_plain_logits(preset, batch, monkeypatch):
    """A decode step captured with programmatic dependent launch (its projections as our GEMV, the kernels
    launched early and waiting in-kernel) gives the plain step's logits, step after step, for the same tokens
    fed to both (the GEMV sums in another order than cuBLAS: a greedy pick could flip on a tie)."""
    import flash_kernels

    gemv_calls = []
    real_gemv = flash_kernels.gemv
    monkeypatch.setattr(flash_kernels, "gemv", lambda *a, **k: gemv_calls.append(1) or real_gemv(*a, **k))
    model = small(preset)
    prompt = torch.randint(0, 1000, (batch, 37), device="cuda")
    tokens, runs = [], {}
    for pdl in (False, True):
        cache = model.new_kv_cache(batch, 128)
        logits = model(prompt, kv_cache=cache).logits[:, -1]
        runner = DecodeRunner(model, cache, programmatic_launch=pdl)
        assert runner.graph is not None and bool(gemv_calls) == pdl
        steps = []
        for i in range(20):
            if not pdl:
                tokens.append(logits.argmax(-1))
            logits = runner(tokens[i])
            steps.append(logits.float().clone())
        runs[pdl] = torch.stack(steps)
    torch.testing.assert_close(runs[True], runs[False], rtol=0, atol=2e-2)
