"""flash_attn_with_kvcache: split-KV Triton decode (the CPU interpreter in CI) against the reference."""

import importlib

import pytest
import torch

from flash_kernels import flash_attn_func, flash_attn_with_kvcache, programmatic_launch
from flash_kernels._testing import assert_close
from flash_kernels.attention_decode import flash_attn_with_kvcache_ref

dec = importlib.import_module("flash_kernels.attention_decode")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.bfloat16]


def _cache(bsz, capacity, hkv, d, dtype, page_size=None, device=DEVICE):
    """Random caches, contiguous (B, capacity, Hkv, D) or paged with a shuffled block table."""
    if page_size is None:
        kc = torch.randn(bsz, capacity, hkv, d, dtype=dtype, device=device)
        return kc, torch.randn_like(kc), None
    n_pages = capacity // page_size
    total = bsz * n_pages + 3  # a few spare pages nobody owns
    kc = torch.randn(total, page_size, hkv, d, dtype=dtype, device=device)
    table = torch.randperm(total, device=device)[: bsz * n_pages].reshape(bsz, n_pages).int()
    return kc, torch.randn_like(kc), table


# (B, Sq, Hq, Hkv, D, capacity, S_new, page_size, causal, window, softcap)
CASES = [
    (2, 1, 4, 2, 64, 80, 1, None, True, (-1, -1), 0.0),
    (3, 1, 8, 1, 32, 113, 0, None, True, (-1, -1), 0.0),  # no append, MQA
    (2, 3, 4, 4, 64, 96, 3, None, True, (-1, -1), 0.0),  # several new tokens
    (3, 2, 4, 1, 32, 96, 2, 16, True, (-1, -1), 0.0),  # paged
    (2, 1, 2, 2, 128, 64, 1, 32, True, (17, -1), 5.0),  # paged + window + softcap
    (2, 4, 2, 2, 80, 64, 0, None, False, (7, 3), 0.0),
    (3, 1, 4, 4, 64, 113, 1, None, True, (-1, -1), 0.0),  # one query row a kv head (MHA decode)
    (2, 1, 3, 3, 80, 96, 0, 16, False, (5, 2), 0.0),  # the same, head dim padded, paged, a two-sided window
]


