"""Helpers for parity tests against HF transformers, shared by the model tests (and usable by users who
port a family): random HF models with non-trivial weights, our twin of an HF model, error bounds."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from .checkpoint.loader import build_model, from_pretrained
from .checkpoint.remap import hf_to_ours
from .registry import rules_for


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
    class lists in ``_tied_weights_keys`` (BERT's MLM decoder weight and bias); untied, transformers unties them
    all, and each is a parameter of its own."""
    listed = set(getattr(hf_model, "_tied_weights_keys", None) or {})
    if hf_model.config.to_dict().get("tie_word_embeddings", False):
        return listed | {"lm_head.weight"}
    return set()


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
    """A left- or right-padded batch gives, on each row's real tokens, the logits of that row run alone (with
    positions counted from each row's first real token, ``mask_positions=True``)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = (13, 6, 1)
    S = max(lengths)
    ids = torch.randint(0, vocab_size, (len(lengths), S), generator=gen)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        real = slice(S - n, S) if side == "left" else slice(0, n)
        mask[row, real] = 1
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, mask_positions=True).logits
        assert torch.isfinite(padded).all(), "padded positions must not produce NaN"
        for row in range(len(lengths)):
            real = mask[row].bool()
            alone = model(ids[row:row + 1, real]).logits[0]
            assert max_rel_err(padded[row, real], alone) < tol, f"{side}-padded row {row} differs from the row alone"


def random_input_ids(vocab_size: int, shape: tuple[int, ...], *, low: int = 0):
    """Inputs for the helpers below: a callable drawing ``input_ids`` of ``shape`` in ``[low, vocab_size)`` from
    torch's global RNG when called, i.e. after the helper has built its seeded models."""
    return lambda: {"input_ids": torch.randint(low, vocab_size, shape)}


def _resolve(inputs):
    return dict(inputs() if callable(inputs) else inputs)


def _real_tokens(tensor: torch.Tensor, inputs: dict) -> torch.Tensor:
    mask = inputs.get("attention_mask")
    return tensor if mask is None else tensor[mask.bool()]


def assert_fp32_parity(hf_model, ours, input_ids: torch.Tensor, *, labels: torch.Tensor | None = None,
                       tol: float = 1e-5):
    """In fp32 our logits are within ``tol`` (max relative error) of HF's, and with ``labels`` our loss equals
    HF's to ``rtol=tol``. Returns our output, for checks a family adds on top."""
    with torch.no_grad():
        ref, out = hf_model(input_ids, labels=labels), ours(input_ids, labels=labels)
    err = max_rel_err(out.logits, ref.logits)
    assert err < tol, f"logits differ from HF's: {err:.3g}"
    if labels is not None:
        assert torch.allclose(out.loss, ref.loss, rtol=tol), f"loss {out.loss.item()} vs HF's {ref.loss.item()}"
    return out


def assert_bf16_error_bounded(hf_config, inputs, *, seed: int, output: str = "logits",
                              auto_class: str = "AutoModelForCausalLM", attn_implementation: str = "sdpa",
                              attn_impl: str = "auto", kernel_backend: str = "auto", k: float = 2.0,
                              atol: float = 1e-3) -> None:
    """Our bf16 twin of a random fp32 HF model of ``hf_config`` (weights from ``seed``) has an error against
    that fp32 model within ``low_precision_bound_ok`` of HF's own bf16 model's error, on ``output``.

    ``inputs`` are the forward's keyword arguments (``input_ids=...``), or a callable returning them, called
    once the models are built (so ids drawn from torch's global RNG follow the seed). With an
    ``attention_mask`` the outputs are compared on the real tokens only. ``attn_impl`` and ``kernel_backend`` pick
    our backends (e.g. our kernels, through Triton's interpreter on a CPU)."""
    hf32 = random_hf_model(hf_config, seed=seed, auto_class=auto_class, attn_implementation=attn_implementation)
    hf16 = random_hf_model(hf_config, seed=seed, auto_class=auto_class, attn_implementation=attn_implementation)
    hf16 = hf16.to(torch.bfloat16)
    ours16 = ours_from_hf(hf32, attn_impl=attn_impl, kernel_backend=kernel_backend, dtype=torch.bfloat16)
    inputs = _resolve(inputs)
    with torch.no_grad():
        ref = _real_tokens(getattr(hf32(**inputs), output), inputs)
        theirs = _real_tokens(getattr(hf16(**inputs), output), inputs).float()
        got = _real_tokens(getattr(ours16(**inputs), output), inputs).float()
    ok, ours_err, hf_err = low_precision_bound_ok(got, theirs, ref, k=k, atol=atol)
    assert ok, f"ours bf16 error {ours_err:.3g} vs HF's own bf16 error {hf_err:.3g}"


