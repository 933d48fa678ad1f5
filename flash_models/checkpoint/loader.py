"""``from_pretrained``, ``save_pretrained`` and ``create_model``: HF layout in and out, through the registry."""

from __future__ import annotations

import collections
import copy
import difflib
import logging
import warnings
from pathlib import Path

import torch
import transformers
from huggingface_hub.errors import StrictDataclassError

from ..config import check_model_size, check_numbers
from ..models.hf_config import ModelConfig
from ..models.protocols import is_causal_decoder
from ..registry import get_family, get_preset, rules_for
from .files import load_state_dict, read_json_object, write_model_dir
from .gguf_file import load_gguf
from .hub import is_gguf, no_config_error, resolve_gguf, resolve_model_dir
from .load_options import attn_impl_from_hf, config_overrides, device_from_map
from .placement import resolve_device, resolve_dtype
from .remap import CheckpointKeyError, check_hf_shapes, check_keys, hf_to_ours, ours_to_hf
from .save_options import check_save_options, checked_state_dict

log = logging.getLogger(__name__)
GENERATION_CONFIG = "generation_config.json"


def checkpoint_dtype(state: dict[str, torch.Tensor]) -> torch.dtype:
    """What ``dtype="auto"`` loads as when config.json names no dtype: the dtype most of the checkpoint's floating
    tensors have on disk (float32 for a GGUF file, which dequantizes to float32)."""
    counts = collections.Counter(v.dtype for v in state.values() if v.is_floating_point())
    return counts.most_common(1)[0][0] if counts else torch.float32


def _config_dtype(hf_config) -> torch.dtype | None:
    """The dtype config.json names (``dtype``, or its older name ``torch_dtype``), which transformers' dtype="auto"
    takes before the weights' own; None when it names none (or no floating dtype)."""
    named = hf_config.dtype
    try:
        return resolve_dtype(named) if named is not None else None
    except ValueError:
        return None


def build_model(hf_config, *, attn_impl: str = "auto", kernel_backend: str = "auto", device="meta"):
    """Our model for an HF config, on ``device`` (meta: no memory, for loading or inspecting)."""
    fields = hf_config.to_dict()
    check_numbers(fields)
    check_model_size(fields)
    family = get_family(hf_config.model_type)
    config = family.config_class.from_hf(hf_config)
    with torch.device(device):
        return family.model_class(config, attn_impl=attn_impl, kernel_backend=kernel_backend)


def read_hf_config(directory: Path):
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise no_config_error(directory)
    fields = read_json_object(config_path, what="config fields")
    if "model_type" not in fields:
        raise ValueError(f"{config_path} has no model_type: it does not say which architecture the weights are "
                         "(transformers' save_pretrained writes it)")
    get_family(fields["model_type"])  # our clear error for an unsupported type, before transformers' own
    quantization = fields.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        raise ValueError(f"{config_path} describes a quantized checkpoint (quantization_config, quant_method "
                         f"{method!r}), which flash-models does not load: use the unquantized weights, or a GGUF file")
    try:
        check_numbers(fields)
        check_model_size(fields)
    except ValueError as err:
        raise ValueError(f"{config_path}: {err}") from None
    return _hf_config(str(config_path), transformers.AutoConfig.from_pretrained, directory)


def _hf_config(source: str, make, *args, **kwargs):
    """An HF config from ``make``, with transformers' own validation errors turned into a ValueError naming
    where the config came from."""
    try:
        return make(*args, **kwargs)
    except (StrictDataclassError, TypeError, ValueError) as err:
        raise ValueError(f"{source}: invalid config: {err}") from None


