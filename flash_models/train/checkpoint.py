"""Training checkpoints: model, optimizer, scheduler, data position, EMA and every RNG state, written to a
temporary folder and swapped into place (checkpoint/atomic.py), so a crash never leaves a half-written
checkpoint. Loading them back reproduces an uninterrupted run exactly (bit for bit on the CPU).

Every file holds tensors and plain Python values only, and is read with ``weights_only=True``: a crafted
checkpoint folder cannot run code on resume (it is refused, naming the file).

Layout: ``OUTPUT/checkpoints/step_00000100/{train_state.pt, rng_rank0.pt, ...}`` and ``OUTPUT/checkpoints/latest``
(the name of the newest complete one). Model and optimizer state are full (unsharded) tensors gathered
through torch.distributed.checkpoint's state-dict API, keyed by parameter name, with tensor parallelism's
fused rows in the canonical order: one process, DDP, FSDP2 and TP, on any number of ranks, save and load the
same files (pure bf16's fp32 masters and their optimizer state are laid out per strategy: see
``check_resumed_config``).
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import uuid
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..checkpoint.atomic import owns_everything, swap_in, temp_folder_beside
from ..checkpoint.files import safe_torch_load
from . import distributed as D
from .distributed import DistState

log = logging.getLogger(__name__)

STATE_FILE = "train_state.pt"
# Marks a checkpoint whose tensor-parallel fused rows are saved in the canonical order (tensor-parallel ones
# without it hold each rank's row order and resume only with the same strategy and ranks).
CANONICAL = "canonical"
_STEP_NAME = re.compile(r"step_\d{8}")


def rng_state() -> dict:
    """Every generator's state as tensors and plain values (numpy's legacy tuple holds an ndarray)."""
    kind, key, pos, has_gauss, cached_gaussian = np.random.get_state()
    numpy_state = {"kind": kind, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
                   "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _model_and_optim_state(model, optimizer, dist_state: DistState, *, plain_optimizer: bool) -> tuple[dict, dict]:
    """Full (unsharded) model and optimizer state (collective under torchrun: every rank calls). The optimizer's
    is keyed by parameter name, in one process as under DDP or FSDP, so a checkpoint resumes under another
    strategy; an optimizer over fp32 master copies (``plain_optimizer``: no names) is keyed by position, its
    tensor-parallel shards gathered."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    if plain_optimizer:
        optim_sd = optimizer.state_dict()
        optim_sd["state"] = {key: {name: D.full_tensor(value) for name, value in values.items()}
                             for key, values in optim_sd["state"].items()}
    if dist_state.strategy == "none":
        return model.state_dict(), optim_sd if plain_optimizer else get_optimizer_state_dict(model, optimizer)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=options)
    if not plain_optimizer:
        optim_sd = get_optimizer_state_dict(model, optimizer, options=options)
    return model_sd, optim_sd


def _tp_rows(tensors: dict, model, optimizer, master, *, canonical: bool) -> dict:
    """The training state's tensors (``model``, ``optimizer``, ``ema``, ``master``: full tensors) with the fused
    projections' rows in the canonical order (``canonical=True``: what one process, DDP and FSDP hold, so a
    tensor-parallel checkpoint resumes under any strategy and number of ranks) or in ``model``'s tensor-parallel
    order (distributed.tp_row_layout). Unchanged for a model without tensor parallelism."""
    if not getattr(D.unwrap(model), "tp_row_orders", None):
        return tensors
    out = {**tensors, "model": D.tp_row_layout(tensors["model"], model, canonical=canonical)}
    if master is None:  # optimizer state keyed by parameter name
        state = D.tp_row_layout(tensors["optimizer"]["state"], model, canonical=canonical)
    else:  # fp32 masters: by position, in the masters' order and in the optimizer's
        in_masters, in_optimizer = _master_names(model, master, optimizer)
        state = _by_position(tensors["optimizer"]["state"], in_optimizer, model, canonical)
        out["master"] = _by_position(dict(enumerate(tensors["master"])), in_masters, model, canonical)
        out["master"] = [out["master"][i] for i in range(len(in_masters))]
    out["optimizer"] = {**tensors["optimizer"], "state": state}
    if tensors["ema"] is not None:
        names = tensors["ema"]["names"]
        shadow = D.tp_row_layout(dict(zip(names, tensors["ema"]["shadow"])), model, canonical=canonical)
        out["ema"] = {**tensors["ema"], "shadow": [shadow[name] for name in names]}
    return out


def _master_names(model, master, optimizer) -> tuple[list[str], list[str]]:
    """The state-dict names of the fp32 masters' parameters: in ``master.state_dict()``'s order and in the
    optimizer's (which groups tensor-parallel shards apart from plain tensors)."""
    name_of = {id(p): name for name, p in D.state_dict_names(model).items()}
    of_master = {id(m): name_of[id(p)] for p, m in master.pairs}
    return ([of_master[id(m)] for m in master.masters()],
            [of_master[id(m)] for group in optimizer.param_groups for m in group["params"]])


