"""The generation benchmark runs end to end on tiny models on the CPU (--dry-run); the GPU numbers come from
a GPU (``flash-models bench generate``)."""

import json

from flash_models.bench import generate


def test_generate_bench_dry_run(tmp_path):
    result = generate.main(["--dry-run", "--batches", "1", "2", "--prompts", "8", "--new-tokens", "32", "--repeats", "3",
                            "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "generate.json").read_text())["rows"]
    assert len(rows) == len(result.rows) == 2 * 2 * 2  # model x batch x (ours, hf)
    assert {r["impl"] for r in rows} == {"ours", "hf"}
    assert all(r["ms_per_step"] > 0 and r["tokens_per_s"] > 0 for r in rows)
