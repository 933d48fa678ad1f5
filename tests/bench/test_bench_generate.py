"""The generation benchmark runs end to end on tiny models on the CPU (--dry-run); the GPU numbers come from
a GPU (``flash-models bench generate``)."""

import json
import time

import pytest
import torch

from flash_models.bench import generate


def test_generate_bench_dry_run(tmp_path):
    result = generate.main(["--dry-run", "--batches", "1", "2", "--prompts", "8", "--new-tokens", "64", "--repeats", "3",
                            "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "generate.json").read_text())["rows"]
    assert len(rows) == len(result.rows) == 2 * 2 * 2  # model x batch x (ours, hf)
    assert {r["impl"] for r in rows} == {"ours", "hf"}
    assert all(r["ms_per_step"] > 0 and r["tokens_per_s"] > 0 for r in rows)


def test_decode_steps_lost_in_the_noise_are_refused_not_reported():
    def prefill_slower_than_everything(n):  # a host that stalls in every short run: the difference goes negative
        time.sleep(0.002 if n == 1 else 0.0)

    with pytest.raises(RuntimeError, match="no measurable time beyond the prefill"):
        generate._per_step_ms(prefill_slower_than_everything, 8, 3, torch.device("cpu"))
    assert generate._per_step_ms(lambda n: time.sleep(0.001 * n), 8, 3, torch.device("cpu")) > 0
