"""Generation settings: HF's argument names, one typed object, checked once.

``resolve_settings(model, generation_config, **kwargs)`` merges, in increasing priority: our defaults, the
model config's EOS/pad ids, the set fields of a ``transformers.GenerationConfig``, then keyword arguments.
An argument flash-models does not know raises, naming the ones it does.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 20
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    stop_strings: tuple[str, ...] = ()
    output_scores: bool = False  # per-step processed log-probabilities of the chosen tokens and full scores
    return_dict_in_generate: bool = False
    num_draft_tokens: int = 4  # speculative decoding with a draft model
    use_cuda_graph: bool = True  # capture the decode step on CUDA
    compile_decode: bool | str = False  # torch.compile the decode step (True: inductor; or a backend name)
    # Launch the decode step's kernels with programmatic dependent launch (see flash_kernels._pdl), its
    # projections through flash_kernels.gemv so they join the chain. Only Hopper and newer GPUs act on it;
    # elsewhere, and for a compiled step (compile_decode), it changes nothing. `bench generate` measures it
    # against plain launches (its "ours-pdl" side): H100, 2026-11-23, batch 1: LLaMA-1.1B 1.46 -> 1.20 ms a
    # step, GPT-2 0.51 -> 0.37; batch 16 unchanged (docs/benchmarks.md, Generation, session 11).
    programmatic_launch: bool = True
    kv_block_size: int | None = None  # a paged KV cache with blocks of this many tokens (None: one static block per row)

    def check(self, vocab_size: int) -> None:
        """Ranges, with HF's rules (types are checked by ``typed`` first)."""
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= max(self.max_new_tokens, 0):
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}")
        # Greedy decoding ignores the sampling settings (temperature=0 is a common way to ask for it), but a
        # value no sampler could use is a mistake either way.
        if self.temperature < 0 or (self.do_sample and self.temperature == 0):
            raise ValueError(f"temperature must be > 0 with do_sample=True, got {self.temperature}; use do_sample=False "
                             "for greedy decoding")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1) (0 disables it), got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1.0 disables it), got {self.repetition_penalty}")
        bad = [i for i in self.eos_ids if not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"eos_token_id {bad} outside the vocabulary [0, {vocab_size})")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < vocab_size:
            raise ValueError(f"pad_token_id {self.pad_token_id} outside the vocabulary [0, {vocab_size})")
        if self.kv_block_size is not None and self.kv_block_size < 1:
            raise ValueError(f"kv_block_size must be >= 1 (or None for a static cache), got {self.kv_block_size}")
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")

    def typed(self) -> GenerationSettings:
        """These settings with every value checked against its declared type, naming the argument: ints are
        ints (not bools, not 2.5), numbers are finite, flags are bools. Integer-like values (numpy ints)
        become ints, real numbers floats."""
        values = {}
        for name in _INTS:
            values[name] = _int(name, getattr(self, name))
        for name in _OPTIONAL_INTS:
            value = getattr(self, name)
            values[name] = None if value is None else _int(name, value)
        for name in _FLOATS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            values[name] = float(value)
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.compile_decode, (bool, str)):
            raise ValueError(f"compile_decode must be True, False or a torch.compile backend name, got {self.compile_decode!r}")
        eos = self.eos_token_id
        if eos is not None:
            values["eos_token_id"] = (_int("eos_token_id", eos) if not isinstance(eos, tuple)
                                      else tuple(_int("eos_token_id", i) for i in eos))
        stops = (self.stop_strings,) if isinstance(self.stop_strings, str) else self.stop_strings
        if not isinstance(stops, (tuple, list)) or not all(isinstance(t, str) and t for t in stops):
            raise ValueError(f"stop_strings must be a non-empty string or a list of them, got {self.stop_strings!r}")
        values["stop_strings"] = tuple(stops)
        return replace(self, **values)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return (self.eos_token_id,) if isinstance(self.eos_token_id, int) else tuple(self.eos_token_id)

    @property
    def pad_id(self) -> int:
        return self.pad_token_id if self.pad_token_id is not None else (self.eos_ids[0] if self.eos_ids else 0)


_NAMES = {f.name for f in fields(GenerationSettings)}
_INTS = ("max_new_tokens", "min_new_tokens", "top_k", "num_draft_tokens")
_OPTIONAL_INTS = ("pad_token_id", "kv_block_size")
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty")
_BOOLS = ("do_sample", "output_scores", "return_dict_in_generate", "use_cuda_graph", "programmatic_launch")


def _int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)
# HF GenerationConfig fields that have no effect for us when left at their neutral values.
_NEUTRAL_HF = {"num_beams": 1, "num_return_sequences": 1, "use_cache": True}


def _as_ids(value):
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _config_ids(model_config, vocab_size: int, name: str):
    """The model config's EOS/pad ids, keeping only ids inside the vocabulary (tiny test configs often
    inherit out-of-range defaults, which could never be generated anyway)."""
    value = getattr(model_config, name, None)  # families differ in which id fields they have
    ids = [i for i in ((value,) if isinstance(value, int) else tuple(value or ())) if 0 <= i < vocab_size]
    return (ids[0] if len(ids) == 1 else tuple(ids)) if ids else None


def resolve_settings(model_config, vocab_size: int, generation_config=None, **kwargs) -> GenerationSettings:
    unknown = set(kwargs) - _NAMES
    if unknown:
        raise ValueError(f"unknown generation argument(s) {sorted(unknown)}; supported: {sorted(_NAMES)}")
    settings = GenerationSettings(
        eos_token_id=_config_ids(model_config, vocab_size, "eos_token_id"),
        pad_token_id=_config_ids(model_config, vocab_size, "pad_token_id"),
    )
    if generation_config is not None:
        for name, neutral in _NEUTRAL_HF.items():
            value = getattr(generation_config, name, None)
            if value is not None and value != neutral:
                raise ValueError(f"GenerationConfig.{name}={value} is not supported by flash-models (only {neutral})")
        from_hf = {name: getattr(generation_config, name, None) for name in _NAMES}
        settings = replace(settings, **{k: _as_ids(v) for k, v in from_hf.items() if v is not None})
    # None means "not given" (as in HF); an empty eos_token_id list means "no EOS at all".
    explicit = {k: _as_ids(v) for k, v in kwargs.items() if v is not None}
    if explicit.get("eos_token_id") == ():
        explicit["eos_token_id"] = None
    settings = replace(settings, **explicit).typed()
    settings.check(vocab_size)
    return settings
