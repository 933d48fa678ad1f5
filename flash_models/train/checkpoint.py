"""Training checkpoints: model, optimizer, scheduler, data position, EMA and every RNG state, written to a
temporary folder and swapped into place (checkpoint/atomic.py), so a crash never leaves a half-written
checkpoint. Loading them back reproduces an uninterrupted run exactly (bit for bit on the CPU).

Every file holds tensors and plain Python values only, and is read with ``weights_only=True``: a crafted
checkpoint folder cannot run code on resume (it is refused, naming the file).

Layout: ``OUTPUT/checkpoints/step_00000100/{train_state.pt, rng_rank0.pt, ...}`` and ``OUTPUT/checkpoints/latest``
(the name of the newest complete one). Model and optimizer state are full (unsharded) tensors gathered
through torch.distributed.checkpoint's state-dict API, so any strategy saves and loads the same files.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..checkpoint.atomic import owns_everything, swap_in, temp_folder_beside
from ..checkpoint.files import safe_torch_load
from .distributed import DistState

log = logging.getLogger(__name__)

STATE_FILE = "train_state.pt"
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
    if dist_state.strategy == "none":
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=options)
    optim_sd = optimizer.state_dict() if plain_optimizer else get_optimizer_state_dict(model, optimizer, options=options)
    return model_sd, optim_sd


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
    ema_sd = ema.state_dict() if ema is not None else None
    tmp, failure = None, None
    try:
        try:
            if dist_state.is_main:
                tmp = temp_folder_beside(final)
                torch.save({
                    "step": step, "model": model_sd, "optimizer": optim_sd, "scheduler": scheduler.state_dict(),
                    "sampler": sampler.state_dict(), "ema": ema_sd,
                    "master": master.state_dict() if master is not None else None, "extra": extra or {},
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
        _raise_unless_every_rank_succeeded(dist_state, failure, f"writing checkpoint {final}")
        try:
            if dist_state.is_main:
                swap_in(tmp, final, owned=owns_everything)
                _write_text_atomic(directory / "latest", final.name)
                if keep:
                    for old in sorted(directory.glob("step_*"))[:-keep]:
                        shutil.rmtree(old, ignore_errors=True)
        except Exception as err:  # noqa: BLE001
            failure = err
        _raise_unless_every_rank_succeeded(dist_state, failure, f"swapping in checkpoint {final}")
    finally:
        if dist_state.is_main and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already after the swap
    log.info("saved checkpoint %s", final)
    return final


def _raise_unless_every_rank_succeeded(dist_state: DistState, failure: Exception | None, what: str) -> None:
    """Every rank learns whether every rank succeeded (a collective: in place of a barrier, which would leave
    the others waiting for a rank that failed): this rank's own error is raised as it is, another rank's
    error as a RuntimeError naming that rank."""
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
        raise RuntimeError(f"{what} failed on rank(s) {sorted(failed)} ({'; '.join(failed.values())}); the "
                           "previous checkpoint is kept")


def _write_text_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
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
        return output_dir / "checkpoints" / name
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"train.resume={resume!r}: no {STATE_FILE} there (give a checkpoints/step_* folder or 'auto')")
    return path


def load_checkpoint(path: Path, *, model, optimizer, scheduler, sampler, dist_state: DistState, ema=None, master=None) -> tuple[int, dict]:
    """Restore everything ``save_checkpoint`` wrote; returns the step to continue after and the ``extra`` dict."""
    state = safe_torch_load(path / STATE_FILE, what="training state")
    if dist_state.strategy == "none":
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, state["model"], options=options)
        if master is not None:
            optimizer.load_state_dict(state["optimizer"])
        else:
            set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
    scheduler.load_state_dict(state["scheduler"])
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
    return int(state["step"]), state["extra"]
