"""The Attention module's backends agree: eager, sdpa and our Triton "flash" kernels (through Triton's
interpreter on a CPU), on causal, left-padded, cached and sliding-window inputs."""

import pytest
import torch

from flash_kernels._testing import assert_close
from flash_models.config import AttentionConfig
from flash_models.modules.attention import Attention, build_attention_mask

CFG = AttentionConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32)


def make_layers(cfg=CFG, dtype=torch.float32):
    torch.manual_seed(0)
    layers = {impl: Attention(cfg, layer_idx=0, attn_impl=impl) for impl in ("eager", "sdpa", "flash")}
    for layer in layers.values():
        layer.load_state_dict(layers["eager"].state_dict())
    return {k: v.to(dtype) for k, v in layers.items()}


def run(layer, x, mask_2d=None, *, past=0, window=None):
    B, S, _ = x.shape
    mask = build_attention_mask(mask_2d, q_len=S, past_len=past, causal=True, sliding_window=window)
    positions = torch.arange(S).expand(B, S)
    return layer(x, mask=mask, position_ids=positions)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("padded", [False, True])
def test_flash_matches_eager_and_sdpa(padded, window):
    layers = make_layers(dtype=torch.bfloat16)
    x = torch.randn(3, 13, 64, dtype=torch.bfloat16)
    mask = None
    if padded:
        mask = torch.ones(3, 13, dtype=torch.long)
        mask[0, :4] = 0
        mask[2, :12] = 0
    with torch.no_grad():
        ref = run(layers["eager"].float(), x.float(), mask, window=window)
        for impl in ("sdpa", "flash"):
            out = run(layers[impl], x, mask, window=window)
            assert_close(out.float(), ref, torch.bfloat16, name=impl)
            if padded:  # left-padded query rows see no real key: attention gives zeros, so only the bias is left
                pad_rows = out[~mask.bool()]
                assert torch.equal(pad_rows, layers[impl].out_proj.bias.expand_as(pad_rows)), impl



@pytest.mark.parametrize("packed", [False, True])
def test_bidirectional_sliding_window_agrees_across_backends(packed):
    """Not causal, a window of W keeps the keys less than W positions away on either side (HF's bidirectional
    sliding window), on every backend: padded rows, packed documents and dense rows alike."""
    cfg = AttentionConfig(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32, causal=False, sliding_window=3)
    layers = make_layers(cfg, dtype=torch.bfloat16)
    B, S = (1, 11) if packed else (2, 11)
    x = torch.randn(B, S, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, 11], dtype=torch.int32) if packed else None
    mask = build_attention_mask(None, q_len=S, past_len=0, causal=False, sliding_window=3, cu_seqlens=cu)
    i = torch.arange(S)
    expected = (i[:, None] - i[None, :]).abs() < 3
    if packed:
        doc = torch.tensor([0] * 4 + [1] * 7)
        expected &= doc[:, None] == doc[None, :]
    assert torch.equal(mask.dense(x.device)[0, 0], expected)
    positions = torch.arange(S).expand(B, S)
    with torch.no_grad():
        ref = layers["eager"].float()(x.float(), mask=mask, position_ids=positions)
        for impl in ("sdpa", "flash"):
            assert_close(layers[impl](x, mask=mask, position_ids=positions).float(), ref, torch.bfloat16, name=impl)

def test_flash_backward_matches_sdpa():
    layers = make_layers(dtype=torch.bfloat16)
    x = torch.randn(2, 9, 64, dtype=torch.float32)
    grads = {}
    for impl in ("sdpa", "flash"):
        xi = x.clone().to(torch.bfloat16).requires_grad_()
        run(layers[impl], xi).float().square().sum().backward()
        grads[impl] = (xi.grad.float(), layers[impl].qkv.weight.grad.float())
    for ours, ref in zip(grads["flash"], grads["sdpa"]):
        assert_close(ours, ref, torch.bfloat16, scale=2.0)


