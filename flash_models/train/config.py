"""Typed experiment configs: one dataclass per section, read from YAML plus ``section.key=value`` overrides.

Every key is declared with its type; an unknown key (with the closest known name), a mistyped value, a
non-finite number or a value outside its choices or range raises ``ConfigError`` naming the full dotted key. Nothing is read with a default
that the YAML could not also have set.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml


class ConfigError(ValueError):
    """A config key that does not exist, or a value of the wrong type, not finite, or outside its choices or range."""


TASKS = ("causal_lm", "sequence_classification", "image_classification")
DATA_FORMATS = ("text", "jsonl", "hf_disk", "sft", "classification", "image_folder", "synthetic")
PACKING = ("documents", "stream")
PRECISIONS = ("fp32", "bf16_autocast", "bf16")
SCHEDULES = ("cosine", "linear", "constant")
STRATEGIES = ("none", "ddp", "fsdp", "tp")


@dataclass
class ModelSection:
    # A registered preset (flash_models.list_models()), an HF folder, a .gguf file, or an alias
    # ("smollm2", "minilm"). ``pretrained`` loads its weights; otherwise a preset is built with random init.
    name: str = "gpt2"
    pretrained: bool = False
    overrides: dict = field(default_factory=dict)  # HF config fields for a preset, e.g. {n_layer: 2}
    task: str = "causal_lm"
    num_labels: int = 2  # classification heads
    attn_impl: str = "auto"
    kernel_backend: str = "auto"

    def validate(self, prefix: str) -> None:
        _non_empty(prefix + "name", self.name)
        _choice(prefix + "task", self.task, TASKS)
        if self.task != "causal_lm" and self.num_labels < 2:
            raise ConfigError(f"{prefix}num_labels must be >= 2 for model.task={self.task!r} (the Trainer trains "
                              f"single-label classification with cross-entropy), got {self.num_labels}")
        _choice(prefix + "attn_impl", self.attn_impl, ("eager", "sdpa", "flash", "auto"))
        _choice(prefix + "kernel_backend", self.kernel_backend, ("reference", "triton", "auto"))


@dataclass
class DataSection:
    format: str = "text"
    train: str | None = None  # file, folder or glob (text/jsonl/sft/classification), a saved HF dataset, an image folder
    eval: str | None = None
    tokenizer: str | None = None  # HF folder, .gguf, alias, or "bytes" (built-in byte-level); default: the model's
    text_field: str = "text"
    messages_field: str = "messages"  # sft: a list of {role, content}; or prompt_field + response_field
    prompt_field: str = "prompt"
    response_field: str = "response"
    label_field: str = "label"
    text_pair_field: str | None = None
    seq_len: int = 1024
    packing: str = "documents"  # documents: no attention across documents (cu_seqlens); stream: plain windows
    append_eos: bool = True
    cache_dir: str = ".cache/flash-models/tokens"
    image_size: int = 224
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    label_smoothing: float = 0.0
    synthetic_tokens: int = 1_000_000  # synthetic: random tokens (benchmarks and smoke tests)
    shuffle: bool = True

    def validate(self, prefix: str) -> None:
        _choice(prefix + "format", self.format, DATA_FORMATS)
        for name in ("train", "eval", "tokenizer", "cache_dir"):
            if getattr(self, name) is not None:
                _non_empty(prefix + name, getattr(self, name))
        _choice(prefix + "packing", self.packing, PACKING)
        _positive(prefix + "seq_len", self.seq_len)
        _positive(prefix + "image_size", self.image_size)
        _positive(prefix + "synthetic_tokens", self.synthetic_tokens)
        _at_least(prefix + "mixup_alpha", self.mixup_alpha, 0.0)
        _at_least(prefix + "cutmix_alpha", self.cutmix_alpha, 0.0)
        _in_unit_interval(prefix + "label_smoothing", self.label_smoothing)
        if self.format != "synthetic" and self.train is None:
            raise ConfigError(f"{prefix}train is required for data format {self.format!r}")


@dataclass
class OptimSection:
    lr: float = 6e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    fused: bool | None = None  # None: fused AdamW on CUDA, the plain (for-each) one elsewhere
    schedule: str = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # cosine/linear decay to lr * min_lr_ratio at max_steps
    grad_clip: float | None = 1.0

    def validate(self, prefix: str) -> None:
        _choice(prefix + "schedule", self.schedule, SCHEDULES)
        _positive(prefix + "lr", self.lr)
        _at_least(prefix + "weight_decay", self.weight_decay, 0.0)
        for i, beta in enumerate(self.betas):
            _in_unit_interval(f"{prefix}betas[{i}]", beta)
        _positive(prefix + "eps", self.eps)
        _at_least(prefix + "warmup_steps", self.warmup_steps, 0)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"{prefix}min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip is not None:
            _positive(prefix + "grad_clip", self.grad_clip, fix="; use null to turn clipping off")


@dataclass
class TrainSection:
    max_steps: int = 1000
    global_batch_size: int = 8  # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size: int = 8  # sequences per forward/backward on one rank
    precision: str = "bf16_autocast"  # fp32 | bf16_autocast | bf16 (bf16 weights, fp32 master copy)
    activation_checkpointing: int = 0  # 0: off; k: checkpoint every k-th block (1 = all)
    compile: bool = False
    compile_backend: str = "inductor"  # torch.compile backend; "aot_eager" traces without generating code
    cuda_graphs: bool = False  # replay forward+backward from CUDA graphs (fixed-shape batches; see runtime/train_graphs.py)
    fused_loss: bool = True  # our LMs: LM head + cross-entropy fused in chunks, no (B, S, vocab) logits kept
    seed: int = 0
    device: str = "auto"  # auto: cuda when available
    eval_every: int = 0  # steps; 0: only at the end (when there is eval data)
    eval_batches: int = 20
    log_every: int = 10
    save_every: int = 0  # steps; 0: no intermediate checkpoints
    keep_checkpoints: int = 0  # the newest N checkpoints are kept; 0: all
    output_dir: str = "runs/default"
    resume: str | None = None  # "auto": latest checkpoint in output_dir; or a checkpoint folder
    export: bool = True  # save_pretrained the final model into output_dir/final
    ema_decay: float | None = None
    profile_steps: int = 0  # > 0: torch.profiler trace of that many steps (after 2 warm-up steps)
    tensorboard: bool = False
    progress: bool = True
    peak_tflops: float | None = None  # for MFU; None: measured with a matmul at start
    deterministic: bool = False  # torch.use_deterministic_algorithms
    # A non-finite loss or gradient norm stops the run with an error naming the step (nothing is saved after
    # it). Off: the run goes on, but checkpoints and exports of non-finite steps are still skipped.
    stop_on_nonfinite: bool = True

    def validate(self, prefix: str) -> None:
        _choice(prefix + "precision", self.precision, PRECISIONS)
        _non_empty(prefix + "output_dir", self.output_dir)
        _non_empty(prefix + "device", self.device)
        if self.resume is not None:
            _non_empty(prefix + "resume", self.resume, fix="; use 'auto', a checkpoint folder, or null")
        if not 0 <= self.seed < 2**32:  # numpy's generators take seeds in [0, 2**32)
            raise ConfigError(f"{prefix}seed must lie in [0, 2**32), got {self.seed}")
        _positive(prefix + "max_steps", self.max_steps)
        _positive(prefix + "micro_batch_size", self.micro_batch_size)
        _positive(prefix + "global_batch_size", self.global_batch_size)
        for name in ("activation_checkpointing", "eval_every", "save_every", "keep_checkpoints", "profile_steps"):
            _at_least(prefix + name, getattr(self, name), 0)
        _positive(prefix + "eval_batches", self.eval_batches)
        _positive(prefix + "log_every", self.log_every)
        if self.peak_tflops is not None:
            _positive(prefix + "peak_tflops", self.peak_tflops, fix="; use null to measure it")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise ConfigError(f"{prefix}ema_decay must lie in (0, 1), got {self.ema_decay}")


@dataclass
class DistributedSection:
    strategy: str = "none"  # under torchrun: ddp, fsdp (FSDP2 fully_shard) or tp (DTensor tensor parallel)
    ddp_bf16_compress: bool = False  # torch.distributed's bf16 gradient-compression comm hook
    fsdp_reshard_after_forward: bool = True

    def validate(self, prefix: str) -> None:
        _choice(prefix + "strategy", self.strategy, STRATEGIES)
        # An option of another strategy would be ignored: the run would not do what the config says.
        if self.ddp_bf16_compress and self.strategy != "ddp":
            raise ConfigError(f"{prefix}ddp_bf16_compress=true compresses DDP's gradient all-reduce, and "
                              f"{prefix}strategy={self.strategy!r} has none; set {prefix}strategy=ddp, or drop it")
        if not self.fsdp_reshard_after_forward and self.strategy != "fsdp":
            raise ConfigError(f"{prefix}fsdp_reshard_after_forward=false applies to {prefix}strategy='fsdp', not "
                              f"{self.strategy!r}; set {prefix}strategy=fsdp, or drop it")


@dataclass
class ExperimentConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)

    def validate(self, prefix: str = "") -> None:
        if self.model.task == "causal_lm" and self.data.format in ("classification", "image_folder"):
            raise ConfigError(f"data.format={self.data.format!r} needs a classification task, not model.task='causal_lm'")
        if self.model.task != "causal_lm" and self.data.format not in ("classification", "image_folder", "synthetic"):
            raise ConfigError(f"model.task={self.model.task!r} needs data.format 'classification' or 'image_folder'")
        if self.model.task == "causal_lm" and self.data.seq_len < 2:  # a window of one token has nothing to predict
            raise ConfigError(f"data.seq_len must be >= 2 for model.task='causal_lm', got {self.data.seq_len}")

        if self.model.task == "causal_lm" and self.data.label_smoothing:  # the LM loss would silently ignore it
            raise ConfigError("data.label_smoothing applies to the classification tasks, not model.task='causal_lm'")
        if self.model.task != "image_classification" and (self.data.mixup_alpha or self.data.cutmix_alpha):
            raise ConfigError("data.mixup_alpha / data.cutmix_alpha mix images: they need "
                              f"model.task='image_classification', not {self.model.task!r}")
        if (self.data.mixup_alpha or self.data.cutmix_alpha) and self.train.micro_batch_size % 2:
            raise ConfigError("data.mixup_alpha / data.cutmix_alpha need an even train.micro_batch_size "
                              f"(timm's Mixup mixes rows in pairs), got {self.train.micro_batch_size}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------------------------
def _choice(key: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {choices}")


def _non_empty(key: str, value: str, fix: str = "") -> None:
    if not value.strip():  # an empty path reads as the current folder
        raise ConfigError(f"{key} is empty{fix}")


def _positive(key: str, value, fix: str = "") -> None:
    if value <= 0:
        raise ConfigError(f"{key} must be > 0, got {value}{fix}")


def _at_least(key: str, value, low) -> None:
    if value < low:
        raise ConfigError(f"{key} must be >= {low}, got {value}")


def _in_unit_interval(key: str, value) -> None:
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"{key} must lie in [0, 1), got {value}")


_YAML11_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(key: str, value, tp):
    """Check ``value`` against the annotation ``tp`` (and convert YAML lists to tuples, ints to floats)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            raise ConfigError(f"{key} may not be null (expected {_type_name(tp)})")
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(key, value, option)
            except ConfigError:
                continue
        raise ConfigError(f"{key}={value!r} has type {type(value).__name__}, expected {_type_name(tp)}")
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}={value!r}: expected a list of {len(args)} values ({_type_name(tp)})")
        return tuple(_coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} has type {type(value).__name__}, expected a mapping")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} has type {type(value).__name__}, expected bool (true/false)")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            hint = ""
            if isinstance(value, str) and _YAML11_FLOAT.fullmatch(value.strip()):
                hint = f" (YAML reads {value} as a string; write the integer out)"
            raise ConfigError(f"{key}={value!r} has type {type(value).__name__}, expected int{hint}")
        return value
    if tp is float:
        if isinstance(value, str) and _YAML11_FLOAT.fullmatch(value.strip()):
            value = float(value)  # PyYAML reads 1e-4 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r} has type {type(value).__name__}, expected float")
        if not math.isfinite(value):  # 1e999 parses as inf; nan and inf train to silent NaNs
            raise ConfigError(f"{key}={value!r} is not a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r} has type {type(value).__name__}, expected str")
        return value
    raise AssertionError(f"unhandled config annotation {tp} for {key}")


