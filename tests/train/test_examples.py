"""Every script in examples/ runs for a few steps at a tiny size on the CPU, in-process (runpy), so none rots."""

import json
import runpy
import sys
from pathlib import Path

import pytest
import transformers

EXAMPLES = Path(__file__).parents[2] / "examples"


def run_example(name, *args, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / name), *map(str, args)])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    return capsys.readouterr().out


def test_train_gpt2_then_generate(tmp_path, monkeypatch, capsys):
    out = run_example("train_gpt2.py", "--tiny", "--max-steps", 4, "--output-dir", tmp_path / "gpt2",
                      monkeypatch=monkeypatch, capsys=capsys)
    assert "final loss" in out and (tmp_path / "gpt2" / "final" / "model.safetensors").is_file()
    metrics = [json.loads(l) for l in (tmp_path / "gpt2" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["summary"] and metrics[-1]["steps"] == 4
    out = run_example("generate.py", "--model", tmp_path / "gpt2" / "final", "--tokenizer", "bytes",
                      "--max-new-tokens", 8, "alpha", monkeypatch=monkeypatch, capsys=capsys)
    assert 1 < len(out) <= 8 + 1  # up to 8 byte tokens of continuation and the newline


def test_finetune_bert_classification(tmp_path, monkeypatch, capsys):
    out = run_example("finetune_bert_classification.py", "--tiny", "--max-steps", 2, "--output-dir", tmp_path / "bert",
                      monkeypatch=monkeypatch, capsys=capsys)
    assert "eval accuracy" in out
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "bert" / "final")
    assert hf.config.num_labels == 2 and hf.config.hidden_size == 384  # the MiniLM encoder with a new head


def test_finetune_vit(tmp_path, monkeypatch, capsys):
    out = run_example("finetune_vit.py", "--tiny", "--max-steps", 2, "--output-dir", tmp_path / "vit",
                      monkeypatch=monkeypatch, capsys=capsys)
    assert "EMA accuracy" in out


@pytest.mark.slow
def test_sft_smollm2(tmp_path, monkeypatch, capsys):
    out = run_example("sft_smollm2.py", "--tiny", "--max-steps", 2, "--output-dir", tmp_path / "sft",
                      monkeypatch=monkeypatch, capsys=capsys)
    assert "final loss" in out and "eval loss" in out


@pytest.mark.parametrize("name, args, message", [
    ("sft_smollm2.py", ["--tiny", "--max-steps", 0], "train.max_steps must be > 0, got 0"),
    ("sft_smollm2.py", ["--tiny", "--max-steps", 0], "(in this script, --max-steps sets train.max_steps)"),
    ("train_gpt2.py", ["--data", "no-such-dir/*.txt"], "data.train: no data at 'no-such-dir/*.txt'"),
    ("train_gpt2.py", ["--data", "no-such-dir/*.txt"], "(in this script, --data sets data.train)"),
    ("finetune_bert_classification.py", [], "give --train (and --eval) with your data, or --tiny"),
    ("finetune_vit.py", ["--train", "no-such-folder"], "data.train: no data at 'no-such-folder'"),
    ("finetune_bert_classification.py", ["--train", "no-such.jsonl"], "(in this script, --train sets data.train)"),
    ("generate.py", [" "], "the prompt is empty"),
    ("generate.py", ["--max-new-tokens", 0, "Hi"], "--max-new-tokens must be at least 1, got 0"),
])
def test_example_mistakes_are_usage_errors_before_any_load(name, args, message, monkeypatch, capsys):
    """A step count of 0 is refused (not read as "not given"), a missing --train is named (not read as the path
    'None'), a config key the script sets is named with the script's option, and none of them is a traceback."""
    with pytest.raises(SystemExit) as exit_info:
        run_example(name, *args, monkeypatch=monkeypatch, capsys=capsys)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