@pytest.mark.parametrize("rotary_dim", [32, 16])
def test_rotary_flash_forward_backward_matches_sdpa(rotary_dim):
    """With rope, the flash path rotates q and k inside the packed qkv and attends over it (one dqkv in the
    backward); it must agree with sdpa on the slices, outputs and gradients."""
    from flash_models.config import RopeConfig
    from flash_models.modules.rotary import RotaryEmbedding

    rope = RopeConfig(rotary_dim=rotary_dim, max_position_embeddings=32)
    torch.manual_seed(0)
    layers = {impl: Attention(CFG, layer_idx=0, rope=rope, attn_impl=impl) for impl in ("sdpa", "flash")}
    layers["flash"].load_state_dict(layers["sdpa"].state_dict())
    tables = RotaryEmbedding(rope).tables(32, torch.device("cpu"))
    x = torch.randn(2, 11, 64)
    mask = build_attention_mask(None, q_len=11, past_len=0, causal=True, sliding_window=None)
    positions = torch.arange(11).expand(2, 11) + 3
    outs, grads = {}, {}
    for impl, layer in layers.items():
        layer = layer.to(torch.bfloat16)
        xi = x.clone().to(torch.bfloat16).requires_grad_()
        out = layer(xi, mask=mask, position_ids=positions, rope_tables=tables)
        out.float().square().sum().backward()
        outs[impl], grads[impl] = out.float(), (xi.grad.float(), layer.qkv.weight.grad.float())
    assert_close(outs["flash"], outs["sdpa"], torch.bfloat16)
    for ours, ref in zip(grads["flash"], grads["sdpa"]):
        assert_close(ours, ref, torch.bfloat16, scale=2.0)


def test_auto_picks_sdpa_on_cpu():
    layer = Attention(CFG, layer_idx=0, attn_impl="auto").to(torch.bfloat16)
    assert layer.backend_for(torch.randn(1, 2, 4, 32, dtype=torch.bfloat16)) == "sdpa"