def assert_saved_model_read_by_transformers(hf_model, directory, inputs, *, auto_class: str = "AutoModelForCausalLM",
                                            output: str = "logits", tol: float = 1e-6):
    """Our twin of ``hf_model``, written with ``save_pretrained`` to ``directory``, is read by transformers'
    ``auto_class`` as the same HF class, whose ``output`` is within ``tol`` (max relative error, every
    position) of ``hf_model``'s; and ``flash_models.from_pretrained`` reads back our config unchanged.

    ``inputs`` are keyword arguments or a callable returning them, called once the models are built and
    read. Returns the model ``from_pretrained`` read, for checks a family adds on top."""
    ours = ours_from_hf(hf_model)
    ours.save_pretrained(directory)
    reread = getattr(transformers, auto_class).from_pretrained(directory).eval()
    assert type(reread).__name__ == type(hf_model).__name__, type(reread).__name__
    inputs = _resolve(inputs)
    with torch.no_grad():
        err = max_rel_err(getattr(reread(**inputs), output), getattr(hf_model(**inputs), output))
    assert err < tol, f"transformers' reading of our checkpoint differs: {err:.3g}"
    again = from_pretrained(directory)
    assert again.config == ours.config
    return again


def assert_greedy_generation_equals_hf(hf_model, ours, *, vocab_size: int, shape: tuple[int, int],
                                       max_new_tokens: int, left_pad: tuple[int, int] | None = None,
                                       pad_token_id: int = 0, low: int = 2) -> None:
    """Greedy decoding gives exactly HF's tokens (EOS off) on prompts of ``shape`` drawn from torch's
    global RNG in ``[low, vocab_size)``; ``left_pad=(row, n)`` left-pads that row with ``n`` pad tokens
    (masked out), so HF and we must both derive positions from the mask."""
    ids = torch.randint(low, vocab_size, shape)
    masked = {}
    if left_pad is not None:
        row, n = left_pad
        mask = torch.ones_like(ids)
        mask[row, :n] = 0
        ids[row, :n] = pad_token_id
        masked = {"attention_mask": mask}
    ref = hf_model.generate(ids, **masked, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                            pad_token_id=pad_token_id)
    out = ours.generate(ids, **masked, max_new_tokens=max_new_tokens, eos_token_id=[])
    where = (out != ref).nonzero()[:1].tolist() if out.shape == ref.shape else f"shape {tuple(out.shape)}"
    assert torch.equal(out, ref), f"generation differs from HF's at {where}"


def assert_left_padded_logits_match_hf(hf_model, ours, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                                       tol: float = 1e-5) -> None:
    """On a padded batch our logits are within ``tol`` of HF's on the real tokens, and finite everywhere: with
    no position_ids (both follow the family's HF rule), and with ``mask_positions=True`` against HF given
    the same positions (counted from each row's first real token) explicitly."""
    counted = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    real = attention_mask.bool()
    with torch.no_grad():
        runs = {
            "default positions": (hf_model(input_ids, attention_mask=attention_mask).logits,
                                  ours(input_ids, attention_mask=attention_mask).logits),
            "mask_positions=True": (hf_model(input_ids, attention_mask=attention_mask, position_ids=counted).logits,
                                    ours(input_ids, attention_mask=attention_mask, mask_positions=True).logits),
        }
    for name, (ref, out) in runs.items():
        err = max_rel_err(out[real], ref[real])
        assert err < tol, f"{name}: real tokens differ from HF's: {err:.3g}"
        assert torch.isfinite(out).all(), f"{name}: padded positions must not produce NaN"


def assert_kv_cache_decode_equals_full_forward(model, input_ids: torch.Tensor, *, prefill: int, cache_len: int,
                                               tol: float = 1e-5) -> None:
    """A prefill of the first ``prefill`` tokens into a fresh KV cache of ``cache_len`` positions, then one token
    at a time, gives the logits of one full forward (within ``tol``)."""
    batch, length = input_ids.shape
    with torch.no_grad():
        full = model(input_ids).logits
        cache = model.new_kv_cache(batch, cache_len)
        steps = [model(input_ids[:, :prefill], kv_cache=cache).logits]
        steps += [model(input_ids[:, t:t + 1], kv_cache=cache).logits for t in range(prefill, length)]
    assert max_rel_err(torch.cat(steps, dim=1), full) < tol


def assert_checkpoint_file_loads(hf_model, state: dict, directory, inputs, *, output: str = "logits",
                                 tol: float = 1e-5) -> None:
    """``state`` (a state dict as some released checkpoint names it), written with ``hf_model``'s config to
    ``directory`` as ``pytorch_model.bin``, loads through ``flash_models.from_pretrained`` into a model whose
    ``output`` is within ``tol`` of ``hf_model``'s. ``inputs`` are keyword arguments or a callable returning
    them (called before loading)."""
    hf_model.config.save_pretrained(directory)
    torch.save(state, Path(directory) / "pytorch_model.bin")
    inputs = _resolve(inputs)
    with torch.no_grad():
        err = max_rel_err(getattr(from_pretrained(directory)(**inputs), output), getattr(hf_model(**inputs), output))
    assert err < tol, f"the loaded checkpoint differs from HF's model: {err:.3g}"


def write_color_image_folder(directory, *, images_per_class: int = 8, size: int = 40):
    """An image folder (one subfolder per class) of noisy ``size``-px PNGs whose class is the dominant colour
    (red or blue): learnable in a few steps. Returns ``directory``."""
    from pathlib import Path

    import numpy as np
    from PIL import Image

    directory = Path(directory)
    rng = np.random.default_rng(0)
    for label, channel in (("red", 0), ("blue", 2)):
        (directory / label).mkdir(parents=True)
        for i in range(images_per_class):
            pixels = rng.integers(0, 80, (size, size, 3), dtype=np.uint8)
            pixels[..., channel] += 170
            Image.fromarray(pixels).save(directory / label / f"{i}.png")
    return directory