def _by_position(values: dict, names: list[str], model, canonical: bool) -> dict:
    """``values`` keyed by position ``i`` (parameter ``names[i]``) through ``tp_row_layout``."""
    out = D.tp_row_layout({names[i]: value for i, value in values.items()}, model, canonical=canonical)
    return {i: out[names[i]] for i in values}


def _grouped_as(optimizer, model, saved: dict) -> dict:
    """``saved`` (optimizer state keyed by parameter name) in ``optimizer``'s groups: tensor parallelism keeps its
    sharded and plain parameters in separate groups, the other strategies do not. The groups' settings are this
    run's (load_checkpoint keeps the configured ones anyway)."""
    if not all(isinstance(key, str) for key in saved["state"]):  # keyed by position: loads as it was saved
        return saved
    name_of = {id(p): name for name, p in D.state_dict_names(model).items()}
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [name_of[id(p)] for p in group["params"]]}
              for group in optimizer.param_groups]
    return {"state": saved["state"], "param_groups": groups}


def _shard_master_optimizer_state(optimizer) -> None:
    """After loading whole tensors into an optimizer over tensor-parallel masters: each state tensor becomes this
    rank's shard, as its parameter is."""
    for param, values in optimizer.state.items():
        for name, value in values.items():
            if hasattr(param, "device_mesh") and torch.is_tensor(value) and value.shape == param.shape:
                values[name] = D.shard_like(value, param)


def save_checkpoint(directory: Path, *, step: int, model, optimizer, scheduler, sampler, dist_state: DistState,
                    ema=None, master=None, extra: dict | None = None, keep: int | None = None) -> Path:
    """Write checkpoint ``step`` under ``directory`` (collective under torchrun: every rank calls).

    Atomic per folder on any number of ranks: rank 0 makes a temporary folder beside the target and writes the
    training state there, every rank writes its RNG state into it, and only when every rank reports its
    files written does rank 0 swap the folder in (checkpoint/atomic.py). A failure on any rank is reported to
    all of them (each raises, none waits forever at a barrier), and the previous checkpoint stays whole."""
    directory = Path(directory)
    final = directory / f"step_{step:08d}"
    model_sd, optim_sd = _model_and_optim_state(model, optimizer, dist_state, plain_optimizer=master is not None)
    tensors = {"model": model_sd, "optimizer": optim_sd,  # the EMA and the masters gather TP shards: every rank
               "ema": ema.state_dict() if ema is not None else None,
               "master": master.state_dict() if master is not None else None}
    tmp, failure = None, None
    try:
        try:
            if dist_state.is_main:
                tmp = temp_folder_beside(final)
                torch.save({
                    "step": step, **_tp_rows(tensors, model, optimizer, master, canonical=True), "rows": CANONICAL,
                    "scheduler": scheduler.state_dict(), "sampler": sampler.state_dict(), "extra": extra or {},
                }, tmp / STATE_FILE)
        except Exception as err:  # noqa: BLE001 (reported to every rank below, then raised)
            failure = err
        if dist_state.initialized:
            names = [tmp.name if tmp is not None else None]
            dist.broadcast_object_list(names, src=0)
            tmp = directory / names[0] if names[0] is not None else None
        try:
            if tmp is not None:
                torch.save(rng_state(), tmp / f"rng_rank{dist_state.rank}.pt")  # every rank's own generators
        except Exception as err:  # noqa: BLE001
            failure = failure or err
        raise_unless_every_rank_succeeded(dist_state, failure, f"writing checkpoint {final}")
        try:
            if dist_state.is_main:
                swap_in(tmp, final, owned=owns_everything)
                _write_text_atomic(directory / "latest", final.name)
                if keep:
                    _remove_older(directory, final, keep)
        except Exception as err:  # noqa: BLE001
            failure = err
        raise_unless_every_rank_succeeded(dist_state, failure, f"swapping in checkpoint {final}")
    finally:
        if dist_state.is_main and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already after the swap
    log.info("saved checkpoint %s", final)
    return final


def _remove_older(directory: Path, final: Path, keep: int) -> None:
    """Keep the ``keep`` newest checkpoints up to ``final``, the one just written. Later ones, left by a run that
    went further before this one resumed from an earlier checkpoint, are replaced as this run reaches them."""
    done = sorted(p for p in directory.iterdir() if _STEP_NAME.fullmatch(p.name) and p.name <= final.name)
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def check_no_checkpoints(output_dir: Path) -> None:
    """A run that resumes nothing must not write into a folder of another run's checkpoints: ``latest`` and the
    keep-N cleanup would mix the two runs' steps."""
    folder = output_dir / "checkpoints"
    found = sorted(p.name for p in folder.iterdir() if _STEP_NAME.fullmatch(p.name)) if folder.is_dir() else []
    if found:
        raise ValueError(f"train.output_dir={str(output_dir)!r} holds checkpoints of an earlier run (newest: {found[-1]}); "
                         "continue it with train.resume=auto, or start over in another train.output_dir (or delete "
                         f"{folder})")