def from_dict(cls, data: dict | None, prefix: str = ""):
    """Build dataclass ``cls`` from a nested dict, naming any unknown or mistyped key by its dotted path."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in names]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), names, n=1)
        hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; known keys: {names}"
        raise ConfigError(f"unknown config key '{prefix}{key}'{hint}")
    kwargs = {}
    for name in names:
        if name not in data:
            continue
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = from_dict(tp, data[name], prefix=f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(f"{prefix}{name}", data[name], tp)
    obj = cls(**kwargs)
    obj.validate(prefix)
    return obj


def parse_override(text: str) -> tuple[list[str], object]:
    """``section.key=value`` -> (["section", "key"], value); the value is parsed as YAML (1e-4, true, [1, 2])."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        return path, yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({problem})") from None


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = _deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a section")
            node = child
        node[path[-1]] = value
    return data


def _deepcopy(data):
    return {k: _deepcopy(v) for k, v in data.items()} if isinstance(data, dict) else data


def load_config(source: str | Path | dict | None = None, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """An ``ExperimentConfig`` from a YAML file (or a dict), with ``section.key=value`` overrides applied.

    A YAML file may name a ``base:`` file (relative to itself) whose keys it extends."""
    data = _read_yaml(Path(source)) if isinstance(source, (str, Path)) else _deepcopy(source or {})
    return from_dict(ExperimentConfig, apply_overrides(data, list(overrides)))


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(f"{self.name}:{key_node.start_mark.line + 1}: key {key!r} is given twice in one "
                                  "mapping (only the last would count)")
            seen.add(key)
        return super().construct_mapping(node, deep)


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    loader = _UniqueKeyLoader(path.read_text())
    loader.name = str(path)
    try:
        data = loader.get_single_data() or {}
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: not valid YAML ({err.context + ', ' if err.context else ''}{err.problem})") from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of sections, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"{path}: base={base!r} must be the path of one YAML file (relative to {path.name})")
        chain = (*seen, path.resolve())
        if (path.parent / base).resolve() in chain:
            raise ConfigError(f"{path}: base {base!r} leads back to itself ({' -> '.join(p.name for p in chain)})")
        merged = _read_yaml(path.parent / base, chain)
        for section, values in data.items():
            if isinstance(values, dict) and isinstance(merged.get(section), dict):
                merged[section] = {**merged[section], **values}
            else:
                merged[section] = values
        data = merged
    return data
