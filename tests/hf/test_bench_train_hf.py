"""`bench train --hf-trainer --dry-run`: every Trainer side runs on tiny shapes and lands in the table."""

import json

from flash_models.bench.train import main


def test_hf_trainer_sides_dry_run(tmp_path):
    out = tmp_path / "bench.json"
    result = main(["--hf-trainer", "--dry-run", "--cases", "llama-1b", "--sides", "ours,hf,hf+fm_attention,hf+fm_attention+fused_ops", "--out", str(out)])
    rows = {r["side"]: r for r in result.rows}
    assert set(rows) == {"ours", "hf", "hf+fm_attention", "hf+fm_attention+fused_ops"}
    assert all(r["tokens_per_s"] > 0 and r["batch"] == 2 for r in rows.values())
    assert rows["hf"]["x_vs_hf"] == 1.0
    assert json.loads(out.read_text())["area"] == "train-hf-trainer"
