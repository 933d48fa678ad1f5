"""Run under torchrun (gloo, CPU) by test_train_distributed.py: trains the same tiny models with DDP (+ bf16
compression hook), FSDP2 and tensor parallelism, and writes rank 0's per-step losses as JSON. A run marked
``expect_error`` records what each rank raised building its Trainer instead.

    torchrun --standalone --nproc-per-node N tests/train/dist_worker.py CONFIG_JSON OUT_JSON
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from flash_models.train import Trainer, load_config
from flash_models.train.distributed import leave_process_group


def refusals(config: dict) -> list[str]:
    """What each rank raised building a Trainer from ``config`` (every rank must raise: one that went on would
    wait forever in a collective for the others)."""
    try:
        Trainer(load_config(config))
        raised = "no error"
    except Exception as err:  # noqa: BLE001 (recorded for the test to check)
        raised = f"{type(err).__name__}: {err}"
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, raised)
    return gathered


def main(config_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # here, not in the Trainer: runs that refuse still gather their errors
    runs = json.loads(open(config_path).read())
    results = {}
    for name, config in runs.items():
        if config.pop("expect_error", False):
            results[name] = {"raised": refusals(config)}
            continue
        check_resume = config.pop("check_resume", False)
        trainer = Trainer(load_config(config))
        seeds = [None] * dist.get_world_size()  # of the generators the steps draw dropout and augmentations from
        dist.all_gather_object(seeds, torch.initial_seed())
        trainer.fit()
        results[name] = {"losses": [h["loss"] for h in trainer.history], "seeds": seeds,
                         "group_kinds": [sorted({type(p).__name__ for p in g["params"]}) for g in trainer.optimizer.param_groups]}
        if trainer.data.eval is not None:  # the forwards each rank runs in an evaluation, and its result
            forward, calls = trainer.forward, []
            trainer.forward = lambda batch, train: calls.append(train) or forward(batch, train=train)
            results[name]["eval"] = trainer.evaluate()
            trainer.forward = forward
            results[name]["eval_forwards"] = [None] * dist.get_world_size()
            dist.all_gather_object(results[name]["eval_forwards"], len(calls))
        if check_resume:  # a fresh trainer from the step-2 checkpoint continues exactly like the first one
            config["train"]["resume"] = config["train"]["output_dir"] + "/checkpoints/step_00000002"
            config["train"]["export"] = False
            resumed = Trainer(load_config(config))
            assert resumed.step == 2
            resumed.fit()
            results[name]["resumed_losses"] = [h["loss"] for h in resumed.history]
        if name.startswith("tp"):
            results[name]["local_qkv_rows"] = trainer.model.blocks[0].attn.qkv.weight.to_local().shape[0]
        if trainer.cfg.train.export and dist.get_rank() == 0:
            results[name]["exported"] = str(trainer.cfg.train.output_dir) + "/final"
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    leave_process_group()  # barrier, then leave: a bare destroy + exit can abort (see its docstring)


if __name__ == "__main__":
    assert "RANK" in os.environ, "run me with torchrun"
    main(sys.argv[1], sys.argv[2])