def from_pretrained(
    name_or_path: str | Path,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | int | None = None,
    attn_impl: str = "auto",
    kernel_backend: str = "auto",
    gguf_file: str | None = None,
    revision: str | None = None,
    torch_dtype: torch.dtype | str | None = None,
    config: transformers.PretrainedConfig | str | Path | None = None,
    subfolder: str = "",
    device_map: str | int | torch.device | dict | None = None,
    attn_implementation: str | None = None,
    use_safetensors: bool | None = None,
    cache_dir: str | Path | None = None,
    local_files_only: bool = False,
    token: str | bool | None = None,
    force_download: bool = False,
    **kwargs,
):
    """Load a model from a hub repo id, a local HF folder, or a .gguf file, with HF's weights.

    ``dtype`` defaults to float32 ("auto": the dtype config.json names, else the weights' own) and ``device`` to the CPU. ``attn_impl``
    picks the attention backend ("eager", "sdpa", "flash", "auto") and ``kernel_backend`` the fused ops
    ("reference", "triton", "auto"). The model comes back in eval mode, as in transformers.

    transformers' arguments mean what they mean there: ``torch_dtype`` is the older name for ``dtype`` (a warning
    says so); ``device_map`` names the one device to load on ("auto": the GPU, else the CPU; a map over several
    devices is refused); ``attn_implementation`` takes HF's names ("flash_attention_2" is our "flash");
    ``config`` (an HF config or a folder holding config.json) replaces the checkpoint's config.json;
    ``subfolder``, ``revision``, ``cache_dir``, ``local_files_only``, ``token`` and ``force_download`` locate the
    files; ``use_safetensors`` picks the weight format; other keywords that are fields of the checkpoint's config
    class override them (``num_labels=3``), as in transformers (``load_options``). Any other keyword is refused
    by name, and ``trust_remote_code`` never runs code.
    """
    if torch_dtype is not None:
        if dtype is not None:
            raise ValueError("give dtype only: torch_dtype is its older name, and both were given")
        warnings.warn("torch_dtype is transformers' older name for dtype: pass dtype=", FutureWarning, stacklevel=2)
        dtype = torch_dtype
    dtype = dtype if isinstance(dtype, str) and dtype == "auto" else resolve_dtype(dtype)
    device = resolve_device(device_from_map(device, device_map))
    attn_impl = attn_impl_from_hf(attn_impl, attn_implementation)
    if use_safetensors not in (None, True, False):
        raise ValueError(f"use_safetensors must be True, False or None, got {use_safetensors!r}")
    download = {"cache_dir": cache_dir, "local_files_only": local_files_only, "token": token,
                "force_download": force_download}
    gguf = is_gguf(name_or_path) or gguf_file is not None
    if gguf:
        if use_safetensors:
            raise ValueError("use_safetensors=True with a GGUF file: a GGUF file holds its own weights")
        path = resolve_gguf(name_or_path, gguf_file=gguf_file, revision=revision, subfolder=subfolder, **download)
        config_dict, hf_state = load_gguf(path)
        model_type = config_dict.pop("model_type")
        get_family(model_type)
        hf_config = _hf_config(str(name_or_path), transformers.AutoConfig.for_model, model_type, **config_dict)
    else:
        directory = resolve_model_dir(name_or_path, revision=revision, subfolder=subfolder, **download)
        from .timm import from_timm_dir, is_timm_dir  # timm.py builds on this module

        if is_timm_dir(directory):
            if config is not None or kwargs:
                given = ["config"] * (config is not None) + sorted(kwargs)
                raise ValueError(f"{name_or_path!r} is a timm checkpoint (timm's own config.json): {given} are "
                                 "transformers config arguments, which it does not take; load it without them")
            return from_timm_dir(directory, dtype=dtype, device=device, attn_impl=attn_impl,
                                 kernel_backend=kernel_backend)
        hf_config = read_hf_config(directory) if config is None else None
        hf_state = load_state_dict(directory, use_safetensors=use_safetensors)
    if config is not None:
        hf_config = _given_config(config, checkpoint_type=hf_config.model_type if gguf else None)
    overrides = config_overrides(type(hf_config), dict(kwargs))
    checkpoint_config = hf_config
    if overrides:
        fields = hf_config.to_dict()
        if "num_labels" in overrides:  # the checkpoint's label names are for its own count
            fields.pop("id2label", None), fields.pop("label2id", None)
        hf_config = _hf_config(f"from_pretrained({name_or_path!r}) overrides {sorted(overrides)}",
                               type(hf_config).from_dict, {**fields, **overrides})
    if dtype == "auto":
        dtype = _config_dtype(hf_config) or checkpoint_dtype(hf_state)
    _tie_as_transformers_does(hf_config, hf_state)
    model = build_model(hf_config, attn_impl=attn_impl, kernel_backend=kernel_backend, device="meta")
    ruleset = rules_for(model.config)
    expected = ours_to_hf(model.state_dict(), ruleset)  # meta tensors: HF's keys and shapes for this config
    if overrides:
        _drop_weights_the_overrides_remove(hf_state, checkpoint_config, set(expected), ruleset, overrides)
    try:
        fresh = check_keys(set(hf_state), set(expected), ruleset)
    except CheckpointKeyError as err:
        named = hf_config.architectures or []
        if named and type(model).__name__ not in named:
            raise CheckpointKeyError(f"{err}\n  config.json names the class {named[0]}, which flash-models does not "
                                     f"load: a {hf_config.model_type} checkpoint loads as {type(model).__name__}") from None
        raise
    try:
        check_hf_shapes(hf_state, expected, ruleset)
    except ValueError as err:
        if not overrides:
            raise
        head = ("; a fresh task head for another label count: BertForSequenceClassification.from_pretrained(path, "
                "num_labels=N)") if "num_labels" in overrides else ""
        raise ValueError(f"{err}\n  the keyword overrides {sorted(overrides)} changed the checkpoint's config{head}") from None
    state = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in hf_to_ours(hf_state, ruleset).items()}
    _check_shapes(model, state)
    if fresh:
        log.warning("%s holds no %s: %s randomly initialised, as transformers does (train them, or load a "
                    "checkpoint that has them)", name_or_path, ", ".join(sorted(fresh)),
                    "it is" if len(fresh) == 1 else "they are")
        # Built on the device, the model's own init gives the weights the checkpoint lacks; loading replaces the rest.
        model = build_model(hf_config, attn_impl=attn_impl, kernel_backend=kernel_backend, device=device).to(dtype)
    loaded = model.load_state_dict(state, strict=not fresh, assign=True)
    assert not loaded.unexpected_keys and len(loaded.missing_keys) <= len(fresh), loaded
    if not gguf and (directory / GENERATION_CONFIG).is_file() and is_causal_decoder(model):
        # The checkpoint's own generation defaults, as transformers reads them: an instruct model's end-of-turn
        # ids are often listed there only (Llama-3: <|eot_id|>), and generate stops at them.
        model.generation_config = transformers.GenerationConfig.from_pretrained(directory)
    model.name_or_path = str(name_or_path)
    model.config.name_or_path = str(name_or_path)  # HF's place for it (TRL names the model and finds its tokenizer by it)
    return model.eval()