def raise_unless_every_rank_succeeded(dist_state: DistState, failure: Exception | None, what: str, *,
                                      kept: str = "the previous checkpoint is kept") -> None:
    """Every rank learns whether every rank succeeded (a collective: in place of a barrier, which would leave
    the others waiting for a rank that failed): this rank's own error is raised as it is, another rank's
    error as a RuntimeError naming that rank (and ``kept``: what is left as it was)."""
    if not dist_state.initialized:
        if failure is not None:
            raise failure
        return
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    failed = {rank: report for rank, report in enumerate(reports) if report is not None}
    if failed:
        raise RuntimeError(f"{what} failed on rank(s) {sorted(failed)} ({'; '.join(failed.values())}); {kept}")


def _write_text_atomic(path: Path, text: str) -> None:
    """``path`` replaced whole by a file holding ``text``, with the umask's mode as ``open`` gives it (mkstemp's
    owner-only mode would hide ``latest`` from the other users who may read the checkpoints)."""
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:12]}"
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "w") as f:
        f.write(text)
    os.replace(tmp, path)


def find_checkpoint(resume: str, output_dir: Path) -> Path | None:
    """``resume="auto"``: the newest complete checkpoint of this run, or None; else the given folder."""
    if resume == "auto":
        latest = output_dir / "checkpoints" / "latest"
        if not latest.is_file():
            return None
        name = latest.read_text().strip()
        if not _STEP_NAME.fullmatch(name):  # a crafted file must not point outside this run's checkpoints
            raise ValueError(f"{latest} names {name!r}, not a step_NNNNNNNN checkpoint folder of this run")
        path = output_dir / "checkpoints" / name
        if not path.is_dir():
            raise FileNotFoundError(f"{latest} names {name}, which is not there (deleted?); resume from another "
                                    "checkpoint with train.resume=PATH, or delete the latest file to start over")
        return path
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"train.resume={resume!r}: no {STATE_FILE} there (give a checkpoints/step_* folder or 'auto')")
    return path


# Settings a resumed run may change freely: how it runs, evaluates, logs and saves, not what it computes.
_FREE_TO_CHANGE = {
    "model.attn_impl", "model.kernel_backend", "model.pretrained", "data.eval", "data.cache_dir",
    "train.max_steps", "train.micro_batch_size", "train.compile", "train.compile_backend", "train.cuda_graphs",
    "train.fused_loss", "train.device", "train.activation_checkpointing", "train.eval_every", "train.eval_batches",
    "train.log_every", "train.save_every", "train.keep_checkpoints", "train.output_dir", "train.resume", "train.export",
    "train.profile_steps", "train.tensorboard", "train.progress", "train.peak_tflops", "train.deterministic",
    "train.stop_on_nonfinite", "distributed.ddp_bf16_compress", "distributed.fsdp_reshard_after_forward",
}
# Settings that decide what the saved tensors are: a checkpoint is resumed with the values it was written with.
_FIXED = ("model.name", "model.task", "model.num_labels")


def _flatten(config: dict) -> dict:
    """Dotted keys; ``model.overrides`` (HF config fields) one key each."""
    flat = {f"{section}.{key}": value for section, values in config.items() for key, value in values.items()}
    flat.update({f"model.overrides.{key}": value for key, value in flat.pop("model.overrides", {}).items()})
    return flat


