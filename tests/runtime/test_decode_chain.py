"""runtime.decode_chain, the model side of programmatic dependent launch: inside its context a decode step's
half-precision projections run as our GEMV (so they can join the chain of early launches), anything else stays
F.linear; a LLaMA-style block runs as the chained step (norms, SwiGLU and residual adds folded into the GEMVs),
which gives the block's plain forward; the generation setting reaches the decode runner, which enters the
context around its steps and its graph capture. On the CPU the kernels run in Triton's interpreter."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import flash_kernels
import flash_models as fm
from flash_kernels._testing import assert_close
from flash_models.generation import engine
from flash_models.modules import linear as linear_module
from flash_models.modules.attention import build_cached_attention_mask
from flash_models.runtime import decode_chain
from flash_models.runtime.decode_chain import chained_block_step, chains, programmatic_launch


@pytest.fixture
def gemv_calls(monkeypatch):
    """Counts flash_kernels.gemv calls, and lets the routing see a PDL-capable device inside the context (the
    kernels themselves still launch plainly here: the CPU cannot wait on a grid)."""
    calls = []
    real = flash_kernels.gemv

    def spy(*args, **kwargs):
        calls.append((args[0].shape, kwargs.get("norm_weight") is not None, kwargs.get("residual") is not None,
                      kwargs.get("swiglu_output", False)))
        return real(*args, **kwargs)

    monkeypatch.setattr(flash_kernels, "gemv", spy)
    monkeypatch.setattr(decode_chain, "programmatic_launch_enabled", lambda device: flash_kernels._pdl._MODE.get())
    return calls


def test_dense_takes_the_gemv_for_one_half_row_inside_the_context(gemv_calls):
    """modules.linear.dense, the modules' inference projection, routed by the runtime's context."""
    torch.manual_seed(0)
    weight, bias = torch.randn(40, 64).bfloat16(), torch.randn(40).bfloat16()
    row = torch.randn(1, 1, 64).bfloat16()
    with torch.no_grad():
        assert torch.equal(linear_module.dense(row, weight, bias, backend="auto"), F.linear(row, weight, bias))  # outside
        assert gemv_calls == []
        with programmatic_launch():
            linear_module.dense(row, weight, bias, backend="reference")  # plain PyTorch, in a chain too
            assert gemv_calls == []
            out = linear_module.dense(row, weight, bias, backend="auto")
            assert gemv_calls == [((1, 1, 64), False, False, False)]
            few = linear_module.dense(torch.randn(16, 64).bfloat16(), weight, bias, backend="auto")  # a batch-16 decode step's
            assert len(gemv_calls) == 2 and few.shape == (16, 40)
            linear_module.dense(torch.randn(17, 64).bfloat16(), weight, bias, backend="auto")  # more rows: a GEMM's job
            big = torch.zeros(decode_chain.FEW_ROWS_MAX_WEIGHT // 64 + 1, 64).bfloat16()
            linear_module.dense(torch.randn(16, 64).bfloat16(), big, backend="auto")  # a weight too big for the few-rows kernel
            assert len(gemv_calls) == 2
            linear_module.dense(row, big, backend="auto")  # one row takes the GEMV whatever the size
            linear_module.dense(row.float(), weight.float(), bias.float(), backend="auto")  # float32: cuBLAS, not TF32
    with programmatic_launch():
        linear_module.dense(row, weight, bias, backend="auto")  # grad mode: no backward in the GEMV
    with torch.no_grad(), flash_kernels.programmatic_launch():
        linear_module.dense(row, weight, bias, backend="auto")  # the kernels' context alone routes no projection
    assert len(gemv_calls) == 3
    assert_close(out, F.linear(row.float(), weight.float(), bias.float()).bfloat16(), torch.bfloat16)


TINY = {
    "llama-1b": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256, max_position_embeddings=64),
    "gpt2": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64),
}


@pytest.mark.parametrize("preset", sorted(TINY))
def test_the_setting_reaches_the_runner_and_its_steps_run_in_the_context(preset, gemv_calls, monkeypatch):
    entered = []
    real_context = engine.programmatic_launch_context

    def recording_context(enabled=True, *, early_trigger=False):
        entered.append(enabled)
        assert early_trigger  # batch 1: the early trigger
        return real_context(enabled, early_trigger=early_trigger)

    monkeypatch.setattr(engine, "programmatic_launch_context", recording_context)
    torch.manual_seed(0)
    model = fm.create_model(preset, dtype=torch.bfloat16, **TINY[preset]).eval()
    prompt = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        plain = model.generate(prompt, max_new_tokens=3, eos_token_id=[], programmatic_launch=False)
        assert entered == [False, False] and gemv_calls == []
        chained = model.generate(prompt, max_new_tokens=3, eos_token_id=[])  # on by default
    assert entered[2:] == [True, True]
    # Every projection of a decode step (qkv, out and the MLP's two per layer, then the head) was a GEMV; in the
    # LLaMA blocks the qkv and gate/up ones normalized their input, gate/up applied SwiGLU to its output and the
    # out and down ones added the residual stream.
    assert len(gemv_calls) == 2 * (4 * 2 + 1)
    fused = [call[1:] for call in gemv_calls]
    unfused = [(False, False, False)] * 4
    per_layer = [(True, False, False), (False, True, False), (True, False, True), (False, True, False)]
    per_layer = per_layer if preset == "llama-1b" else unfused
    assert fused == (per_layer * 2 + [(False, False, False)]) * 2
    # The prefill (five rows: GEMMs either way) picks the same first token; the later ones come from GEMV
    # logits, equal to cuBLAS's up to float32 summation order.
    assert chained.shape == plain.shape and torch.equal(chained[:, :6], plain[:, :6])


@pytest.mark.parametrize("preset", sorted(TINY))
@torch.no_grad()
def test_the_reference_backend_never_takes_the_chain(preset, gemv_calls):
    """kernel_backend="reference" is plain PyTorch in a decode step too: with programmatic launch on (the
    default) no projection becomes our GEMV and no block folds its norms into one."""
    model = fm.create_model(preset, dtype=torch.bfloat16, kernel_backend="reference", **TINY[preset]).eval()
    model.generate(torch.randint(0, 256, (1, 5)), max_new_tokens=3, eos_token_id=[])
    assert gemv_calls == []


@pytest.mark.parametrize("batch", [1, 3])  # the one-row GEMV, and the few-rows kernel
@torch.no_grad()
def test_chained_llama_decode_steps_give_the_plain_logits(gemv_calls, batch):
    """The chained block (the norms in the qkv and gate/up GEMVs, SwiGLU after gate/up's, the residual adds in
    the out and down GEMVs, the stream carried whole) against the plain block, decode step by decode step on the
    same tokens."""
    torch.manual_seed(0)
    model = fm.create_model("llama-1b", dtype=torch.bfloat16, **TINY["llama-1b"]).eval()
    prompt = torch.randint(0, 256, (batch, 7))
    tokens, runs = torch.randint(0, 256, (6, batch)), {}
    for chained in (False, True):
        cache = model.new_kv_cache(batch, 32)
        model(prompt, kv_cache=cache)
        runner = engine.DecodeRunner(model, cache, use_cuda_graph=False, programmatic_launch=chained)
        runs[chained] = torch.stack([runner(token).float() for token in tokens])
    assert len(gemv_calls) == len(tokens) * (4 * 2 + 1)
    assert_close(runs[True], runs[False], torch.bfloat16, name="chained decode logits")


def test_a_compiled_step_launches_plainly():
    """Inductor's kernels cannot join the chain, and a compiled step must give the plain step's tokens: the
    runner of a compiled step leaves the context off whatever the setting says."""
    model = fm.create_model("llama-1b", dtype=torch.bfloat16, **TINY["llama-1b"]).eval()
    cache = model.new_kv_cache(1, 32)
    compiled = engine.DecodeRunner(model, cache, use_cuda_graph=False, compile="eager", programmatic_launch=True)
    plain = engine.DecodeRunner(model, cache, use_cuda_graph=False, programmatic_launch=True)
    assert not compiled.programmatic_launch and plain.programmatic_launch


@torch.no_grad()
def test_a_block_chains_only_when_every_projection_is_a_gemv(gemv_calls, monkeypatch):
    """At batch 3 a weight past FEW_ROWS_MAX_WEIGHT stays a cuBLAS GEMM: a block whose gate/up is one cannot
    fold its norms and adds into GEMVs, so it runs unchained (its smaller projections still GEMVs)."""
    torch.manual_seed(0)
    model = fm.create_model("llama-1b", dtype=torch.bfloat16, **TINY["llama-1b"]).eval()
    monkeypatch.setattr(decode_chain, "FEW_ROWS_MAX_WEIGHT", 10_000)  # qkv 8192, gate/up 16384 elements
    cache = model.new_kv_cache(3, 32)
    model(torch.randint(0, 256, (3, 7)), kv_cache=cache)
    runner = engine.DecodeRunner(model, cache, use_cuda_graph=False, programmatic_launch=True)
    runner(torch.randint(0, 256, (3,)))
    assert gemv_calls and all(call[1:] == (False, False, False) for call in gemv_calls)
    assert len(gemv_calls) == 3 * 2  # qkv, out and down per layer; gate/up and the head are GEMMs


def tiny_llama(dtype, activation="silu", preset="llama-1b"):
    """One LLaMA-style layer at odd sizes (hidden 48, three query heads over one KV head, intermediate 80), its
    norm weights moved off their init (a unit or zero weight would hide how the norm applies it)."""
    torch.manual_seed(0)
    model = fm.create_model(preset, dtype=dtype, num_hidden_layers=1, hidden_size=48, intermediate_size=80,
                            num_attention_heads=3, num_key_value_heads=1, head_dim=16, vocab_size=96,
                            max_position_embeddings=64, hidden_act=activation).eval()
    with torch.no_grad():
        for block in model.blocks:
            for norm in (block.norm1, block.norm2):
                norm.weight.add_(0.2 * torch.randn_like(norm.weight))
    return model


def check_step_against_plain_forward(model, batch: int, prompt_len: int = 5) -> None:
    """The step function straight on the first block's weights (no context needed: it calls the GEMV itself),
    against the block's plain forward on the same stream and an equal cache: the new stream (the plain forward's
    hidden + residual) and the keys and values written for the new token."""
    block, device, dtype = model.blocks[0], model.device, model.dtype
    hidden_size, max_len = model.decoder_config.hidden_size, prompt_len + 11
    caches = [model.new_kv_cache(batch, max_len) for _ in range(2)]
    prompt = torch.randint(0, model.decoder_config.vocab_size, (batch, prompt_len), device=device)
    stream = torch.randn(batch, 1, hidden_size, dtype=dtype, device=device)
    step_kwargs = []
    for cache in caches:
        model(prompt, kv_cache=cache)
        cache.reserve(1)
        mask = build_cached_attention_mask(None, cache, q_len=1, sliding_window=None, cache_was_empty=False)
        step_kwargs.append(dict(mask=mask, position_ids=mask.cache_slots, kv_cache=cache,
                                rope_tables=model.rotary.tables(max_len, device)))
    hidden, residual = block(stream, None, **step_kwargs[0])
    chained = chained_block_step(block, stream, **step_kwargs[1])
    assert chained.shape == stream.shape and chained.dtype == dtype
    assert_close(chained.float(), hidden.float() + residual.float(), dtype, name="chained stream")
    new = slice(0, prompt_len + 1)
    for plain_kv, chained_kv in ((caches[0].k[0], caches[1].k[0]), (caches[0].v[0], caches[1].v[0])):
        assert_close(chained_kv[:, new].float(), plain_kv[:, new].float(), dtype, name="cache")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation,preset", [("silu", "llama-1b"), ("gelu_pytorch_tanh", "llama-1b"),
                                               ("silu", "qwen3-0.6b"),  # SwiGLU epilogue, GeGLU after, q/k norms
                                               ("gelu_pytorch_tanh", "gemma-2b")])  # norms scaling by 1 + weight
@pytest.mark.parametrize("batch", [1, 3])  # the one-row GEMV, and the few-rows kernel
@torch.no_grad()
def test_chained_block_step_gives_the_plain_block_forward(dtype, activation, preset, batch):
    check_step_against_plain_forward(tiny_llama(dtype, activation, preset), batch)


@pytest.mark.gpu
@pytest.mark.parametrize("preset,batch", [("llama-1b", 1), ("smollm2-135m", 16),  # the widths that chain there
                                          ("gemma-2b", 1)])  # norms scaling by 1 + weight, head dim 256
@torch.no_grad()
def test_chained_block_step_at_real_sizes_gives_the_plain_forward(preset, batch):
    """The compiled kernels (not the interpreter) at a real model's widths (LLaMA-1.1B: hidden 2048, 32 query and
    4 KV heads, intermediate 5632; SmolLM2-135M at batch 16, whose weights stay under FEW_ROWS_MAX_WEIGHT; Gemma-2B,
    one KV head of 256 and norms scaling by 1 + weight), against the plain block on cuBLAS and our norm and
    SwiGLU kernels."""
    torch.manual_seed(0)
    model = fm.create_model(preset, dtype=torch.bfloat16, num_hidden_layers=1, vocab_size=256).cuda().eval()
    check_step_against_plain_forward(model, batch, prompt_len=37)


@torch.no_grad()
def test_chains_holds_only_for_a_llama_block_in_eval_inside_the_context(gemv_calls):
    model = tiny_llama(torch.bfloat16)
    block, stream = model.blocks[0], torch.randn(1, 1, 48, dtype=torch.bfloat16)
    assert not chains(block, stream)  # outside the context
    with flash_kernels.programmatic_launch():
        assert not chains(block, stream)  # the kernels' context alone: no GEMV routing, no chain
    with programmatic_launch():
        assert chains(block, stream)
        assert chains(checkpoint_wrapper(block).eval(), stream)  # activation checkpointing's wrapper: its block
        assert not chains(block, stream.float())  # float32: cuBLAS
        assert not chains(block, torch.randn(17, 1, 48, dtype=torch.bfloat16))  # more rows than a decode step's
        block.train()
        assert not chains(block, stream)
        block.eval()
        block.residual_in_fp32 = True  # the GEMV's residual add keeps the stream in the model's dtype
        assert not chains(block, stream)
        block.residual_in_fp32 = False
        block.norm2.kind = "layer_norm"  # the prologue is an RMSNorm
        assert not chains(block, stream)
        block.norm2.kind = "rms_norm"
        reference = fm.create_model("llama-1b", dtype=torch.bfloat16, kernel_backend="reference", **TINY["llama-1b"])
        assert not chains(reference.eval().blocks[0], torch.randn(1, 1, 64, dtype=torch.bfloat16))
        gpt2 = fm.create_model("gpt2", dtype=torch.bfloat16, **TINY["gpt2"]).eval()  # LayerNorms, a plain MLP
        assert not chains(gpt2.blocks[0], torch.randn(1, 1, 64, dtype=torch.bfloat16))
    assert gemv_calls == []