def _given_config(config, *, checkpoint_type: str | None):
    """The HF config a ``config=`` argument names: an HF config object, or a folder (or its config.json) read as
    from_pretrained reads one. For a GGUF file it must be of the file's architecture."""
    if isinstance(config, (str, Path)):
        path = Path(config)
        config = read_hf_config(path.parent if path.name == "config.json" else path)
    elif isinstance(config, ModelConfig):  # another of our models' config
        config = config.to_hf()
    if not isinstance(config, transformers.PretrainedConfig):
        raise ValueError(f"config must be a transformers config (PretrainedConfig), a flash-models model's config, or "
                         f"a folder holding config.json, got {type(config).__name__}")
    get_family(config.model_type)
    if checkpoint_type is not None and config.model_type != checkpoint_type:
        raise ValueError(f"config is a {config.model_type} config, but the GGUF file holds a {checkpoint_type} model")
    return copy.deepcopy(config)  # the overrides and the tie check below change it; the caller's stays as given


def _drop_weights_the_overrides_remove(hf_state: dict, checkpoint_config, expected: set[str], ruleset, overrides) -> None:
    """Checkpoint weights that the checkpoint's own config has a place for and the keyword overrides remove
    (``num_hidden_layers=2`` of a deeper checkpoint: the first two layers) are dropped with a warning, as
    transformers drops them (in place)."""
    unplaced = [k for k in hf_state if ruleset.normalize_hf_key(k) not in expected
                and not ruleset.is_ignored(ruleset.normalize_hf_key(k))]
    if not unplaced:
        return
    try:
        own = build_model(checkpoint_config)
    except ValueError:  # a config flash-models loads only as the overrides change it: nothing to compare with
        return
    own_rules = rules_for(own.config)
    placed = set(ours_to_hf(own.state_dict(), own_rules))
    dropped = [k for k in unplaced if own_rules.normalize_hf_key(k) in placed]
    if dropped:
        log.warning("the keyword overrides %s leave %d checkpoint weights without a place; they are not loaded, as in "
                    "transformers: %s", sorted(overrides), len(dropped), ", ".join(sorted(dropped)[:10])
                    + (", ..." if len(dropped) > 10 else ""))
        for key in dropped:
            del hf_state[key]


