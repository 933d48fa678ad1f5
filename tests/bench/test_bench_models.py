"""The BERT and ViT benchmarks run end to end on tiny shapes on the CPU (--dry-run): every grid point is
measured for ours and each peer, and our outputs match the peer's. The GPU numbers come from the device."""

import json

import torch

from flash_models.bench import bert, vit
from flash_models.cli import BENCH_AREAS


def test_bench_areas_are_registered():
    assert BENCH_AREAS["bert"] == "flash_models.bench.bert" and BENCH_AREAS["vit"] == "flash_models.bench.vit"


def test_bert_bench_dry_run(tmp_path):
    result = bert.main(["--dry-run", "--models", "bert-base", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "bert.json").read_text())["rows"]
    # seq x padding x (inference and training: 3 impls; the plain fine-tuning loop: ours and HF)
    assert len(rows) == len(result.rows) == 2 * 2 * (3 + 3 + 2)
    ours = [r for r in rows if r["impl"].startswith("ours")]  # ours+graphs: the packed bucket, eagerly on the CPU
    assert len(ours) == 20
    assert all(r["speedup"] > 0 and r["useful_tok_s"] > 0 and r["max_diff"] < 1e-4 for r in ours)
    assert any(r["padding"] != "0%" for r in ours), "the ~50% padding grid point is missing"
    finetune = [r for r in rows if r["mode"] == "finetune"]
    assert sorted({r["impl"] for r in finetune}) == ["HF sdpa", "ours"] and len(finetune) == 8
    # Every grid point compares the classifiers at the same starting weights, not after an earlier point's
    # steps (bf16 autocast rounds ours and HF's apart by ~1e-5 in a few steps)
    assert all(r["max_diff"] < 1e-6 for r in finetune if r["impl"] == "ours")


def test_vit_bench_dry_run(tmp_path):
    vit.main(["--dry-run", "--models", "vit-b16", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "vit.json").read_text())["rows"]
    impls = ("ours", "ours+graphs", "timm eager")  # graphs fall back to eager on the CPU; the code path still runs
    assert {(r["mode"], r["impl"]) for r in rows} == {(m, i) for m in ("inference", "training") for i in impls}
    ours = [r for r in rows if r["impl"].startswith("ours")]
    assert len(ours) == 4 and all("x_vs_timm_compile" not in r for r in ours)  # that peer did not run
    assert all(r["img_s"] > 0 and r["x_vs_timm_eager"] > 0 and r["max_diff"] < 1e-4 for r in ours)


def test_overhead_bench_dry_run(tmp_path):
    from flash_models.bench import overhead

    assert BENCH_AREAS["overhead"] == "flash_models.bench.overhead"
    overhead.main(["--dry-run", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "overhead.json").read_text())["rows"]
    measured = [r for r in rows if r["ours_us"] is not None]
    assert {r["op"] for r in measured} == set(overhead.pairs(torch.device("cpu"), torch.float32))
    assert {r["mode"] for r in measured} == {"forward", "inference", "forward+backward"}
    assert all(r["torch_us"] > 0 and r["ours_us"] > 0 for r in measured)
