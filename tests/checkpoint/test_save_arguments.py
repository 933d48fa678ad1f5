"""save_pretrained's HF arguments: ``max_shard_size`` with HF's units (a size that is not one is named, and nothing is
written), ``safe_serialization``."""

import pytest
import torch

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


def tiny_gpt2():
    return fm.create_model("gpt2", n_layer=1, n_embd=32, n_head=4, vocab_size=67, n_positions=16)


@pytest.mark.parametrize("kwargs, match", [
    (dict(push_to_hub=True), r"push_to_hub=True\) is not supported: .*upload_folder\(folder_path=save_directory"),
    (dict(repo_id="me/model"), r"repo_id= is for push_to_hub, which is not supported: .*upload_folder"),
    (dict(token="hf_x", commit_message="m"), r"commit_message=, token= are for push_to_hub"),
    (dict(variant="fp16"), r"variant='fp16'\) is not supported: .*a folder of its own"),
    (dict(save_original_format=False), r"save_original_format=False is not supported: .*safetensors.torch.save_file"),
    (dict(distributed_checkpoint=True), r"distributed_checkpoint=True\) is not supported"),
    (dict(is_main_process="yes"), r"is_main_process must be True or False"),
])
def test_transformers_save_options_not_implemented_are_refused_by_name(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_gpt2().save_pretrained(tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_an_unknown_save_option_is_a_type_error_with_the_closest_name(tmp_path):
    with pytest.raises(TypeError, match=r"max_shard_sise \(did you mean 'max_shard_size'\?\)"):
        tiny_gpt2().save_pretrained(tmp_path / "out", max_shard_sise="1GB")
    assert not (tmp_path / "out").exists()


def test_transformers_save_options_that_apply_keep_their_meaning(tmp_path):
    model = tiny_gpt2()
    # The neutral values of the refused options, and options with no effect here, are accepted.
    model.save_pretrained(tmp_path / "a", push_to_hub=False, token=None, variant=None, save_peft_format=False,
                          save_original_format=True, distributed_checkpoint=False, is_main_process=True)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["config.json", "model.safetensors"]
    # is_main_process=False: another process writes the checkpoint, this one nothing.
    model.save_pretrained(tmp_path / "b", is_main_process=False)
    assert not (tmp_path / "b").exists()


def test_save_a_given_state_dict(tmp_path):
    """state_dict= is saved in place of the model's own (as model.state_dict() gives it), in its dtype."""
    model = tiny_gpt2()
    state = {k: torch.randn_like(v).to(torch.bfloat16) for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path / "out", state_dict=state)
    back = fm.from_pretrained(tmp_path / "out", dtype="auto")
    assert back.dtype == torch.bfloat16
    for key, value in back.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert not torch.equal(back.state_dict()["embed.tokens.weight"], model.state_dict()["embed.tokens.weight"].bfloat16())


def test_a_state_dict_that_does_not_fit_is_named(tmp_path):
    model = tiny_gpt2()
    state = dict(model.state_dict())
    del state["norm_f.bias"]
    state["extra"] = torch.zeros(2)
    state["embed.tokens.weight"] = torch.zeros(3, 32)
    with pytest.raises(ValueError, match=r"(?s)missing keys \(1\): norm_f.bias.*unexpected keys \(1\): extra.*"
                                         r"embed.tokens.weight: expected \(67, 32\), got \(3, 32\)"):
        model.save_pretrained(tmp_path / "out", state_dict=state)
    assert not (tmp_path / "out").exists()
