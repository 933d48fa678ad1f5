"""docs/benchmarks.md is generated from the bench JSON in docs/results, never edited by hand."""

import json

import pytest

from flash_models.bench import page
from flash_models.bench.harness import BenchResult


def test_committed_page_is_what_the_results_render():
    assert page.PAGE.read_text() == page.render(page.RESULTS), (
        "docs/benchmarks.md differs from its results: run python -m flash_models.bench.page")


def test_every_section_shows_its_rows_with_their_provenance(tmp_path):
    result = BenchResult(area="train", env={"device": "Some GPU", "date": "run-date", "torch": "9.9",
                                            "commit": "abc1234", "command": "flash-models bench train --cases gpt2"})
    result.add(case="gpt2", side="ours", batch=16, seq=1024, step_ms=51.25, tokens_per_s=319712.4, x_vs_hf=2.07)
    result.add(case="gpt2", side="hf", batch=16, seq=1024, step_ms=106.0, tokens_per_s=154567.0, x_vs_hf=1.0)
    result.write_json(tmp_path / "train.json")
    text = page.render(tmp_path)
    assert "## Training" in text
    assert "Some GPU; run-date; torch 9.9; commit abc1234." in text
    assert "flash-models bench train --cases gpt2" in text
    assert "| gpt2 | ours | 16 | 1024 | 51.2 | 319,712 |" in text
    assert "mfu" not in text.split("## Training")[1]  # a column no row has is left out
    assert "No results are kept for: Attention: training shapes" in text


def test_a_result_no_section_shows_is_refused(tmp_path):
    (tmp_path / "mystery.json").write_text(json.dumps({"area": "mystery", "rows": [], "env": {}}))
    with pytest.raises(ValueError, match=r"mystery\.json"):
        page.render(tmp_path)


def test_a_file_that_is_not_a_result_is_named(tmp_path):
    (tmp_path / "train.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"train\.json is not a bench result"):
        page.render(tmp_path)

