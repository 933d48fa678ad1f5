"""Helpers for parity tests against HF transformers, shared by the model tests (and usable by users who
port a family): random HF models with non-trivial weights, our twin of an HF model, error bounds."""

from __future__ import annotations

import torch
import transformers

from .checkpoint.loader import build_model
from .checkpoint.remap import hf_to_ours
from .checkpoint.rules import rules_for


def randomize_(model: torch.nn.Module, *, seed: int = 0, std: float = 0.05) -> torch.nn.Module:
    """Fill every parameter with fresh random values: matrices N(0, std); vectors (norm weights, biases)
    around their init with spread 0.2, so a norm weight of exactly 1 or a zero bias cannot hide a bug."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if param.dim() == 1:
                param.add_((0.2 * noise).to(param.dtype))
            else:
                param.copy_((std * noise).to(param.dtype))
    return model


def random_hf_model(hf_config, *, seed: int = 0, auto_class: str = "AutoModelForCausalLM", attn_implementation: str = "sdpa"):
    """An HF model of ``hf_config`` in eval mode with randomized weights, using SDPA attention (or the given
    implementation, for models without SDPA such as GPT-J)."""
    torch.manual_seed(seed)
    hf_config._attn_implementation = attn_implementation
    model = getattr(transformers, auto_class).from_config(hf_config, attn_implementation=attn_implementation)
    return randomize_(model, seed=seed).eval()


def ours_from_hf(hf_model, *, attn_impl: str = "auto", kernel_backend: str = "auto", dtype=torch.float32):
    """Our model with the HF model's weights, converted in memory through the family's rules."""
    model = build_model(hf_model.config, attn_impl=attn_impl, kernel_backend=kernel_backend, device="cpu")
    model.load_state_dict(hf_to_ours(hf_model.state_dict(), rules_for(model.config)), strict=True)
    return model.to(dtype).eval()


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|, in float64."""
    out, ref = out.detach().double(), ref.detach().double()
    return ((out - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()


def low_precision_bound_ok(ours_lp: torch.Tensor, hf_lp: torch.Tensor, hf_fp32: torch.Tensor, *, k: float = 2.0, atol: float = 1e-3) -> tuple[bool, float, float]:
    """DESIGN.md's rule: err(ours_lp, hf_fp32) <= k * err(hf_lp, hf_fp32) + atol (mean abs error)."""
    ours_err = (ours_lp.double() - hf_fp32.double()).abs().mean().item()
    hf_err = (hf_lp.double() - hf_fp32.double()).abs().mean().item()
    return ours_err <= k * hf_err + atol, ours_err, hf_err


# --------------------------------------------------------------------------------------------------------
# Checks every family's tests share (each raises AssertionError with the offending key or error).

def hf_tied_keys(hf_model) -> set[str]:
    """Keys HF ties to another parameter, which we store once: with tied embeddings the LM head and what the
    class lists in ``_tied_weights_keys``; always a decoder bias tied to a head bias (BERT's MLM head)."""
    listed = set(getattr(hf_model, "_tied_weights_keys", None) or {})
    if hf_model.config.to_dict().get("tie_word_embeddings", False):
        return listed | {"lm_head.weight"}
    return {k for k in listed if k.endswith("decoder.bias")}


def assert_round_trip_bit_identical(hf_model) -> None:
    """``to_hf(from_hf(sd))`` gives back exactly HF's state dict (tied copies aside)."""
    from .checkpoint.remap import ours_to_hf

    tied = hf_tied_keys(hf_model)
    hf_state = {k: v for k, v in hf_model.state_dict().items() if k not in tied}
    rules = rules_for(build_model(hf_model.config, device="meta").config)
    back = ours_to_hf(hf_to_ours(hf_state, rules), rules)
    assert back.keys() == hf_state.keys(), sorted(set(back) ^ set(hf_state))
    for key, tensor in hf_state.items():
        assert torch.equal(back[key], tensor), key


def assert_meta_keys_match_hf(hf_config, *, auto_class: str) -> None:
    """Our model on the meta device, mapped to HF names, has exactly HF's keys and shapes."""
    from .checkpoint.remap import ours_to_hf

    with torch.device("meta"):
        hf = getattr(transformers, auto_class).from_config(hf_config)
    tied = hf_tied_keys(hf)
    ours = build_model(hf_config, device="meta")
    expected = {k: tuple(v.shape) for k, v in hf.state_dict().items() if k not in tied}
    got = {k: tuple(v.shape) for k, v in ours_to_hf(ours.state_dict(), rules_for(ours.config)).items()}
    assert got == expected, sorted(set(got.items()) ^ set(expected.items()))[:10]


def assert_padded_rows_equal_alone(model, vocab_size: int, *, side: str, seed: int = 0, tol: float = 1e-5) -> None:
    """A left- or right-padded batch gives, on each row's real tokens, the logits of that row run alone."""
    gen = torch.Generator().manual_seed(seed)
    lengths = (13, 6, 1)
    S = max(lengths)
    ids = torch.randint(0, vocab_size, (len(lengths), S), generator=gen)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        real = slice(S - n, S) if side == "left" else slice(0, n)
        mask[row, real] = 1
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).logits
        assert torch.isfinite(padded).all(), "padded positions must not produce NaN"
        for row in range(len(lengths)):
            real = mask[row].bool()
            alone = model(ids[row:row + 1, real]).logits[0]
            assert max_rel_err(padded[row, real], alone) < tol, f"{side}-padded row {row} differs from the row alone"