def _tie_as_transformers_does(hf_config, hf_state: dict[str, torch.Tensor]) -> None:
    """transformers ties an output head to the input embeddings only when the checkpoint holds no head of its
    own, or one equal to them; a checkpoint whose head differs loads untied there (with a warning), and one that
    holds the head but not the embeddings takes the head as both. So it does here (``hf_config`` is untied in place): the logits are the checkpoint's, as in transformers. Which head
    ties to which table is transformers' own mapping (``_tied_weights_keys`` of the HF class)."""
    if not hf_config.to_dict().get("tie_word_embeddings"):
        return
    family = get_family(hf_config.model_type)
    tied_rules = rules_for(family.config_class.from_hf(hf_config))
    skipped = [k for k in hf_state if tied_rules.is_ignored(tied_rules.normalize_hf_key(k))]
    if not skipped:
        return
    untied_config = copy.deepcopy(hf_config)
    untied_config.tie_word_embeddings = False
    untied_rules = rules_for(family.config_class.from_hf(untied_config))
    heads = [k for k in skipped if not untied_rules.is_ignored(untied_rules.normalize_hf_key(k))]
    hf_class = getattr(transformers, type(build_model(hf_config)).__name__, None) if heads else None
    ties = hf_class._tied_weights_keys if hf_class is not None else None
    if not isinstance(ties, dict):
        return
    tables = {tied_rules.normalize_hf_key(k): v for k, v in hf_state.items()}
    for head in heads:
        target = ties.get(tied_rules.normalize_hf_key(head))
        table = tables.get(target)
        if table is None and target is not None:
            # The head alone, without the table it ties to: transformers ties either way round, so it is the table.
            hf_state[target] = hf_state.pop(head)
            continue
        if table is not None and not (table.shape == hf_state[head].shape and torch.equal(table, hf_state[head])):
            log.warning("the config ties %s to the embeddings, but the checkpoint holds a different one: loading it "
                        "untied, as transformers does (set tie_word_embeddings=false in config.json to silence this)", head)
            hf_config.tie_word_embeddings = False
            # What the checkpoint does not hold stays tied there (BERT's decoder bias to cls.predictions.bias).
            for key, target in ties.items():
                if key not in tables and target in tables:
                    hf_state[key] = tables[target].clone()
            return


def _check_shapes(model, state: dict[str, torch.Tensor]) -> None:
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    wrong = [f"{k}: expected {expected[k]}, got {tuple(v.shape)}" for k, v in state.items() if expected.get(k) != tuple(v.shape)]
    if wrong:
        raise ValueError("checkpoint tensor shapes do not fit the config:\n  " + "\n  ".join(wrong[:20]))


