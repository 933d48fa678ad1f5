"""save_pretrained's HF arguments: ``max_shard_size`` with HF's units (a size that is not one is named, and nothing is
written), ``safe_serialization``."""

import pytest

import flash_models as fm
from flash_models.checkpoint.sizes import parse_size


@pytest.mark.parametrize("size, expected", [
    (12345, 12345), ("12345", 12345), ("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("10kb", 10**4),
    ("1.5GiB", 3 * 2**29), ("2 TB", 2 * 10**12), ("64KiB", 2**16), ("7B", 7),
])
def test_sizes_hf_accepts(size, expected):
    assert parse_size(size) == expected


@pytest.mark.parametrize("size, problem", [
    ("big", "is not a size"), ("10K", "is not a size"), ("5 gigs", "is not a size"), ("-1GB", "is not a size"),
    ("", "is not a size"), (0, "at least 1 byte"), (-5, "at least 1 byte"), ("0.0001KB", "at least 1 byte"),
    (5.0, "an int (bytes) or a string"), (True, "an int (bytes) or a string"),
])
def test_sizes_that_are_not_sizes_are_named(size, problem):
    with pytest.raises(ValueError, match="max_shard_size") as err:
        parse_size(size)
    assert problem in str(err.value)


def test_save_with_a_bad_shard_size_writes_nothing(tmp_path):
    model = fm.create_model("gpt2", n_layer=1, n_embd=32, n_head=4, vocab_size=67, n_positions=16)
    for size in (-5, 0, "10K"):
        with pytest.raises(ValueError, match="max_shard_size"):
            model.save_pretrained(tmp_path / "out", max_shard_size=size)
    assert list(tmp_path.iterdir()) == []


def test_hf_save_arguments(tmp_path):
    model = fm.create_model("gpt2", n_layer=1, n_embd=32, n_head=4, vocab_size=67, n_positions=16)
    model.save_pretrained(tmp_path / "safe", safe_serialization=True, max_shard_size="5GB")
    assert sorted(p.name for p in (tmp_path / "safe").iterdir()) == ["config.json", "model.safetensors"]
    with pytest.raises(ValueError, match="safe_serialization=False: flash-models writes safetensors only"):
        model.save_pretrained(tmp_path / "bin", safe_serialization=False)
    assert not (tmp_path / "bin").exists()


def test_a_model_without_weights_is_not_saved(tmp_path):
    model = fm.create_model("gpt2", n_layer=1, n_embd=32, n_head=4, vocab_size=67, n_positions=16, device="meta")
    with pytest.raises(ValueError, match="on the meta device: it has no weights to save"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()
