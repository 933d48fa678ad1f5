"""Rotary embedding tables (cos, sin) with HF's scaling rules: default, linear, dynamic NTK, Llama-3, YaRN,
LongRoPE.

The tables are computed here (module side) and applied by ``flash_kernels.apply_rotary``. They are plain
cached tensors, not buffers: nothing to load or save, and a model built on the meta device needs no fix-up.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import RopeConfig


def _base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(cfg: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    old_len = cfg.original_max_position_embeddings or cfg.max_position_embeddings
    low_wavelen, high_wavelen = old_len / cfg.low_freq_factor, old_len / cfg.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / cfg.factor, inv_freq)
    smooth = (old_len / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
    smoothed = (1 - smooth) * scaled / cfg.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    dim, base = cfg.rotary_dim, cfg.theta
    original = cfg.original_max_position_embeddings or cfg.max_position_embeddings
    factor = cfg.factor
    if cfg.attention_factor is not None:
        attention_factor = cfg.attention_factor
    elif cfg.mscale and cfg.mscale_all_dim:
        attention_factor = _yarn_mscale(factor, cfg.mscale) / _yarn_mscale(factor, cfg.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


def _longrope_inv_freq(cfg: RopeConfig, seq_len: int) -> tuple[torch.Tensor, float]:
    """One divisor per frequency, the long ones once the sequence passes the original length, and HF's cos/sin
    scale sqrt(1 + ln(factor) / ln(original length)) unless the config gives it."""
    original = cfg.original_length
    factors = torch.tensor(cfg.long_factor if seq_len > original else cfg.short_factor, dtype=torch.float32)
    dim = cfg.rotary_dim
    inv_freq = 1.0 / (factors * cfg.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if cfg.attention_factor is not None:
        return inv_freq, cfg.attention_factor
    scale = 1.0 if cfg.factor <= 1.0 else math.sqrt(1 + math.log(cfg.factor) / math.log(original))
    return inv_freq, scale


def rope_inv_freq(cfg: RopeConfig, seq_len: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (rotary_dim // 2,) and the cos/sin scale, for sequences up to ``seq_len``."""
    inv_freq = _base_inv_freq(cfg.rotary_dim, cfg.theta)
    if cfg.rope_type == "linear":
        return inv_freq / cfg.factor, 1.0
    if cfg.rope_type == "dynamic":
        max_len = cfg.max_position_embeddings
        if seq_len > max_len:
            dim = cfg.rotary_dim
            theta = cfg.theta * ((cfg.factor * seq_len / max_len) - (cfg.factor - 1)) ** (dim / (dim - 2))
            inv_freq = _base_inv_freq(dim, theta)
        return inv_freq, 1.0
    if cfg.rope_type == "llama3":
        return _llama3_inv_freq(cfg, inv_freq), 1.0
    if cfg.rope_type == "yarn":
        return _yarn_inv_freq(cfg)
    if cfg.rope_type == "longrope":
        return _longrope_inv_freq(cfg, seq_len)
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Holds the rope config and hands out float32 (cos, sin) tables of shape (length, rotary_dim // 2)."""

    def __init__(self, cfg: RopeConfig):
        super().__init__()
        self.cfg = cfg
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables covering positions [0, seq_len). Dynamic NTK frequencies depend on ``seq_len`` itself, LongRoPE's
        on whether it passes the original length."""
        cfg = self.cfg
        if cfg.rope_type == "dynamic" and seq_len > cfg.max_position_embeddings:
            key = (str(device), seq_len)
            length = seq_len
        else:
            # One table for every length up to the model's limit (grown in powers of two past it).
            length = max(cfg.max_position_embeddings, 1 << max(seq_len - 1, 0).bit_length())
            key = (str(device), "long" if cfg.length_dependent(seq_len) else "static")
        cached = self._cache.get(key)
        if cached is not None and cached[0].shape[0] >= seq_len:
            return cached  # else a shorter table made for an earlier, shorter call: replaced by a longer one
        # Never inference tensors, though generate (under torch.inference_mode) may be what grows them: a later
        # training forward reads the same tables, and its rotary saves them for the backward.
        with torch.inference_mode(False):
            inv_freq, scale = rope_inv_freq(cfg, max(seq_len, 1))
            positions = torch.arange(length, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq)  # (length, rotary_dim // 2)
            cos, sin = (freqs.cos() * scale).to(device), (freqs.sin() * scale).to(device)
        self._cache[key] = (cos, sin)
        return cos, sin

    def extra_repr(self) -> str:
        return f"rotary_dim={self.cfg.rotary_dim}, theta={self.cfg.theta}, rope_type={self.cfg.rope_type}"
