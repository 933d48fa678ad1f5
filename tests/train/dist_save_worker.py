"""Run under torchrun with 2 processes by test_train_distributed_save.py: for each run in CONFIG_JSON (a
strategy on gloo/CPU or NCCL/CUDA), train 2 steps and save, then make the re-save of that checkpoint fail on
one rank (rank 1's RNG file, then rank 0's training state) and record what every rank raised and whether the
checkpoint folder changed, and make rank 0's export fail; then resume from it and export. Rank 0 writes the
results as JSON.

    torchrun --standalone --nproc-per-node 2 tests/train/dist_save_worker.py CONFIG_JSON OUT_JSON
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from flash_models.train import Trainer, load_config
from flash_models.train import checkpoint as train_checkpoint
from flash_models.train.distributed import leave_process_group


def folder_bytes(path: Path) -> dict:
    return {p.name: p.read_bytes().hex() for p in sorted(path.iterdir())}


def save_failing_on(trainer: Trainer, rank: int, file_name: str) -> str:
    """trainer.save() with torch.save raising on ``rank`` for ``file_name``: what this rank raised."""
    real_save = torch.save

    def failing(obj, path, *args, **kwargs):
        if dist.get_rank() == rank and str(path).endswith(file_name):
            raise OSError("disk full (simulated)")
        return real_save(obj, path, *args, **kwargs)

    train_checkpoint.torch.save = failing
    try:
        trainer.save()
    except Exception as err:  # noqa: BLE001 (recorded for the test to check)
        return f"{type(err).__name__}: {err}"
    finally:
        train_checkpoint.torch.save = real_save
    return "no error"


def export_failing_on_rank0(trainer: Trainer) -> str:
    """trainer.export() with rank 0's writing of the folder raising: what this rank raised."""
    def failing(state, directory):
        raise OSError("disk full (simulated)")

    if dist.get_rank() == 0:
        trainer._export_folder = failing
    try:
        trainer.export()
    except Exception as err:  # noqa: BLE001 (recorded for the test to check)
        return f"{type(err).__name__}: {err}"
    finally:
        trainer.__dict__.pop("_export_folder", None)
    return "no error"


def run(config: dict) -> dict:
    out = Path(config["train"]["output_dir"])
    trainer = Trainer(load_config(config))
    trainer.fit()  # save_every=2: checkpoints/step_00000002, and the export in final/
    ckpt = out / "checkpoints" / "step_00000002"
    before = folder_bytes(ckpt) if dist.get_rank() == 0 else None
    result = {"raised": {}}
    for rank, file_name in ((1, "rng_rank1.pt"), (0, train_checkpoint.STATE_FILE)):
        raised = [None] * dist.get_world_size()
        dist.all_gather_object(raised, save_failing_on(trainer, rank, file_name))
        result["raised"][f"fail_rank{rank}"] = raised
    raised = [None] * dist.get_world_size()  # a rank left at a barrier for rank 0 would hang here
    dist.all_gather_object(raised, export_failing_on_rank0(trainer))
    result["raised"]["export_fail_rank0"] = raised
    dist.barrier()
    if dist.get_rank() == 0:
        result["unchanged"] = folder_bytes(ckpt) == before
        result["checkpoint_files"] = sorted(before)
        result["checkpoints_dir"] = sorted(p.name for p in ckpt.parent.iterdir())
    resumed_config = json.loads(json.dumps(config))
    resumed_config["train"].update(resume="auto", max_steps=3)
    resumed = Trainer(load_config(resumed_config))
    result["resumed_step"] = resumed.step
    resumed.fit()
    result["resumed_losses"] = [h["loss"] for h in resumed.history]
    result["losses"] = [h["loss"] for h in trainer.history]
    if dist.get_rank() == 0:
        result["final"] = str(out / "final")
        result["final_files"] = sorted(p.name for p in (out / "final").iterdir())
        result["hidden_left"] = sorted(str(p.relative_to(out)) for p in out.rglob(".*"))
    return result


def main(config_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    runs = json.loads(Path(config_path).read_text())
    results = {name: run(config) for name, config in runs.items()}
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    leave_process_group()  # barrier, then leave: a bare destroy + exit can abort (see its docstring)


if __name__ == "__main__":
    assert "RANK" in os.environ, "run me with torchrun"
    main(sys.argv[1], sys.argv[2])
