"""The FlashAttention-2 names keep FlashAttention-2's promises: signatures and defaults, any head dim up to 256,
the decode path's arguments (rotary, cache_batch_idx, cache_leftpad, return_softmax_lse, ALiBi, num_splits),
paged prefill, and cache bounds. Triton runs under the CPU interpreter in CI (small odd shapes); the oracle is
written here in plain PyTorch from FA2's documented semantics."""

import inspect
import os
import subprocess
import sys

import pytest
import torch

import flash_kernels
from flash_kernels import (
    flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func, flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from flash_kernels._testing import assert_close
from flash_kernels.attention import flash_attn_func_ref
from flash_kernels.rotary import apply_rotary_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["reference", "triton"]

# FA2's public signatures (flash_attn/flash_attn_interface.py): parameter names in order, with defaults.
_NO = inspect.Parameter.empty
_ATTN_TAIL = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
              ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
FA2_SIGNATURES = {
    flash_attn_func: [("q", _NO), ("k", _NO), ("v", _NO), *_ATTN_TAIL],
    flash_attn_qkvpacked_func: [("qkv", _NO), *_ATTN_TAIL],
    flash_attn_varlen_func: [("q", _NO), ("k", _NO), ("v", _NO), ("cu_seqlens_q", _NO), ("cu_seqlens_k", _NO),
                             ("max_seqlen_q", _NO), ("max_seqlen_k", _NO), *_ATTN_TAIL, ("block_table", None)],
    flash_attn_varlen_qkvpacked_func: [("qkv", _NO), ("cu_seqlens", _NO), ("max_seqlen", _NO), *_ATTN_TAIL],
    flash_attn_with_kvcache: [
        ("q", _NO), ("k_cache", _NO), ("v_cache", _NO), ("k", None), ("v", None), ("rotary_cos", None),
        ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None), ("cache_leftpad", None),
        ("block_table", None), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
        ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None), ("num_splits", 0),
        ("return_softmax_lse", False)],
}


@pytest.mark.parametrize("fn", list(FA2_SIGNATURES), ids=lambda f: f.__name__)
def test_signature_is_fa2s(fn):
    """FA2's positional parameters, in FA2's order, with FA2's defaults; our extras are keyword-only after them."""
    params = list(inspect.signature(fn).parameters.values())
    positional = [(p.name, p.default) for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == FA2_SIGNATURES[fn]
    assert all(p.kind == p.KEYWORD_ONLY for p in params[len(positional):])


def _rand(*shape, dtype=torch.float16):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
def test_positional_call_and_attn_probs_as_fa2(backend):
    """FA2 call sites work unchanged: positional dropout_p, softmax_scale, causal; return_attn_probs gives
    (out, lse, an empty tensor) without dropout, as FA2 does, and names itself with dropout."""
    torch.manual_seed(0)
    q, k, v = _rand(2, 5, 2, 32), _rand(2, 7, 1, 32), _rand(2, 7, 1, 32)
    out, lse, probs = flash_attn_func(q, k, v, 0.0, 0.3, True, return_attn_probs=True, backend=backend)
    ref, ref_lse = flash_attn_func_ref(q, k, v, causal=True, softmax_scale=0.3, return_lse=True)
    assert_close(out, ref, torch.float16, name="out")
    assert_close(lse, ref_lse, torch.float32, scale=10, name="lse")
    assert probs.numel() == 0
    with pytest.raises(ValueError, match="return_attn_probs"):
        flash_attn_func(q, k, v, 0.1, return_attn_probs=True, backend=backend)
    qkv = _rand(1, 6, 3, 2, 32)
    out, lse, _ = flash_attn_qkvpacked_func(qkv, 0.0, None, True, return_attn_probs=True, backend=backend)
    assert lse.shape == (1, 2, 6)
    assert_close(out, flash_attn_func_ref(*qkv.unbind(2), causal=True), torch.float16, name="packed")


@pytest.mark.parametrize("backend", BACKENDS)
def test_kvcache_is_not_causal_by_default(backend):
    """FA2's flash_attn_with_kvcache defaults to causal=False: with several query rows, every row sees every
    cached key."""
    torch.manual_seed(1)
    q, kc, vc = _rand(2, 3, 2, 32), _rand(2, 9, 2, 32), _rand(2, 9, 2, 32)
    lens = torch.tensor([9, 5], dtype=torch.int32, device=DEVICE)
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, backend=backend)
    for b, n in enumerate(lens.tolist()):
        ref = flash_attn_func_ref(q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], causal=False)
        assert_close(out[b:b + 1], ref, torch.float16, name=f"row {b}")


