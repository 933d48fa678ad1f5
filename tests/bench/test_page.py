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



def _run(tmp_path, name, *, area="train", device="Some GPU", case="gpt2", commit="abc1234"):
    result = BenchResult(area=area, env={"device": device, "date": "day " + name[-1], "torch": "9.9",
                                         "commit": commit, "command": f"flash-models bench {area} --cases {case}"})
    result.add(case=case, side="loop:ours", step_ms=10.0 + len(case))
    result.write_json(tmp_path / f"{name}.json")
    return tmp_path / f"{name}.json"


def test_runs_of_one_area_merge_into_one_section(tmp_path):
    """One case per process, one page section: every run's rows in the order given, every command and commit."""
    runs = [_run(tmp_path, "run1", case="gpt2"), _run(tmp_path, "run2", case="qwen2-0.5b", commit="def5678")]
    out = tmp_path / "results" / "train.json"
    page.main(["--merge", str(out), *map(str, runs)])
    merged = page.load(out)
    assert [row["case"] for row in merged.rows] == ["gpt2", "qwen2-0.5b"]
    assert merged.env["commit"] == "abc1234, def5678" and merged.env["date"] == "day 2"
    text = page.render(out.parent)
    assert "flash-models bench train --cases gpt2\nflash-models bench train --cases qwen2-0.5b" in text
    assert "| gpt2 | loop:ours |" in text and "| qwen2-0.5b | loop:ours |" in text


@pytest.mark.parametrize("other, message", [(dict(area="bert"), r"a 'bert' result.*one area at a time"),
                                            (dict(device="Other GPU"), r"ran with device 'Other GPU'")])
def test_runs_that_do_not_belong_together_are_not_merged(tmp_path, other, message):
    runs = [_run(tmp_path, "run1"), _run(tmp_path, "run2", **other)]
    with pytest.raises(ValueError, match=message):
        page.merge(runs)
    with pytest.raises(SystemExit):  # the command line says the same and writes nothing
        page.main(["--merge", str(tmp_path / "out.json"), *map(str, runs)])
    assert not (tmp_path / "out.json").exists()
