"""save_pretrained replaces a model folder as a whole: a reader sees the old checkpoint or the new one, never
a mix; stale weight files never survive; the folder's other files (tokenizer, README) are kept."""

import json
import os
import stat
import sys

import pytest
import torch
import transformers

import flash_models as fm
import flash_models.checkpoint.files as files


def tiny_gpt2(seed):
    torch.manual_seed(seed)
    return fm.create_model("gpt2", n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=16)


def same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def hidden_leftovers(folder):
    return [p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}.tmp-")]


def test_resave_sharded_as_one_file_leaves_no_old_shards_and_keeps_user_files(tmp_path):
    out = tmp_path / "model"
    tiny_gpt2(0).save_pretrained(out, max_shard_size=20_000)
    shards = sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()
    (out / "tokenizer.json").write_text('{"user": "file"}')
    (out / "notes").mkdir()
    (out / "notes" / "README.md").write_text("mine")
    torch.save({"stale": torch.randn(3)}, out / "pytorch_model.bin")  # an older layout, would shadow nothing but confuses
    second = tiny_gpt2(1)
    second.save_pretrained(out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes", "tokenizer.json"]
    assert (out / "tokenizer.json").read_text() == '{"user": "file"}'
    assert (out / "notes" / "README.md").read_text() == "mine"
    assert same_weights(fm.from_pretrained(out), second)
    assert not hidden_leftovers(out)


def test_crash_mid_save_leaves_the_old_folder_whole(tmp_path, monkeypatch):
    out = tmp_path / "model"
    first = tiny_gpt2(0)
    first.save_pretrained(out, max_shard_size=20_000)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls = []

    def crash_on_second_shard(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        return real_save(tensors, filename, metadata=metadata)

    real_save = files.save_file
    monkeypatch.setattr(files, "save_file", crash_on_second_shard)
    with pytest.raises(OSError, match="simulated"):
        tiny_gpt2(1).save_pretrained(out, max_shard_size=20_000)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert same_weights(fm.from_pretrained(out), first)
    assert not hidden_leftovers(out)  # the temporary folder is removed on failure


@pytest.mark.parametrize("exchange", [True, False])
def test_crash_between_renames_leaves_the_old_folder_whole(tmp_path, monkeypatch, exchange):
    """A save may rename things into place; failing at the second rename must not mix old and new files."""
    import flash_models.checkpoint.atomic as atomic

    out = tmp_path / "model"
    first = tiny_gpt2(0)
    first.save_pretrained(out, max_shard_size=20_000)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    if not exchange:  # a system without renameat2, which no public switch can make this one
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    real_replace, calls = os.replace, []

    def crash_on_second_rename(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("killed (simulated)")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_second_rename)
    second = tiny_gpt2(1)
    try:
        second.save_pretrained(out)
        crashed = False
    except OSError as err:
        assert "simulated" in str(err)
        crashed = True
    monkeypatch.undo()
    assert crashed == (not exchange)  # one renameat2 call has no second rename to fail at
    if crashed:
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert same_weights(fm.from_pretrained(out), first if crashed else second)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_swap_without_renameat2_is_still_whole(tmp_path, monkeypatch):
    """Where the kernel or filesystem cannot exchange two folders, the two-rename fallback is used."""
    import flash_models.checkpoint.atomic as atomic

    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)  # the system call, faked as unavailable
    out = tmp_path / "model"
    tiny_gpt2(0).save_pretrained(out, max_shard_size=20_000)
    (out / "tokenizer_config.json").write_text("{}")
    second = tiny_gpt2(1)
    second.save_pretrained(out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer_config.json"]
    assert same_weights(fm.from_pretrained(out), second)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_target_that_is_a_file_is_refused(tmp_path):
    target = tmp_path / "model"
    target.write_text("precious")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        tiny_gpt2(0).save_pretrained(target)
    assert target.read_text() == "precious"


def test_symlinked_target_keeps_its_link(tmp_path):
    real = tmp_path / "real"
    tiny_gpt2(0).save_pretrained(real)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    second = tiny_gpt2(1)
    second.save_pretrained(link)
    assert link.is_symlink() and os.path.realpath(link) == str(real)
    assert same_weights(fm.from_pretrained(link), second)


@pytest.mark.parametrize("where", [".", "sub"])
def test_saving_into_the_working_folder_keeps_the_process_in_it(tmp_path, monkeypatch, where):
    """``save_pretrained(".")`` (or into a parent of the working folder) swaps out the folder the process stands
    in: afterwards it stands at the same path in the new folder, so relative paths and a second save work."""
    out = tmp_path / "model"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    monkeypatch.chdir(out / where)
    target = "." if where == "." else ".."
    for seed in (0, 1):
        model = tiny_gpt2(seed)
        model.save_pretrained(target)
        assert os.getcwd() == str(out / where)
        assert {"config.json", "model.safetensors", "notes.txt", "sub"} <= set(os.listdir(target))
    assert same_weights(fm.from_pretrained(target), model)


def test_saved_folder_reads_in_transformers_after_resave(tmp_path):
    out = tmp_path / "model"
    tiny_gpt2(0).save_pretrained(out, max_shard_size=20_000)
    model = tiny_gpt2(1).eval()
    model.save_pretrained(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX permissions")
def test_a_saved_folder_has_the_mode_mkdir_gives(tmp_path):
    """The temporary folder becomes the saved one: it gets the umask's mode, as a folder transformers saves,
    not mkdtemp's owner-only 0700 (which hid every saved model from other users of a shared machine)."""
    old = os.umask(0o022)
    try:
        (tmp_path / "plain").mkdir()
        tiny_gpt2(0).save_pretrained(tmp_path / "m")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "m").stat().st_mode) == stat.S_IMODE((tmp_path / "plain").stat().st_mode) == 0o755