# ---- head dims FA2 takes that are not powers of two or our old list -----------------------------------------


@pytest.mark.parametrize("d", [40, 59, 111])
def test_any_head_dim_runs_on_the_kernels(d):
    """Forward and backward at head dims outside 32/64/80/96/128/192/256, on the Triton kernels, with the default
    scale 1/sqrt(d) of the real head dim. An explicit ``backend="triton"`` raises for an input the kernels do not
    take, the same rule by which ``auto`` takes the kernels on a GPU: running is the proof nothing is unsupported."""
    torch.manual_seed(d)
    q = _rand(1, 9, 2, d).requires_grad_()
    k, v = _rand(1, 13, 1, d).requires_grad_(), _rand(1, 13, 1, d).requires_grad_()
    out = flash_attn_func(q, k, v, causal=True, backend="triton")
    ref = flash_attn_func_ref(q, k, v, causal=True)
    assert_close(out, ref, torch.float16, name="out")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert_close(g, r, torch.float16, scale=2.0, name=f"d{name}")


def test_any_head_dim_varlen_packed_and_decode():
    torch.manual_seed(3)
    d = 24  # under tl.dot's 16-wide minimum tile once rounded down, and not a power of two
    cu = torch.tensor([0, 4, 11], dtype=torch.int32, device=DEVICE)
    qkv = _rand(11, 3, 2, d)
    out = flash_attn_varlen_qkvpacked_func(qkv, cu, 7, causal=True, backend="triton")
    ref = flash_attn_varlen_qkvpacked_func(qkv, cu, 7, causal=True, backend="reference")
    assert_close(out, ref, torch.float16, name="varlen packed")
    q, kc, vc = _rand(2, 1, 4, 59), _rand(2, 20, 2, 59), _rand(2, 20, 2, 59)
    lens = torch.tensor([20, 7], dtype=torch.int32, device=DEVICE)
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, backend="triton")
    assert_close(out, flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, backend="reference"), torch.float16,
                 name="decode")


# ---- the decode path's FA2 arguments --------------------------------------------------------------------------


