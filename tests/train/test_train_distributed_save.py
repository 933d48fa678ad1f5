"""Training checkpoints stay atomic per folder under torch.distributed: 2 processes under torchrun (gloo on the
CPU here; NCCL on 2 GPUs in the gpu test) train with DDP and FSDP2, save, then fail the re-save of that
checkpoint on one rank, and rank 0's export. Every rank must raise (none waits forever at a barrier for a rank
that failed), the checkpoint must be byte for byte the one before, with no temporary folder left, and a resumed
run and the HF export must still load."""

import json
from pathlib import Path

import pytest
import torch

import flash_models as fm

from dist_launch import torchrun

WORKER = Path(__file__).with_name("dist_save_worker.py")


def _run_workers(tiny_config, tmp_path, device, strategies):
    runs = {}
    for strategy in strategies:
        config = tiny_config(train={"max_steps": 2, "global_batch_size": 4, "micro_batch_size": 1, "save_every": 2,
                                    "device": device, "export": True,
                                    "output_dir": str(tmp_path / strategy)}).to_dict()
        config["distributed"] = {"strategy": strategy}
        runs[strategy] = config
    config_file, out_file = tmp_path / "runs.json", tmp_path / "out.json"
    config_file.write_text(json.dumps(runs))
    proc = torchrun([str(WORKER), str(config_file), str(out_file)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out_file.read_text())
    for strategy in strategies:
        got = results[strategy]
        assert got["raised"]["fail_rank1"][1] == "OSError: disk full (simulated)"
        assert got["raised"]["fail_rank1"][0].startswith("RuntimeError: writing checkpoint "), got["raised"]
        assert "failed on rank(s) [1] (OSError: disk full (simulated)); the previous checkpoint is kept" in \
            got["raised"]["fail_rank1"][0]
        assert got["raised"]["fail_rank0"][0] == "OSError: disk full (simulated)"
        assert "failed on rank(s) [0]" in got["raised"]["fail_rank0"][1]
        assert got["raised"]["export_fail_rank0"] == [  # rank 1 raises too, instead of waiting for rank 0
            "OSError: disk full (simulated)",
            f"RuntimeError: exporting {tmp_path / strategy / 'final'} failed on rank(s) [0] (OSError: disk full "
            "(simulated)); an earlier export there is kept"]
        assert got["unchanged"], f"{strategy}: a failed re-save changed the checkpoint"
        assert got["checkpoint_files"] == ["rng_rank0.pt", "rng_rank1.pt", "train_state.pt"]
        assert got["checkpoints_dir"] == ["latest", "step_00000002"]  # no temporary folder left beside it
        assert got["resumed_step"] == 2 and len(got["resumed_losses"]) == 1
        assert got["hidden_left"] == []
        assert got["final_files"] == ["config.json", "model.safetensors"]
        with torch.no_grad():  # the export rank 0 swapped in loads and runs
            assert torch.isfinite(fm.from_pretrained(got["final"])(torch.randint(0, 257, (1, 8))).logits).all()
    return results


def test_distributed_save_is_atomic_on_gloo(tiny_config, tmp_path):
    """FSDP2 only on the CPU (the save's collectives are the same for every strategy; FSDP2 also gathers the
    sharded state), to keep CI short; the GPU test runs DDP too."""
    _run_workers(tiny_config, tmp_path, "cpu", ["fsdp"])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")
def test_gpu_distributed_save_is_atomic_on_nccl(tiny_config, tmp_path):
    _run_workers(tiny_config, tmp_path, "cuda", ["ddp", "fsdp"])