@pytest.mark.parametrize("splits", ["planned", "single", "planned+prefetch", "single+prefetch", "planned+prefetch2",
                                    "planned+inloop", "single+inloop", "planned+next", "single+prefetch+next"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_kvcache_matches_reference(case, dtype, splits, monkeypatch):
    """The planned split-KV schedule (several splits and the merge, under the interpreter) and one split that
    writes the output itself (what short caches at a large batch get on the GPU); each also with the start of
    the chunk read ahead of the wait for the kernel before (what programmatic launch runs), its newest keys
    after: as the rule picks ("prefetch"), two register tiles at any head dim ("prefetch2"), and the wait inside
    the pipelined key loop at any head dim ("inloop"); and with the key loop that loads the next tile before the
    current one's dots ("next": what long chunks of a contiguous cache get on the GPU; here paged caches too,
    which the kernel takes as well)."""
    if splits.startswith("single"):
        monkeypatch.setattr(dec, "_split_plan", lambda q, capacity, n_prog_other, num_splits=0: (capacity, 1))
    monkeypatch.setattr(dec, "_prefetch_kv", lambda device: "prefetch" in splits or "inloop" in splits)
    monkeypatch.setattr(dec, "_prefetch_next", lambda chunk, paged, head_dim: splits.endswith("next"))
    if splits.endswith("prefetch2"):
        monkeypatch.setattr(dec, "_prefetch_mode", lambda block_d, paged, prefetch_next: dec.PREFETCH_REGISTERS)
        monkeypatch.setattr(dec, "_prefetch_tiles", lambda block_d: 2)
    if splits.endswith("inloop"):
        monkeypatch.setattr(dec, "_prefetch_mode", lambda block_d, paged, prefetch_next: dec.WAIT_IN_LOOP)
    torch.manual_seed(0)
    bsz, sq, hq, hkv, d, capacity, s_new, page, causal, window, softcap = case
    q = torch.randn(bsz, sq, hq, d, dtype=dtype, device=DEVICE)
    kc, vc, table = _cache(bsz, capacity, hkv, d, dtype, page)
    seqlens = torch.randint(0, capacity - s_new + 1, (bsz,), dtype=torch.int32, device=DEVICE)
    seqlens[0] = capacity - s_new  # one row uses the whole cache
    k = torch.randn(bsz, s_new, hkv, d, dtype=dtype, device=DEVICE) if s_new else None
    v = torch.randn(bsz, s_new, hkv, d, dtype=dtype, device=DEVICE) if s_new else None
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kw = dict(cache_seqlens=seqlens, k=k, v=v, causal=causal, window_size=window, softcap=softcap, block_table=table)
    out = flash_attn_with_kvcache(q, kc, vc, **kw, backend="triton")
    ref = flash_attn_with_kvcache_ref(q, kc_ref, vc_ref, **kw)
    assert_close(out, ref, dtype, name="out")
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref), "append wrote different cache entries"
    if k is not None:  # the appended tokens really are in the cache
        b = 1
        pos = seqlens[b].item()
        if table is None:
            torch.testing.assert_close(kc[b, pos:pos + s_new], k[b], rtol=0, atol=0)
        else:
            rows = torch.arange(pos, pos + s_new, device=DEVICE)
            got = kc[table[b].long()[rows // page], rows % page]
            torch.testing.assert_close(got, k[b], rtol=0, atol=0)


@pytest.mark.parametrize("capacity,n_prog_other,expected", [
    (8192, 16, 16),   # batch 1 x 16 kv heads: 256 programs, one wave of two per SM
    (8192, 256, 1),   # batch 16 x 16: a second split would make 1.94 waves
    (8192, 132, 2),   # exactly one program per SM per split: two fit
    (512, 4, 8),      # a short cache: no chunk under DECODE_MIN_CHUNK keys
    (100, 4, 2),
    (1, 4, 1),
    (32768, 600, 1),  # more programs than a wave already
])
def test_split_count_stays_within_one_wave(capacity, n_prog_other, expected):
    sms = 132
    splits = dec._split_count(capacity, n_prog_other, sms)
    assert splits == expected
    assert splits == 1 or splits * n_prog_other <= dec.DECODE_PROGRAMS_PER_SM * sms
    assert splits <= -(-capacity // dec.DECODE_MIN_CHUNK)  # no more chunks than DECODE_MIN_CHUNK-key pieces


def test_prefetch_rules():
    """What the split kernel reads before its wait, where it was measured to win (attention_decode,
    PREFETCH_REGISTERS / WAIT_IN_LOOP): the wait inside the key loop for 128-wide tiles of a contiguous cache;
    register tiles otherwise, two at head dims up to 64, one above."""
    assert dec._prefetch_mode(128, False, False) == dec.WAIT_IN_LOOP
    assert dec._prefetch_mode(128, True, False) == dec.PREFETCH_REGISTERS  # paged
    assert dec._prefetch_mode(128, False, True) == dec.PREFETCH_REGISTERS  # the register-prefetch key loop
    assert dec._prefetch_mode(64, False, False) == dec._prefetch_mode(256, False, False) == dec.PREFETCH_REGISTERS
    assert [dec._prefetch_tiles(bd) for bd in (32, 64, 128, 256)] == [2, 2, 1, 1]


def test_prefetch_next_rule():
    """The register-prefetch key loop is taken where it was measured to win (attention_decode,
    PREFETCH_NEXT_MIN_CHUNK): long chunks of a contiguous cache at head dims 80-128; not paged, at head dims 64
    or 256, or on shorter chunks."""
    long = dec.PREFETCH_NEXT_MIN_CHUNK
    assert all(dec._prefetch_next(long, False, d) for d in (80, 96, 128))
    assert dec._prefetch_next(4 * long, False, 128)
    assert not dec._prefetch_next(long // 2, False, 128)
    assert not dec._prefetch_next(long, True, 128)
    assert not dec._prefetch_next(long, False, 64) and not dec._prefetch_next(long, False, 256)


def test_decode_steps_equal_full_attention():
    """Prefill a cache, then decode token by token: each step equals the full causal attention's last row."""
    torch.manual_seed(1)
    bsz, total, hq, hkv, d = 2, 20, 4, 2, 32
    q = torch.randn(bsz, total, hq, d, dtype=torch.float16, device=DEVICE)
    k = torch.randn(bsz, total, hkv, d, dtype=torch.float16, device=DEVICE)
    v = torch.randn(bsz, total, hkv, d, dtype=torch.float16, device=DEVICE)
    full = flash_attn_func(q, k, v, causal=True, backend="triton")
    kc, vc, table = _cache(bsz, 32, hkv, d, torch.float16, page_size=16)
    seqlens = torch.zeros(bsz, dtype=torch.int32, device=DEVICE)
    prefill = 15
    out = flash_attn_with_kvcache(q[:, :prefill], kc, vc, cache_seqlens=seqlens, k=k[:, :prefill], v=v[:, :prefill],
                                  block_table=table, causal=True, backend="triton")
    assert_close(out, full[:, :prefill], torch.float16, name="prefill")
    seqlens += prefill
    for t in range(prefill, total):
        step = flash_attn_with_kvcache(q[:, t:t + 1], kc, vc, cache_seqlens=seqlens, k=k[:, t:t + 1], v=v[:, t:t + 1],
                                       block_table=table, backend="triton")
        assert_close(step, full[:, t:t + 1], torch.float16, name=f"step {t}")
        seqlens += 1


def test_very_negative_scores_with_window():
    """Logits about -290 and a left window: rows whose first key tile is invisible must still normalise."""
    torch.manual_seed(5)
    q = torch.full((1, 40, 2, 32), 3.0, dtype=torch.float16, device=DEVICE)  # late rows start far right
    kc = (-3.0 + 0.1 * torch.randn(1, 64, 2, 32, device=DEVICE)).half()
    vc = torch.randn(1, 64, 2, 32, dtype=torch.float16, device=DEVICE)
    lens = torch.tensor([60], dtype=torch.int32, device=DEVICE)
    kw = dict(cache_seqlens=lens, softmax_scale=1.0, window_size=(5, 0), causal=True)
    out = flash_attn_with_kvcache(q, kc, vc, **kw, backend="triton")
    ref = flash_attn_with_kvcache_ref(q, kc.clone(), vc.clone(), **kw)
    assert_close(out, ref, torch.float16, name="out")


def test_empty_cache_row_gives_zeros():
    torch.manual_seed(2)
    q = torch.randn(2, 1, 2, 32, dtype=torch.float16, device=DEVICE)
    kc, vc, _ = _cache(2, 48, 2, 32, torch.float16)
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([0, 30], dtype=torch.int32, device=DEVICE),
                                  backend="triton")
    assert (out[0] == 0).all() and torch.isfinite(out).all() and (out[1].abs() > 0).any()


def test_kvcache_validation_errors():
    q = torch.randn(2, 1, 4, 32, dtype=torch.float16, device=DEVICE)
    kc, vc, _ = _cache(2, 16, 2, 32, torch.float16)
    lens = torch.tensor([3, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens.long(), backend="triton")
    with pytest.raises(ValueError, match="both k and v"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, k=kc[:, :1], backend="triton")
    with pytest.raises(ValueError, match="multiple of the number of kv heads"):
        flash_attn_with_kvcache(q[:, :, :3], kc, vc, cache_seqlens=lens, backend="triton")
    with pytest.raises(ValueError, match="block_table"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=torch.zeros(2, 1), backend="triton")
    with pytest.raises(ValueError, match="capacity"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([16, 0], dtype=torch.int32, device=DEVICE),
                                k=kc[:, :1].clone(), v=vc[:, :1].clone(), backend="triton")
    wide = torch.randn(2, 1, 4, 264, dtype=torch.float16, device=DEVICE)  # past FA2's 256 too
    with pytest.raises(ValueError, match="head dim"):
        flash_attn_with_kvcache(wide, wide[:, :, :2], wide[:, :, :2], cache_seqlens=1, backend="triton")


def test_kvcache_torch_compile_fullgraph():
    torch.manual_seed(3)
    q = torch.randn(2, 1, 4, 32, dtype=torch.float16, device=DEVICE)
    kc, vc, _ = _cache(2, 40, 2, 32, torch.float16)
    k = torch.randn(2, 1, 2, 32, dtype=torch.float16, device=DEVICE)
    lens = torch.tensor([5, 39], dtype=torch.int32, device=DEVICE)
    kc_ref, vc_ref = kc.clone(), vc.clone()

    def step(q, kc, vc, k, lens):
        return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, k=k, v=k, backend="triton") * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    out = compiled(q, kc, vc, k, lens)
    ref = step(q, kc_ref, vc_ref, k, lens)
    torch.testing.assert_close(out, ref)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref), "compiled call lost the in-place cache append"


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(32, 8), (16, 16)], ids=["gqa", "mha"])
@pytest.mark.parametrize("page_size", [None, 256])
@pytest.mark.parametrize("bsz,capacity", [(1, 32768), (8, 4096), (32, 4096)])  # the last: one 4096-key chunk
def test_gpu_decode_real_sizes(bsz, capacity, page_size, heads):
    torch.manual_seed(4)
    hq, hkv = heads
    q = torch.randn(bsz, 1, hq, 128, dtype=torch.bfloat16, device=DEVICE)
    kc, vc, table = _cache(bsz, capacity, hkv, 128, torch.bfloat16, page_size)
    seqlens = torch.randint(capacity // 2, capacity, (bsz,), dtype=torch.int32, device=DEVICE)
    k = torch.randn(bsz, 1, hkv, 128, dtype=torch.bfloat16, device=DEVICE)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, k=k, v=k, block_table=table, backend="triton")
    ref = flash_attn_with_kvcache_ref(q, kc_ref, vc_ref, cache_seqlens=seqlens, k=k, v=k, block_table=table)
    assert_close(out, ref, torch.bfloat16, name="out")
    assert torch.equal(kc, kc_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [80, 96])
def test_gpu_decode_long_chunks_padded_head_dims(d):
    """Head dims padded to a 128-wide tile take the register-prefetch loop on one 4096-key chunk a sequence."""
    torch.manual_seed(6)
    bsz, capacity = 32, 4096
    q = torch.randn(bsz, 1, 16, d, dtype=torch.bfloat16, device=DEVICE)
    chunk, _ = dec._split_plan(q, capacity, bsz * 16)
    assert dec._prefetch_next(chunk, False, d)  # the launch below takes that loop
    kc, vc, _ = _cache(bsz, capacity, 16, d, torch.bfloat16)
    seqlens = torch.randint(capacity // 2, capacity, (bsz,), dtype=torch.int32, device=DEVICE)
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, backend="triton")
    assert_close(out, flash_attn_with_kvcache_ref(q, kc, vc, cache_seqlens=seqlens), torch.bfloat16, name="out")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hkv", [8, 32], ids=["gqa", "mha"])
@pytest.mark.parametrize("bsz,capacity,page_size", [(1, 8192, None), (4, 4096, 256), (16, 512, None),
                                                     (32, 4096, None)])
def test_gpu_programmatic_dependent_launch_changes_nothing(bsz, capacity, page_size, hkv, d):
    """Under programmatic_launch() (split and merge kernels launched early, each waiting for its predecessor
    in-kernel; with the early trigger, also reading key tiles before that wait: two register tiles at head dim
    64, the pipelined loop's first stages at 128 unpaged) the output is the plain launches' bit for bit, called
    eagerly and replayed from a CUDA graph that chains several decode calls, each appending into the cache the
    next one reads (a missed wait would read stale keys)."""
    torch.manual_seed(5)
    steps = 4
    q = torch.randn(steps, bsz, 1, 32, d, dtype=torch.bfloat16, device=DEVICE)
    k = torch.randn(steps, bsz, 1, hkv, d, dtype=torch.bfloat16, device=DEVICE)
    kc0, vc0, table = _cache(bsz, capacity, hkv, d, torch.bfloat16, page_size)
    lens0 = torch.randint(capacity // 2, capacity - steps, (bsz,), dtype=torch.int32, device=DEVICE)

    def decode_steps(kc, vc):
        return torch.stack([flash_attn_with_kvcache(q[t], kc, vc, cache_seqlens=lens0 + t, k=k[t], v=k[t],
                                                    block_table=table, backend="triton") for t in range(steps)])

    results = {}
    for pdl, early_trigger in ((False, False), (True, False), (True, True)):  # the last: batch 1's mode
        with programmatic_launch(pdl, early_trigger=early_trigger):
            kc, vc = kc0.clone(), vc0.clone()
            eager = decode_steps(kc, vc)
            kc.copy_(kc0), vc.copy_(vc0)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = decode_steps(kc, vc)
        kc.copy_(kc0), vc.copy_(vc0)
        graph.replay()
        results[pdl, early_trigger] = (eager, replayed.clone(), kc.clone())
    plain = results[False, False]
    for mode in ((True, False), (True, True)):
        for want, got in zip(plain, results[mode]):
            assert torch.equal(want, got), mode
        assert torch.equal(results[mode][0], results[mode][1])