def _oracle(q, k_cache, v_cache, k, v, *, cos, sin, lens, batch_idx, leftpad, causal, window, interleaved, alibi):
    """FA2's flash_attn_with_kvcache, spelled out: (out, lse, caches after the append)."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    bsz, sq = q.shape[:2]
    outs, lses = [], []
    for b in range(bsz):
        row, n = int(batch_idx[b]), int(lens[b])
        qb, kb = q[b:b + 1], k[b:b + 1]
        if cos is not None:
            kb = apply_rotary_ref(kb, cos, sin, interleaved=interleaved, seqlen_offsets=n)
            q_pos = torch.arange(n, n + sq) if causal or window != (-1, -1) else torch.full((sq,), n)
            qb = apply_rotary_ref(qb, cos, sin, interleaved=interleaved, position_ids=q_pos[None].to(DEVICE))
        k_cache[row, n:n + k.shape[1]] = kb[0]
        v_cache[row, n:n + k.shape[1]] = v[b]
        start, end = int(leftpad[b]), n + k.shape[1]
        o, lse = flash_attn_func_ref(qb, k_cache[row:row + 1, start:end], v_cache[row:row + 1, start:end],
                                     causal=causal, window_size=window, return_lse=True,
                                     alibi_slopes=None if alibi is None else alibi[b:b + 1])
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses), k_cache, v_cache


# (Sq, S_new, rotary_dim, interleaved, causal, window, batch_idx, leftpad, alibi, num_splits)
KV_CASES = [
    (1, 1, 32, True, False, (-1, -1), False, False, False, 0),
    (2, 2, 16, False, True, (-1, -1), True, True, False, 0),   # partial rotary, GPT-NeoX halves
    (3, 1, 32, True, False, (-1, -1), True, False, True, 3),   # q rows all at position cache_seqlens
    (2, 2, 0, True, True, (4, -1), False, True, True, 1),       # no rotary, a window, one split
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", KV_CASES, ids=lambda c: "-".join(map(str, c)))
def test_kvcache_fa2_arguments(case, backend):
    _check_kvcache_case(case, backend)


@pytest.mark.parametrize("mode", ["prefetch2", "inloop"])
@pytest.mark.parametrize("case", KV_CASES[1:3], ids=lambda c: "-".join(map(str, c)))
def test_kvcache_fa2_arguments_reading_ahead(case, mode, monkeypatch):
    """ALiBi and cache_leftpad where the split kernel reads keys before its wait (programmatic launch's early
    trigger): two register tiles, or the wait inside the key loop."""
    dec = flash_kernels.attention_decode
    monkeypatch.setattr(dec, "_prefetch_kv", lambda device: True)
    chosen = dec.PREFETCH_REGISTERS if mode == "prefetch2" else dec.WAIT_IN_LOOP
    monkeypatch.setattr(dec, "_prefetch_mode", lambda block_d, paged, prefetch_next: chosen)
    monkeypatch.setattr(dec, "_prefetch_tiles", lambda block_d: 2)
    _check_kvcache_case(case, "triton")


def _check_kvcache_case(case, backend):
    sq, s_new, rotary_dim, interleaved, causal, window, use_idx, use_leftpad, use_alibi, splits = case
    torch.manual_seed(7)
    bsz, hq, hkv, d, cache_len, cache_rows = 3, 4, 2, 32, 37, 5
    q, k, v = _rand(bsz, sq, hq, d), _rand(bsz, s_new, hkv, d), _rand(bsz, s_new, hkv, d)
    rows = cache_rows if use_idx else bsz
    kc, vc = _rand(rows, cache_len, hkv, d), _rand(rows, cache_len, hkv, d)
    lens = torch.tensor([cache_len - s_new, 9, 0], dtype=torch.int32, device=DEVICE)
    batch_idx = torch.tensor([4, 0, 2] if use_idx else [0, 1, 2], dtype=torch.int32, device=DEVICE)
    leftpad = torch.tensor([20, 9, 0] if use_leftpad else [0, 0, 0], dtype=torch.int32, device=DEVICE)
    angles = torch.rand(cache_len, rotary_dim // 2, device=DEVICE) * 6.3 if rotary_dim else None
    cos, sin = (angles.cos().half(), angles.sin().half()) if rotary_dim else (None, None)
    alibi = torch.rand(bsz, hq, device=DEVICE) * 0.3 if use_alibi else None
    ref, ref_lse, ref_kc, ref_vc = _oracle(q, kc, vc, k, v, cos=cos, sin=sin, lens=lens, batch_idx=batch_idx,
                                           leftpad=leftpad, causal=causal, window=window, interleaved=interleaved,
                                           alibi=alibi)
    out, lse = flash_attn_with_kvcache(
        q, kc, vc, k, v, cos, sin, lens, batch_idx if use_idx else None, leftpad if use_leftpad else None,
        causal=causal, window_size=window, rotary_interleaved=interleaved, alibi_slopes=alibi, num_splits=splits,
        return_softmax_lse=True, backend=backend)
    assert_close(out, ref, torch.float16, name="out")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert_close(lse[finite], ref_lse[finite], torch.float32, scale=10, name="lse")
    assert_close(kc, ref_kc, torch.float16, name="k cache")  # the rotated keys are what the cache keeps
    assert torch.equal(vc, ref_vc)


def test_kvcache_argument_errors_name_the_argument():
    q, kc = _rand(2, 1, 2, 32), _rand(2, 8, 2, 32)
    lens = torch.tensor([3, 4], dtype=torch.int32, device=DEVICE)
    cos = torch.ones(8, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="rotary_cos/rotary_sin rotate the new keys"):
        flash_attn_with_kvcache(q, kc, kc, rotary_cos=cos, rotary_sin=cos, cache_seqlens=lens)
    with pytest.raises(ValueError, match="cache_batch_idx"):
        flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens, cache_batch_idx=lens.long())
    with pytest.raises(ValueError, match="cache_batch_idx with a paged cache"):
        flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens, cache_batch_idx=lens, block_table=lens[:, None])
    with pytest.raises(ValueError, match="cache_leftpad must be in"):
        flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens, cache_leftpad=lens + 1)
    with pytest.raises(ValueError, match="pages \\(rows\\) outside"):
        flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens, cache_batch_idx=torch.tensor(
            [0, 2], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="num_splits"):
        flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens, num_splits=-1)


# ---- cache bounds ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_lengths_past_the_cache_raise_without_an_append(backend):
    """FA2 refuses cache_seqlens beyond what the block table (or the cache) holds, appending or not."""
    q = _rand(2, 1, 2, 32)
    pool = _rand(9, 16, 2, 32)
    table = torch.tensor([[3, 5], [0, 8]], dtype=torch.int32, device=DEVICE)  # 32 keys a row
    with pytest.raises(ValueError, match="capacity 32 \\(2 pages of 16"):
        flash_attn_with_kvcache(q, pool, pool, cache_seqlens=torch.tensor([33, 4], dtype=torch.int32, device=DEVICE),
                                block_table=table, backend=backend)
    with pytest.raises(ValueError, match="names pages"):
        flash_attn_with_kvcache(q, pool, pool, cache_seqlens=torch.tensor([20, 4], dtype=torch.int32, device=DEVICE),
                                block_table=torch.tensor([[3, 9], [0, 8]], dtype=torch.int32, device=DEVICE),
                                backend=backend)
    kc = _rand(2, 16, 2, 32)
    with pytest.raises(ValueError, match="capacity 16"):
        flash_attn_with_kvcache(q, kc, kc, cache_seqlens=torch.tensor([17, 0], dtype=torch.int32, device=DEVICE),
                                backend=backend)
    with pytest.raises(ValueError, match=">= 0"):
        flash_attn_with_kvcache(q, kc, kc, cache_seqlens=torch.tensor([-1, 0], dtype=torch.int32, device=DEVICE),
                                backend=backend)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kernel_never_reads_past_the_cache(paged):
    """Lengths the host cannot check (a CUDA graph's capture) read no key past the capacity, here a capacity of
    40 keys that no split chunk divides: what lies past it (NaN keys, a page id far outside the pool) would show
    in the output. The kernel attends over the first 40 keys."""
    dec = flash_kernels.attention_decode
    torch.manual_seed(4)
    q = _rand(2, 1, 2, 32)
    if paged:
        pool = _rand(12, 8, 2, 32)
        wide_table = torch.tensor([[7, 2, 9, 0, 4, 10**6], [1, 3, 5, 6, 8, 10**6]], dtype=torch.int32, device=DEVICE)
        table, kc, vc = wide_table[:, :5], pool, pool.clone()
        dense = [pool[table[b].long()].reshape(1, 40, 2, 32) for b in range(2)]
        dense_v = [vc[table[b].long()].reshape(1, 40, 2, 32) for b in range(2)]
    else:
        wide = _rand(2, 48, 2, 32)
        wide[:, 40:] = float("nan")
        kc, vc, table = wide[:, :40], wide[:, :40].clone(), None
        dense, dense_v = [kc[b:b + 1] for b in range(2)], [vc[b:b + 1] for b in range(2)]
    lens = torch.tensor([45, 40], dtype=torch.int32, device=DEVICE)  # past the capacity, unchecked
    out, _ = dec._kvcache_impl(q, kc, vc, lens, None, None, table, None, None, False, 32 ** -0.5, -1, -1, 0.0)
    for b in range(2):
        ref = flash_attn_func_ref(q[b:b + 1], dense[b], dense_v[b])
        assert_close(out[b:b + 1], ref, torch.float16, name=f"row {b}")


def _skip_foreign_pages_oracle(q, pool_k, pool_v, table, lens, causal):
    """Attention over each row's first lens[b] keys, leaving out the keys on a page id outside the pool (what the
    kernel promises when no host check ran): float32, (out, lse); a row with no key left gives zeros and -inf."""
    n_pages, page = pool_k.shape[:2]
    sq, hq = q.shape[1], q.shape[2]
    outs, lses = [], []
    for b, length in enumerate(lens.tolist()):
        pos = torch.arange(length, device=q.device)
        ids = table[b].long()[pos // page]
        inside = (ids >= 0) & (ids < n_pages)
        keys = pool_k[ids.clamp(0, n_pages - 1), pos % page].float()  # (L, Hkv, D)
        values = pool_v[ids.clamp(0, n_pages - 1), pos % page].float()
        group = hq // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("shd,lhd->hsl", q[b].float(), keys) * q.shape[-1] ** -0.5
        visible = inside[None, :].expand(sq, length)
        if causal:
            visible = visible & (pos[None, :] <= torch.arange(sq, device=q.device)[:, None] + length - sq)
        scores = scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # (Hq, Sq)
        probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
        outs.append(torch.einsum("hsl,lhd->shd", probs, values))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def _foreign_page_modes(mode, monkeypatch):
    """The split kernel's paths: the planned splits and merge, one split, the first tiles read ahead of the wait
    (two register tiles, or the wait in the key loop), and the register-prefetch key loop."""
    dec = flash_kernels.attention_decode
    if mode == "single":
        monkeypatch.setattr(dec, "_split_plan", lambda q, capacity, n_prog_other, num_splits=0: (capacity, 1))
    monkeypatch.setattr(dec, "_prefetch_kv", lambda device: mode in ("prefetch2", "inloop"))
    monkeypatch.setattr(dec, "_prefetch_next", lambda chunk, paged, head_dim: mode == "next")
    chosen = dec.WAIT_IN_LOOP if mode == "inloop" else dec.PREFETCH_REGISTERS
    monkeypatch.setattr(dec, "_prefetch_mode", lambda block_d, paged, prefetch_next: chosen)
    monkeypatch.setattr(dec, "_prefetch_tiles", lambda block_d: 2)


@pytest.mark.parametrize("mode", ["planned", "single", "prefetch2", "inloop", "next"])
def test_kernel_skips_pages_outside_the_pool(mode, monkeypatch):
    """A block table no host check saw (a CUDA graph's replay runs only the kernels: here the launcher is called
    past the checks) with page ids outside the pool (negative, the pool size, far past it): the kernel reads
    nothing outside the pool, leaves those pages' keys out of the softmax and appends nothing there. Row 0 mixes
    valid and foreign pages (a 16-key tile spans two 8-key pages), row 1 is all valid, row 2 all foreign (zeros,
    lse -inf). Foreign keys would show: the pool's spare pages hold NaN."""
    _foreign_page_modes(mode, monkeypatch)
    dec = flash_kernels.attention_decode
    torch.manual_seed(11)
    page, hkv, hq, d, sq = 8, 2, 4, 32, 2
    pool_k, pool_v = _rand(9, page, hkv, d), _rand(9, page, hkv, d)
    pool_k[7:], pool_v[7:] = float("nan"), float("nan")  # pages no row owns
    n_pages = 7
    pool_k, pool_v = pool_k[:n_pages], pool_v[:n_pages]  # the pool: what lies past it is NaN
    table = torch.tensor([[2, -1, 5, n_pages, 10**6], [0, 1, 3, 4, 6], [-5, n_pages, 8, -(2**31), 2**31 - 1]],
                         dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([33, 38, 18], dtype=torch.int32, device=DEVICE)
    q, k, v = _rand(3, sq, hq, d), _rand(3, 2, hkv, d), _rand(3, 2, hkv, d)
    ref_k, ref_v = pool_k.clone(), pool_v.clone()
    ref_k[6, 6:], ref_v[6, 6:] = k[1], v[1]  # only row 1 appends to a page of the pool (slots 38, 39: page 6)
    ref, ref_lse = _skip_foreign_pages_oracle(q, ref_k, ref_v, table, lens + 2, causal=True)
    out, lse = dec._kvcache_impl(q, pool_k, pool_v, lens, k, v, table, None, None, True, d ** -0.5, -1, -1, 0.0,
                                 return_lse=True)
    assert torch.equal(pool_k, ref_k) and torch.equal(pool_v, ref_v), "an append wrote to a foreign page"
    assert_close(out, ref.to(out.dtype), torch.float16, name="out")
    assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.isneginf(lse[2]).all()
    assert_close(lse[:2], ref_lse[:2], torch.float32, scale=10, name="lse")


def test_kernel_skips_cache_rows_outside_the_cache():
    """cache_batch_idx read by the kernel alone (no host check): a row index outside the cache reads and writes
    nothing, and that batch row sees no key; cache_leftpad past the length or negative reads nothing outside."""
    dec = flash_kernels.attention_decode
    torch.manual_seed(12)
    kc, vc = _rand(3, 24, 2, 32), _rand(3, 24, 2, 32)
    q, k, v = _rand(3, 1, 2, 32), _rand(3, 1, 2, 32), _rand(3, 1, 2, 32)
    idx = torch.tensor([2, 3, -1], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([10, 5, 7], dtype=torch.int32, device=DEVICE)
    ref_k, ref_v = kc.clone(), vc.clone()
    ref_k[2, 10], ref_v[2, 10] = k[0, 0], v[0, 0]
    out = dec._kvcache_impl(q, kc, vc, lens, k, v, idx[:, None], None, None, False, 32 ** -0.5, -1, -1, 0.0)[0]
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
    assert_close(out[:1], flash_attn_func_ref(q[:1], ref_k[2:3, :11], ref_v[2:3, :11]), torch.float16, name="row 0")
    assert torch.equal(out[1:], torch.zeros_like(out[1:]))
    leftpad = torch.tensor([-4, 30, 3], dtype=torch.int32, device=DEVICE)
    kc3, vc3 = kc[:3], vc[:3]
    out = dec._kvcache_impl(q, kc3, vc3, lens, None, None, None, leftpad, None, False, 32 ** -0.5, -1, -1, 0.0)[0]
    assert_close(out[0:1], flash_attn_func_ref(q[:1], kc[:1, :10], vc[:1, :10]), torch.float16, name="negative")
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # leftpad past the length: no key
    assert_close(out[2:], flash_attn_func_ref(q[2:], kc[2:, 3:7], vc[2:, 3:7]), torch.float16, name="leftpad")


# ---- paged prefill --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_paged_prefill(backend):
    """flash_attn_varlen_func with block_table: k/v are paged caches, sequence b's keys the first
    cu_seqlens_k[b+1] - cu_seqlens_k[b] entries of its pages; equals the packed contiguous call."""
    torch.manual_seed(5)
    page, hkv, d = 4, 1, 32
    lens_k = [6, 0, 11]
    pool_k, pool_v = _rand(10, page, hkv, d), _rand(10, page, hkv, d)
    table = torch.tensor([[9, 2, 0], [1, 1, 1], [4, 7, 3]], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 6, 6, 17], dtype=torch.int32, device=DEVICE)
    cu_q = torch.tensor([0, 3, 4, 9], dtype=torch.int32, device=DEVICE)
    q = _rand(9, 2, d)
    k = torch.cat([pool_k[table[b].long()].reshape(-1, hkv, d)[:n] for b, n in enumerate(lens_k)])
    v = torch.cat([pool_v[table[b].long()].reshape(-1, hkv, d)[:n] for b, n in enumerate(lens_k)])
    out = flash_attn_varlen_func(q, pool_k, pool_v, cu_q, cu_k, 5, 11, causal=True, block_table=table, backend=backend)
    ref = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 11, causal=True, backend="reference")
    assert_close(out, ref, torch.float16, name="out")
    with pytest.raises(ValueError, match="exceed what block_table holds"):
        flash_attn_varlen_func(q, pool_k, pool_v, cu_q, cu_k, 5, 11, block_table=table[:, :2], backend=backend)
    table[2, 1] = 10  # one past the pool, in use by sequence 2
    with pytest.raises(ValueError, match="page ids outside"):
        flash_attn_varlen_func(q, pool_k, pool_v, cu_q, cu_k, 5, 11, block_table=table, backend=backend)