def test_packed_documents_flash_matches_eager():
    layers = make_layers(dtype=torch.bfloat16)
    x = torch.randn(1, 20, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    positions = torch.cat([torch.arange(7), torch.arange(1), torch.arange(12)]).unsqueeze(0)
    with torch.no_grad():
        outs = {}
        for impl in ("eager", "flash"):
            mask = build_attention_mask(None, q_len=20, past_len=0, causal=True, sliding_window=None, cu_seqlens=cu)
            outs[impl] = layers[impl](x, mask=mask, position_ids=positions).float()
    assert_close(outs["flash"], outs["eager"], torch.bfloat16)


def _autograd_node_names(out: torch.Tensor) -> set[str]:
    names, stack, seen = set(), [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return names


def test_packed_documents_backward_writes_the_qkv_gradient_whole():
    """Training on packed documents: the flash path's gradients equal eager's, and autograd never assembles the
    qkv gradient from pieces (a select or slice of the projection would cost a zero fill and a copy of it per
    layer in the backward)."""
    layers = make_layers(dtype=torch.bfloat16)
    x = torch.randn(1, 20, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    positions = torch.cat([torch.arange(7), torch.arange(1), torch.arange(12)]).unsqueeze(0)
    grads = {}
    for impl in ("eager", "flash"):
        mask = build_attention_mask(None, q_len=20, past_len=0, causal=True, sliding_window=None, cu_seqlens=cu)
        xi = x.clone().requires_grad_()
        out = layers[impl](xi, mask=mask, position_ids=positions)
        if impl == "flash":
            assert not _autograd_node_names(out) & {"SelectBackward0", "SliceBackward0", "CopySlices"}
        out.float().square().sum().backward()
        grads[impl] = xi.grad.float()
    assert_close(grads["flash"], grads["eager"], torch.bfloat16, scale=2.0)


def test_cached_decoding_flash_matches_eager():
    """Prefill then single-token steps through a KV cache: the flash path appends with kv_append and runs the
    split-KV decode kernel; the eager path masks the whole cache."""
    from flash_models.modules.attention import build_cached_attention_mask
    from flash_models.modules.kv_cache import KVCache

    layers = make_layers(dtype=torch.bfloat16)
    x = torch.randn(2, 10, 64, dtype=torch.bfloat16)
    outs = {}
    for impl in ("eager", "flash"):
        cache = KVCache(num_layers=1, batch_size=2, max_len=16, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16, device="cpu")
        steps = []
        for start, end in ((0, 6), (6, 7), (7, 8), (8, 9), (9, 10)):
            mask = build_cached_attention_mask(None, cache, q_len=end - start, sliding_window=None)
            with torch.no_grad():
                steps.append(layers[impl](x[:, start:end], mask=mask, position_ids=mask.cache_slots, kv_cache=cache).float())
            cache.reserve(end - start)
            cache.advance_to(mask.cache_lengths)
        outs[impl] = torch.cat(steps, dim=1)
    assert_close(outs["flash"], outs["eager"], torch.bfloat16)


def test_paged_cached_decoding_flash_matches_eager():
    """The same steps through a paged cache: the flash path reads the pool through the block table."""
    from flash_models.modules.attention import build_cached_attention_mask
    from flash_models.modules.paged_kv_cache import PagedKVCache

    layers = make_layers(dtype=torch.bfloat16)
    x = torch.randn(2, 10, 64, dtype=torch.bfloat16)
    outs = {}
    for impl in ("eager", "flash"):
        cache = PagedKVCache(num_layers=1, batch_size=2, max_len=16, num_kv_heads=2, head_dim=32,
                             dtype=torch.bfloat16, device="cpu", block_size=4)
        steps = []
        for start, end in ((0, 6), (6, 7), (7, 8), (8, 9), (9, 10)):
            mask = build_cached_attention_mask(None, cache, q_len=end - start, sliding_window=None)
            cache.reserve(end - start)
            with torch.no_grad():
                steps.append(layers[impl](x[:, start:end], mask=mask, position_ids=mask.cache_slots, kv_cache=cache).float())
            cache.advance_to(mask.cache_lengths)
        outs[impl] = torch.cat(steps, dim=1)
    assert_close(outs["flash"], outs["eager"], torch.bfloat16)


def test_explicit_flash_on_float32_says_what_to_change():
    """The kernels refuse float32; for attn_impl="flash" the error speaks of the model's dtype and attn_impl, not
    of the kernel's backend= argument, on the packed and the padded path."""
    layer = make_layers()["flash"]  # float32
    x = torch.randn(2, 5, 64)
    with pytest.raises(ValueError, match="attn_impl='flash' runs our attention kernels in float16 or bfloat16"):
        run(layer, x)
    with pytest.raises(ValueError, match="load the model with dtype=torch.bfloat16"):
        run(layer, x, torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]))


def test_a_mask_without_padding_is_dropped_and_one_with_padding_kept(monkeypatch):
    """Tokenizers give an all-ones attention_mask with every unpadded batch: the forward drops it (one host
    read), so the layers attend with no mask, as for no mask at all; any padding keeps it; under
    torch.compile nothing is read and it is kept."""
    import flash_models as fm
    from flash_models.modules import attention

    model = fm.create_model("llama-1b", hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=64).eval()
    ids, ones = torch.randint(0, 64, (2, 7)), torch.ones(2, 7, dtype=torch.long)
    seen = []
    original = attention.build_attention_mask
    monkeypatch.setattr(fm.models.decoder, "build_attention_mask",
                        lambda mask, **kw: seen.append(mask) or original(mask, **kw))
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=ones).logits, model(ids).logits)
        padded = ones.clone()
        padded[1, :2] = 0
        model(ids, attention_mask=padded)
    assert seen[0] is None and seen[1] is None and seen[2] is padded
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert attention.without_padding(ones) is ones


def test_backend_on_a_device_and_dtype_as_the_layer_will_see_them():
    """A model decides before its layers run (BERT, whether to unpad): under autocast over float32 weights
    they compute in bf16 on CUDA, where "auto" takes our kernels (a device and dtype, no tensor needed)."""
    layer = Attention(CFG, layer_idx=0, attn_impl="auto", kernel_backend="auto")
    assert layer.backend_on(torch.device("cuda"), torch.bfloat16) == "flash"
    assert layer.backend_on(torch.device("cuda"), torch.float32) == "sdpa"
    assert layer.backend_on(torch.device("cpu"), torch.bfloat16) == "sdpa"
    assert layer.backend_for(torch.zeros(1, dtype=torch.bfloat16)) == "sdpa"  # on the CPU
    asked = []
    layer.backend_on = lambda device, dtype: asked.append(dtype) or "sdpa"
    weight = torch.zeros(2, 2)
    layer.backend_computing(weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer.backend_computing(weight)
    assert asked == [torch.float32, torch.bfloat16]  # the weights' dtype, then autocast's over them