def save_pretrained(model, save_directory: str | Path, *, is_main_process: bool = True, state_dict: dict | None = None,
                    push_to_hub: bool = False, max_shard_size: int | str = "5GB", variant: str | None = None,
                    save_peft_format: bool = True, save_original_format: bool = True,
                    distributed_checkpoint: bool = False, safe_serialization: bool = True, **hub_kwargs) -> None:
    """Write config.json and safetensors in HF's canonical layout (fused parameters split back), so that
    ``transformers.AutoModelForCausalLM.from_pretrained(save_directory)`` reads it. Atomic per folder: a
    reader sees the old checkpoint or the new one, whole; the folder's other files (a tokenizer) are kept.

    transformers' arguments keep their meaning: ``max_shard_size`` ("5GB", "500MB", bytes), ``state_dict`` (saved
    in place of the model's own, as ``model.state_dict()`` gives it), ``is_main_process`` (False: this process
    writes nothing), ``safe_serialization`` (True: only safetensors are written), ``save_peft_format`` (no effect:
    it concerns transformers' own PEFT integration). ``push_to_hub`` and its hub arguments, ``variant``,
    ``save_original_format=False`` and ``distributed_checkpoint=True`` are refused by name (``save_options``)."""
    check_save_options(push_to_hub=push_to_hub, variant=variant, safe_serialization=safe_serialization,
                       save_original_format=save_original_format, distributed_checkpoint=distributed_checkpoint,
                       is_main_process=is_main_process, hub=hub_kwargs)
    if not is_main_process:
        return
    if any(p.is_meta for p in model.parameters()) and state_dict is None:
        raise ValueError("the model is on the meta device: it has no weights to save (load it with device='cpu')")
    hf_config = model.config.to_hf()  # first: it raises for a model HF's layout cannot express
    own = model.state_dict()
    hf_state = ours_to_hf(own if state_dict is None else checked_state_dict(state_dict, own), rules_for(model.config))
    hf_config.architectures = hf_config.architectures or [type(model).__name__]  # to_hf may name HF's class
    hf_config.dtype = model.dtype if state_dict is None else checkpoint_dtype(hf_state)  # what the files hold
    files = {"config.json": hf_config.to_json_string()}
    generation = _generation_config_json(model)
    if generation is not None:
        files[GENERATION_CONFIG] = generation
    write_model_dir(save_directory, hf_state, files, max_shard_size=max_shard_size)


def _generation_config_json(model) -> str | None:
    """A decoder's generation config as generation_config.json, when it says more than config.json's token ids
    (read from the checkpoint's own, or set by the user or TRL): what from_pretrained and transformers read back."""
    if not is_causal_decoder(model):
        return None
    c = model.config
    from_config = transformers.GenerationConfig(bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
                                                pad_token_id=c.pad_token_id)
    own = model.generation_config
    return None if own.to_diff_dict() == from_config.to_diff_dict() else own.to_json_string()


def check_override_names(preset: str, overrides: dict, *, prefix: str = "") -> None:
    """HF's config classes keep any unknown keyword as an attribute, so ``n_embed=32`` for ``n_embd`` would be
    silently ignored: a name the preset's config class does not declare is refused, with the closest one."""
    cls = transformers.CONFIG_MAPPING[get_preset(preset).model_type]
    known = set(cls().to_dict()) | set(cls.attribute_map) | {"num_labels"}
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{prefix}{key} is not a field of {cls.__name__}{hint}")


def create_model(preset: str, *, dtype=None, device=None, attn_impl: str = "auto", kernel_backend: str = "auto", **overrides):
    """A random-init model of a registered preset (``flash_models.list_models()``); keyword overrides change
    HF config fields, e.g. ``create_model("gpt2", n_layer=2)``."""
    spec = get_preset(preset)
    check_override_names(preset, overrides, prefix=f"create_model({preset!r}): ")
    hf_config = _hf_config(f"create_model({preset!r})", transformers.AutoConfig.for_model, spec.model_type,
                           **{**spec.hf_config, **overrides})
    dtype, device = resolve_dtype(dtype), resolve_device(device)
    model = build_model(hf_config, attn_impl=attn_impl, kernel_backend=kernel_backend, device=device)
    return model.to(dtype=dtype)