# ---- real sizes (the lead's H200 run) -------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("d", [40, 59, 111, 160, 224])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_any_head_dim_real_sizes(d, causal):
    """``auto`` runs FA2's odd head dims on our kernels at real sizes, forward and backward, and decode."""
    torch.manual_seed(d)
    q = _rand(2, 1000, 8, d, dtype=torch.bfloat16).requires_grad_()
    k, v = (_rand(2, 1000, 2, d, dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    out = flash_attn_func(q, k, v, causal=causal)
    ref = flash_attn_func_ref(q, k, v, causal=causal)
    assert_close(out, ref, torch.bfloat16, name="out")
    dout = torch.randn_like(out)
    for name, g, r in zip("qkv", torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        assert_close(g, r, torch.bfloat16, scale=2.0, name=f"d{name}")
    kc, vc = _rand(4, 4096, 2, d, dtype=torch.bfloat16), _rand(4, 4096, 2, d, dtype=torch.bfloat16)
    lens = torch.tensor([4096, 17, 3000, 1], dtype=torch.int32, device=DEVICE)
    qd = _rand(4, 1, 8, d, dtype=torch.bfloat16)
    assert_close(flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens),
                 flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, backend="reference"), torch.bfloat16,
                 name="decode")


@pytest.mark.gpu
def test_gpu_kvcache_fa2_arguments_real_sizes():
    """Rotary, cache_batch_idx, cache_leftpad, ALiBi and the lse at a real decode size, Triton vs reference."""
    torch.manual_seed(8)
    bsz, hq, hkv, d, cache_len = 8, 32, 8, 128, 8192
    kc, vc = _rand(12, cache_len, hkv, d, dtype=torch.bfloat16), _rand(12, cache_len, hkv, d, dtype=torch.bfloat16)
    q, k = _rand(bsz, 1, hq, d, dtype=torch.bfloat16), _rand(bsz, 1, hkv, d, dtype=torch.bfloat16)
    lens = torch.randint(100, cache_len - 1, (bsz,), dtype=torch.int32, device=DEVICE)
    leftpad = (lens * torch.rand(bsz, device=DEVICE)).int()
    idx = torch.randperm(12, device=DEVICE)[:bsz].int()
    angles = torch.rand(cache_len, d // 2, device=DEVICE) * 6.3
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    alibi = torch.rand(hq, device=DEVICE) * 0.01
    kw = dict(cache_seqlens=lens, cache_batch_idx=idx, cache_leftpad=leftpad, rotary_cos=cos, rotary_sin=sin,
              alibi_slopes=alibi, return_softmax_lse=True)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, k, **kw)
    ref, ref_lse = flash_attn_with_kvcache(q, kc_ref, vc_ref, k, k, **kw, backend="reference")
    assert_close(out, ref, torch.bfloat16, name="out")
    assert_close(lse, ref_lse, torch.float32, scale=100, name="lse")


_DEVICE_ASSERT = """
import torch
from flash_kernels import flash_attn_with_kvcache
q = torch.randn(2, 1, 2, 64, dtype=torch.float16, device="cuda")
pool = torch.randn(9, 16, 2, 64, dtype=torch.float16, device="cuda")
table = torch.tensor([[3, 5], [0, 8]], dtype=torch.int32, device="cuda")
lens = torch.tensor([33, 4], dtype=torch.int32, device="cuda")
flash_attn_with_kvcache(q, pool, pool, cache_seqlens=lens, block_table=table)
torch.cuda.synchronize()
"""


@pytest.mark.gpu
def test_gpu_lengths_past_the_cache_assert_on_the_device():
    """On CUDA the lengths are checked by a device assert, no host sync (in a child process: the assert ends
    its CUDA context)."""
    done = subprocess.run([sys.executable, "-c", _DEVICE_ASSERT], capture_output=True, text=True, timeout=300,
                          env=os.environ)
    assert done.returncode != 0, done.stdout
    assert "assert" in done.stderr.lower(), done.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_gpu_graph_replay_with_lengths_past_the_cache(paged):
    """A CUDA graph captured with valid lengths, replayed after they grew past the cache: nothing is checked
    (a capture cannot), and the kernel still attends over the capacity only, reading nothing past it."""
    torch.manual_seed(9)
    capacity, d = 1000, 128
    q = _rand(4, 1, 16, d, dtype=torch.bfloat16)
    if paged:
        pool = _rand(40, 100, 4, d, dtype=torch.bfloat16)
        table = torch.randperm(40, device=DEVICE)[:40].reshape(4, 10).int()
        kc, vc = pool, pool
    else:
        kc, vc, table = _rand(4, capacity, 4, d, dtype=torch.bfloat16), _rand(4, capacity, 4, d, dtype=torch.bfloat16), None
    lens = torch.full((4,), 500, dtype=torch.int32, device=DEVICE)
    flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table)  # warm-up: compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table)
    lens.fill_(capacity + 300)
    graph.replay()
    torch.cuda.synchronize()
    full = torch.full_like(lens, capacity)
    assert_close(out, flash_attn_with_kvcache(q, kc, vc, cache_seqlens=full, block_table=table, backend="reference"),
                 torch.bfloat16, name="out")