def check_resumed_config(saved: dict | None, current: dict, *, saved_world: int | None, world: int, path: Path,
                         canonical_rows: bool = False) -> None:
    """Compare the config a checkpoint was written with (``extra["config"]``) to the resuming run's.

    A different model, or a change that gives the saved tensors another meaning (pure bf16's fp32 master copies,
    tensor parallelism's permuted rows), raises naming the keys. Other changes (the optimizer's settings, the data,
    the seed, the global batch) are taken, with a warning naming them: the run then differs from an uninterrupted one."""
    if saved is None:
        return
    old, new = _flatten(saved), _flatten(current)
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k) and k not in _FREE_TO_CHANGE)

    def values(keys):
        return ", ".join(f"{k}={old.get(k)!r} (now {new.get(k)!r})" for k in keys)

    fixed = [k for k in changed if k in _FIXED or k.startswith("model.overrides.")]
    if fixed:
        raise ValueError(f"{path} holds a model built with {values(fixed)}; resume it with the settings it was "
                         "written with, or start a new run in another train.output_dir")
    if "train.precision" in changed and "bf16" in (old.get("train.precision"), new.get("train.precision")):
        raise ValueError(f"{path} was written with {values(['train.precision'])}: pure bf16 keeps fp32 master weights "
                         "the other precisions lack; resume with the precision it was written with")
    strategies = old.get("distributed.strategy"), new.get("distributed.strategy")
    permuted = strategies[0] == "tp" and not canonical_rows  # saved in the writing ranks' row order
    if permuted and ("distributed.strategy" in changed or saved_world not in (None, world)):  # None: not recorded
        raise ValueError(f"{path} was written by {saved_world} rank(s) with distributed.strategy={strategies[0]!r}, "
                         f"and this run has {world} with {strategies[1]!r}: this checkpoint holds its fused projections "
                         "in its tensor-parallel ranks' row order, so it resumes only with the strategy and number of "
                         f"ranks that wrote it; resume with distributed.strategy={strategies[0]} on {saved_world} "
                         "rank(s), or start a new run in another train.output_dir")
    # (a change to or from pure bf16 was refused above)
    kinds = [{"fsdp": "fsdp", "tp": "tp"}.get(strategy, "none or ddp") for strategy in strategies]
    if old.get("train.precision") == "bf16" and kinds[0] != kinds[1]:
        raise ValueError(f"{path} was written with train.precision='bf16' and distributed.strategy={strategies[0]!r}, "
                         f"and this run has {strategies[1]!r}: pure bf16's fp32 master weights and their optimizer "
                         "state are laid out per strategy (none and ddp alike; under FSDP the sharded parameters are "
                         f"the masters), so such a checkpoint resumes with distributed.strategy={kinds[0]}")
    changed = [k for k in changed if k != "distributed.strategy"]  # any other strategy saves full tensors
    if changed:
        log.warning("resuming %s with settings other than those it was written with: %s; the run continues with "
                    "the new values (the optimizer's too), so it is not the run that wrote the checkpoint continued",
                    path, values(changed))


def load_checkpoint(path: Path, *, model, optimizer, scheduler, sampler, dist_state: DistState, ema=None, master=None,
                    config: dict | None = None) -> tuple[int, dict]:
    """Restore everything ``save_checkpoint`` wrote; returns the step to continue after and the ``extra`` dict.

    ``config`` (the resuming run's, as a dict) is checked against the checkpoint's (``check_resumed_config``). The
    optimizer's settings (learning rate, weight decay, betas, eps) stay those the optimizer and scheduler were
    built with: loading their states would otherwise bring back the saved run's values silently."""
    state = safe_torch_load(path / STATE_FILE, what="training state")
    extra = state["extra"]
    saved_strategy = (extra.get("config") or {}).get("distributed", {}).get("strategy")
    canonical = state.get("rows") == CANONICAL or saved_strategy != "tp"
    if config is not None:
        check_resumed_config(extra.get("config"), config, saved_world=extra.get("world"), world=dist_state.world,
                             path=path, canonical_rows=canonical)
    if canonical:  # into this run's tensor-parallel row order, if it has one
        state.update(_tp_rows(state, model, optimizer, master, canonical=False))
    configured = [{k: v for k, v in group.items() if k not in ("params", "lr")} for group in optimizer.param_groups]
    optim_sd = state["optimizer"] if master is not None else _grouped_as(optimizer, model, state["optimizer"])
    if dist_state.strategy == "none":
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(optim_sd)
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, state["model"], options=options)
        if master is not None:
            optimizer.load_state_dict(optim_sd)
            _shard_master_optimizer_state(optimizer)
        else:
            set_optimizer_state_dict(model, optimizer, optim_sd, options=options)
    scheduler.load_state_dict(state["scheduler"])
    _keep_configured_hyperparameters(optimizer, scheduler, configured)
    sampler.load_state_dict(state["sampler"])
    if ema is not None:
        if state["ema"] is None:
            raise ValueError(f"{path} has no EMA weights but train.ema_decay is set")
        ema.load_state_dict(state["ema"])
    if master is not None:
        master.load_state_dict(state["master"])
    rng_file = path / f"rng_rank{dist_state.rank}.pt"
    if rng_file.is_file():
        set_rng_state(safe_torch_load(rng_file, what="RNG state"))
    else:
        log.warning("%s has no RNG state for rank %d (different world size?): continuing with fresh generators", path, dist_state.rank)
    return int(state["step"]), extra


def _keep_configured_hyperparameters(optimizer, scheduler, configured: list[dict]) -> None:
    """Put back the groups' settings from before the load, and the learning rate the (LambdaLR) schedule gives
    this step from the configured peak: unchanged settings give back exactly the loaded values."""
    for group, settings in zip(optimizer.param_groups, configured, strict=True):
        group.update(settings)
    scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
