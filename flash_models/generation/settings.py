"""Generation settings: HF's argument names, one typed object, checked once.

``resolve_settings(base, vocab_size, generation_config, **kwargs)`` merges, in increasing priority as
transformers does: our defaults, the set fields of the model's own generation config (``base``), those of a
``generation_config`` argument, then keyword arguments. Every HF setting is honoured or refused by name:
one that changes no token here (beam-search-only tuning while num_beams is 1, caching choices) is accepted,
one flash-models does not implement is accepted only at the value that turns it off, and an argument nobody
knows raises, naming the ones flash-models takes.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class GenerationSettings:
    # None: from max_length (HF's total length, prompt columns included), else HF's default of 20 new tokens.
    # ``for_prompt`` turns max_length and min_length into these counts once the prompt's length is known.
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    max_length: int | None = None
    min_length: int = 0
    no_repeat_ngram_size: int = 0  # a row never repeats an n-gram of its own (padding excluded)
    num_return_sequences: int = 1  # sampled continuations per prompt, each prompt's rows consecutive as in HF
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
    output_logits: bool = False  # per-step raw logits, before any processing
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
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0 or (self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens):
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"max_length (the prompt's length + new tokens) must be >= 1, got {self.max_length}")
        for name in ("min_length", "no_repeat_ngram_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 disables it), got {getattr(self, name)}")
        if self.num_return_sequences < 1:
            raise ValueError(f"num_return_sequences must be >= 1, got {self.num_return_sequences}")
        if self.num_return_sequences > 1 and not self.do_sample:
            raise ValueError(f"num_return_sequences={self.num_return_sequences} needs do_sample=True: greedy decoding "
                             "gives every copy the same tokens (as in transformers, which refuses it too)")
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

    def for_prompt(self, prompt_len: int) -> GenerationSettings:
        """These settings for a prompt of ``prompt_len`` columns: max_length and min_length, which count the
        prompt's columns as HF's do, become counts of new tokens (max_new_tokens wins over max_length)."""
        new = self.max_new_tokens
        if new is None and self.max_length is not None:
            if self.max_length <= prompt_len:
                raise ValueError(f"max_length={self.max_length} leaves no room after the prompt's {prompt_len} columns "
                                 "(max_length counts the prompt): pass max_new_tokens instead")
            new = self.max_length - prompt_len
        new = 20 if new is None else new
        min_new = min(max(self.min_new_tokens, self.min_length - prompt_len), new)
        return replace(self, max_new_tokens=new, min_new_tokens=min_new, max_length=None, min_length=0)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return (self.eos_token_id,) if isinstance(self.eos_token_id, int) else tuple(self.eos_token_id)

    @property
    def pad_id(self) -> int:
        return self.pad_token_id if self.pad_token_id is not None else (self.eos_ids[0] if self.eos_ids else 0)


_NAMES = {f.name for f in fields(GenerationSettings)}
_INTS = ("min_new_tokens", "min_length", "no_repeat_ngram_size", "num_return_sequences", "top_k", "num_draft_tokens")
_OPTIONAL_INTS = ("max_new_tokens", "max_length", "pad_token_id", "kv_block_size")
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty")
_BOOLS = ("do_sample", "output_scores", "output_logits", "return_dict_in_generate", "use_cuda_graph",
          "programmatic_launch")


def _int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


# transformers' generation settings that change no token here: beam-search-only tuning (num_beams must be 1),
# assisted-decoding tuning (a draft's tokens are checked by the target whatever their number), caching and
# compilation choices (the KV cache is always on; use_cache=False would only recompute the same logits), the
# ids of an encoder-decoder's decoder start, and the config's own bookkeeping.
_HF_NO_EFFECT = frozenset({
    "early_stopping", "length_penalty", "use_cache", "cache_implementation", "cache_config", "max_cache_len",
    "compile_config", "disable_compile", "prefill_chunk_size", "low_memory", "bos_token_id", "decoder_start_token_id",
    "is_assistant", "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
    "assistant_lookbehind", "target_lookbehind", "transformers_version", "_from_model_config",
})
# transformers' settings flash-models does not implement, accepted at the value that turns them off.
_HF_OFF = {
    "num_beams": 1, "num_beam_groups": 1, "diversity_penalty": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0, "guidance_scale": 1.0, "encoder_repetition_penalty": 1.0, "encoder_no_repeat_ngram_size": 0,
    "remove_invalid_values": False, "renormalize_logits": False, "token_healing": False, "output_attentions": False,
    "output_hidden_states": False, "use_mtp": False,
}


def _as_ids(value):
    """eos/pad ids as HF takes them (an int, a list, a tensor) -> an int or a tuple of them."""
    if hasattr(value, "tolist"):  # a tensor or a numpy array of ids
        value = value.tolist()
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _check_hf_setting(name: str, value, where: str) -> None:
    """A transformers generation setting outside ours: accepted when it changes no token, else refused by name."""
    empty = isinstance(value, (list, tuple, dict)) and not value
    if name in _HF_NO_EFFECT or value is None or empty or (name in _HF_OFF and value == _HF_OFF[name]):
        return
    raise ValueError(f"{where}{name}={value!r} is not supported by flash-models; "
                     + (f"only {name}={_HF_OFF[name]!r} is accepted" if name in _HF_OFF else f"drop {name}"))


def _hf_setting_names() -> set[str]:
    import transformers  # on use: only an argument outside ours needs HF's list

    return set(transformers.GenerationConfig().to_dict())


def _config_ids(model_config, vocab_size: int, name: str):
    """The EOS/pad ids ``model_config`` (a config or a GenerationConfig) holds, keeping only ids inside the
    vocabulary (tiny test configs often inherit out-of-range defaults, which could never be generated anyway)."""
    value = getattr(model_config, name, None)  # families differ in which id fields they have
    ids = [i for i in ((value,) if isinstance(value, int) else tuple(value or ())) if 0 <= i < vocab_size]
    return (ids[0] if len(ids) == 1 else tuple(ids)) if ids else None


def _set_fields(generation_config, where: str) -> dict:
    if not hasattr(generation_config, "to_dict"):
        raise ValueError(f"{where} must be a transformers.GenerationConfig, got {type(generation_config).__name__}")
    return {k: v for k, v in generation_config.to_dict().items() if v is not None}


def resolve_settings(base, vocab_size: int, generation_config=None, **kwargs) -> GenerationSettings:
    """Settings in transformers' priority: keyword arguments over ``generation_config`` over ``base`` over our
    defaults. ``base`` is the model's own generation config (or a model config): it gives the EOS/pad ids alone,
    ids outside the vocabulary dropped. Its sampling settings do not apply: without ``do_sample=True`` (or a
    ``generation_config`` asking for it) generation is greedy, whatever the checkpoint recommends, so that
    ``generate(ids)`` gives the same tokens for every checkpoint and a setting we do not implement in a
    checkpoint's generation_config.json never makes it fail. ``generation_config=model.generation_config`` takes
    the checkpoint's settings, every field."""
    outside = set(kwargs) - _NAMES
    if outside:
        unknown = outside - _hf_setting_names()
        if unknown:
            raise ValueError(f"unknown generation argument(s) {sorted(unknown)}; supported: {sorted(_NAMES)}")
    own = {name: _config_ids(base, vocab_size, name) for name in ("eos_token_id", "pad_token_id")}
    layers = [("model.generation_config.", {k: v for k, v in own.items() if v is not None})]  # (origin, values)
    if generation_config is not None:
        layers.append(("GenerationConfig.", _set_fields(generation_config, "generation_config")))
    # None means "not given" (as in HF); an empty eos_token_id list means "no EOS at all".
    explicit = {k: v for k, v in kwargs.items() if v is not None}
    layers.append(("", explicit))
    merged, origin = {}, {}
    for where, values in layers:
        for name, value in values.items():
            merged[name], origin[name] = value, where
    for name in sorted(set(merged) - _NAMES):
        _check_hf_setting(name, merged[name], origin[name])
    values = {k: _as_ids(v) for k, v in merged.items() if k in _NAMES}
    if values.get("eos_token_id") == ():
        values["eos_token_id"] = None
    settings = GenerationSettings(**values).typed()
    settings.check(vocab_size)
    return settings