@pytest.mark.gpu
def test_gpu_graph_replay_with_pages_outside_the_pool():
    """A CUDA graph captured with a valid block table (and an append), replayed after some page ids left the pool
    (negative, the pool size, far past it): the replay checks nothing, and the kernels read and write nothing
    outside the pool; the foreign pages' keys are left out (row 2 has none left: zeros). The pool's neighbours
    hold NaN, so a stray read would show."""
    torch.manual_seed(10)
    page, n_pages, hkv, hq, d = 64, 40, 4, 16, 128
    storage_k = _rand(n_pages + 8, page, hkv, d, dtype=torch.bfloat16)
    storage_v = _rand(n_pages + 8, page, hkv, d, dtype=torch.bfloat16)
    storage_k[n_pages:], storage_v[n_pages:] = float("nan"), float("nan")
    pool_k, pool_v = storage_k[:n_pages], storage_v[:n_pages]
    table = torch.randperm(n_pages, device=DEVICE)[:36].reshape(3, 12).int()
    lens = torch.tensor([700, 500, 300], dtype=torch.int32, device=DEVICE)
    q, k, v = _rand(3, 1, hq, d, dtype=torch.bfloat16), _rand(3, 1, hkv, d, dtype=torch.bfloat16), _rand(
        3, 1, hkv, d, dtype=torch.bfloat16)
    kw = dict(k=k, v=v, cache_seqlens=lens, block_table=table, return_softmax_lse=True)
    flash_attn_with_kvcache(q, pool_k, pool_v, **kw)  # warm-up: compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flash_attn_with_kvcache(q, pool_k, pool_v, **kw)
    table[0, 3], table[0, 10] = -1, n_pages  # row 0: two foreign pages, one of them where it appends
    table[2] = torch.tensor([10**6, -(2**31), 2**31 - 1, n_pages + 1] * 3, dtype=torch.int32)
    ref_k, ref_v = pool_k.clone(), pool_v.clone()
    ref_k[table[1, 500 // page], 500 % page], ref_v[table[1, 500 // page], 500 % page] = k[1, 0], v[1, 0]
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(pool_k, ref_k) and torch.equal(pool_v, ref_v), "the append wrote outside row 1's pages"
    ref, ref_lse = _skip_foreign_pages_oracle(q, pool_k, pool_v, table, lens + 1, causal=False)
    assert_close(out, ref.to(out.dtype), torch.bfloat16, name="out")
    assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.isneginf(lse[2]).all()
    assert_close(lse[:2], ref_lse[:2], torch.float32, scale=100, name="lse")
