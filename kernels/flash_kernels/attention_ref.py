"""Plain PyTorch attention: the reference of the Triton kernels (``attention``, ``attention_packed``,
``attention_decode``), what runs on the CPU, and the tests' oracle. Same semantics as the kernels (see
``attention``): bottom-right aligned masks, softcap then ALiBi, dropout on the normalised probabilities, zeros
and an lse of -inf for a row that sees no key."""

from __future__ import annotations

import torch


def _visible_ref(sq: int, sk: int, causal: bool, window: tuple[int, int], device) -> torch.Tensor:
    """(Sq, Sk) bool: which keys each query row may attend to (bottom-right aligned)."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    diag = i + sk - sq
    left, right = window
    visible = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        right = 0
    if left >= 0:
        visible &= j >= diag - left
    if right >= 0:
        visible &= j <= diag + right
    return visible


def _attention_ref(q, k, v, *, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, dropout_mask):
    """Batched reference. q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D), alibi (B, Hq) or None, dropout_mask
    (B, Hq, Sq, Sk) bool or None. Returns out (B, Sq, Hq, D) in q's dtype and lse (B, Hq, Sq) float32."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    bsz, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    qf = q.to(compute).transpose(1, 2)  # (B, Hq, Sq, D)
    kf = k.to(compute).transpose(1, 2).repeat_interleave(group, dim=1)  # (B, Hq, Sk, D)
    vf = v.to(compute).transpose(1, 2).repeat_interleave(group, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * softmax_scale  # (B, Hq, Sq, Sk)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        dist = (i + sk - sq - j).abs().to(compute)
        s = s - alibi_slopes.to(compute)[:, :, None, None] * dist
    visible = _visible_ref(sq, sk, causal, window_size, q.device)
    s = s.masked_fill(~visible, float("-inf"))
    # Softmax by hand so that fully masked rows give p = 0 with finite gradients (logsumexp would give NaN).
    if sk == 0:  # empty sequence: amax has nothing to reduce; p @ v below is then zeros of the right shape
        m = s.new_zeros(*s.shape[:-1], 1)
    else:
        m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(denom == 0, torch.ones_like(denom), denom)
    lse = (m + torch.log(denom)).squeeze(-1).detach().float()
    if dropout_p > 0.0:
        if dropout_mask is None:
            dropout_mask = torch.rand_like(p) >= dropout_p
        p = p * dropout_mask / (1.0 - dropout_p)
    out = (p @ vf).transpose(1, 2).to(q.dtype)  # (B, Sq, Hq, D)
    return out, lse


def _alibi_2d(alibi_slopes, bsz, hq):
    if alibi_slopes is None:
        return None
    return alibi_slopes.expand(bsz, hq) if alibi_slopes.dim() == 1 else alibi_slopes


def flash_attn_func_ref(
    q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
    dropout_p=0.0, dropout_mask=None, return_lse=False,
):
    """Plain PyTorch attention, in float32 (float64 for float64 inputs); differentiable through autograd.
    ``dropout_mask`` (B, Hq, Sq, Sk) bool replays a given keep mask; without one a fresh mask is drawn."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out, lse = _attention_ref(
        q, k, v, causal=causal, softmax_scale=scale, window_size=tuple(window_size), softcap=softcap,
        alibi_slopes=_alibi_2d(alibi_slopes, q.shape[0], q.shape[2]), dropout_p=dropout_p, dropout_mask=dropout_mask,
    )
    return (out, lse) if return_lse else out


def flash_attn_varlen_func_ref(
    q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, causal=False,
    softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
    dropout_mask=None, return_lse=False,
):
    """Reference for packed sequences: q (total_q, Hq, D). ``dropout_mask`` is (B, Hq, max_q, max_k) and
    sequence b uses its top-left (len_q, len_k) corner, which is how the kernel indexes its RNG."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    nseq = cu_seqlens_q.numel() - 1
    alibi = _alibi_2d(alibi_slopes, nseq, q.shape[1])
    outs, lses = [], []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(nseq):
        qb = q[cq[b]:cq[b + 1]].unsqueeze(0)
        kb, vb = k[ck[b]:ck[b + 1]].unsqueeze(0), v[ck[b]:ck[b + 1]].unsqueeze(0)
        mask = None
        if dropout_mask is not None:
            mask = dropout_mask[b:b + 1, :, : qb.shape[1], : kb.shape[1]]
        o, lse = _attention_ref(
            qb, kb, vb, causal=causal, softmax_scale=scale, window_size=tuple(window_size), softcap=softcap,
            alibi_slopes=None if alibi is None else alibi[b:b + 1], dropout_p=dropout_p, dropout_mask=mask,
        )
        outs.append(o[0])
        lses.append(lse[0])  # (Hq, len_q)
    out = torch.cat(outs, dim=0) if outs else q.new_zeros(q.shape)
    lse = torch.cat(lses, dim=1) if lses else q.new_zeros(q.shape[1], 0, dtype=torch.float32)
    return (out, lse) if return_lse else out
