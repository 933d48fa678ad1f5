"""The hub path of from_pretrained, served from a local HF cache with the hub switched off (no network)."""

import pytest
import torch
import transformers
from huggingface_hub import constants

import flash_models as fm
from flash_models.testing import max_rel_err, random_hf_model


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def put_in_cache(cache, repo_id, files_from):
    """Lay out a snapshot as huggingface_hub's cache does: refs/main -> snapshots/<commit>/files."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for path in files_from.iterdir():
        (snapshot / path.name).write_bytes(path.read_bytes())


def test_hub_id_resolves_through_the_cache(offline_cache, tmp_path):
    hf = random_hf_model(transformers.GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4))
    hf.save_pretrained(tmp_path / "saved")
    put_in_cache(offline_cache, "someone/tiny-gpt2", tmp_path / "saved")
    ours = fm.from_pretrained("someone/tiny-gpt2")
    ids = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        assert max_rel_err(ours(ids).logits, hf(ids).logits) < 1e-5


def test_unknown_hub_id_is_a_clear_error(offline_cache):
    with pytest.raises(ValueError, match="not a local folder or .gguf file, and the HuggingFace Hub could not provide it"):
        fm.from_pretrained("nobody/does-not-exist")


def test_gguf_file_of_a_hub_repo_offline_is_a_clear_error(offline_cache):
    with pytest.raises(ValueError, match=r"'nobody/some-gguf' .* could not provide it with the file 'model\.gguf' "
                                         r"\(not in the local HF cache"):
        fm.from_pretrained("nobody/some-gguf", gguf_file="model.gguf")


def test_timm_weights_offline_are_a_clear_error(offline_cache):
    with pytest.raises(ValueError, match="timm could not download the weights of 'vit_tiny_patch16_224'"):
        fm.from_timm("vit_tiny_patch16_224", pretrained=True)
