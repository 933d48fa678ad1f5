"""Training checkpoints cannot run code, are replaced whole, and a run never trains on (or saves) NaNs."""

import pickle

import pytest
import torch

import flash_models.train.checkpoint as train_checkpoint
from flash_models.checkpoint import UnsafeCheckpointError
from flash_models.train import ConfigError, NonFiniteLossError, Trainer, load_config


class FileCreatingPayload:
    """Unpickling this calls open(path, "w"): a stand-in for any code a crafted pickle would run."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def saved_run(tiny_config, tmp_path, steps=2):
    out = tmp_path / "run"
    trainer = Trainer(tiny_config(train={"max_steps": 4, "output_dir": str(out)}))
    for _ in range(steps):
        trainer.history.append(trainer.train_step())
    return trainer, trainer.save()


@pytest.mark.parametrize("victim", ["train_state.pt", "rng_rank0.pt"])
def test_crafted_checkpoint_is_refused_before_any_code_runs(tiny_config, tmp_path, victim):
    _, ckpt = saved_run(tiny_config, tmp_path)
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(FileCreatingPayload(tmp_path / "control")))  # the payload is live
    assert (tmp_path / "control").exists()
    state = torch.load(ckpt / victim, weights_only=True)
    state["extra" if victim == "train_state.pt" else "python"] = FileCreatingPayload(marker)
    torch.save(state, ckpt / victim)
    for resume in (str(ckpt), "auto"):
        with pytest.raises(UnsafeCheckpointError, match="arbitrary code") as err:
            Trainer(tiny_config(train={"max_steps": 4, "output_dir": str(tmp_path / "run"), "resume": resume}))
        assert str(ckpt / victim) in str(err.value) and "weights_only" not in str(err.value)
        assert not marker.exists()


def test_truncated_train_state_names_the_file(tiny_config, tmp_path):
    _, ckpt = saved_run(tiny_config, tmp_path)
    path = ckpt / "train_state.pt"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ValueError, match="truncated or corrupt") as err:
        Trainer(tiny_config(train={"max_steps": 4, "output_dir": str(tmp_path / "run"), "resume": "auto"}))
    assert str(path) in str(err.value)


def test_latest_pointing_outside_the_run_is_refused(tiny_config, tmp_path):
    saved_run(tiny_config, tmp_path)
    (tmp_path / "run" / "checkpoints" / "latest").write_text("../../elsewhere")
    with pytest.raises(ValueError, match="not a step_NNNNNNNN checkpoint folder"):
        Trainer(tiny_config(train={"max_steps": 4, "output_dir": str(tmp_path / "run"), "resume": "auto"}))


def test_crash_while_resaving_a_checkpoint_keeps_the_old_one(tiny_config, tmp_path, monkeypatch):
    trainer, ckpt = saved_run(tiny_config, tmp_path)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    real_save = torch.save

    def crash_on_rng(obj, path, *args, **kwargs):
        if str(path).endswith("rng_rank0.pt"):
            raise OSError("killed (simulated)")
        return real_save(obj, path, *args, **kwargs)

    trainer.history.append(trainer.train_step())
    trainer.step = 2  # save over the same step folder: the worst case, replacing a good checkpoint
    monkeypatch.setattr(train_checkpoint.torch, "save", crash_on_rng)
    with pytest.raises(OSError, match="simulated"):
        trainer.save()
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["latest", "step_00000002"]  # no temp folder left
    resumed = Trainer(tiny_config(train={"max_steps": 4, "output_dir": str(tmp_path / "run"), "resume": "auto"}))
    assert resumed.step == 2


@pytest.mark.parametrize("override, problem", [
    ({"optim": {"lr": float("inf")}}, r"optim\.lr=inf is not a finite number"),
    ({"optim": {"lr": float("nan")}}, r"optim\.lr=nan is not a finite number"),
    ({"optim": {"lr": 0.0}}, r"optim\.lr must be > 0"),
    ({"optim": {"betas": [0.9, 1.0]}}, r"optim\.betas\[1\] must lie in \[0, 1\)"),
    ({"optim": {"eps": 0.0}}, r"optim\.eps must be > 0"),
    ({"optim": {"weight_decay": -0.1}}, r"optim\.weight_decay must be >= 0"),
    ({"optim": {"warmup_steps": -5}}, r"optim\.warmup_steps must be >= 0"),
    ({"optim": {"grad_clip": 0.0}}, r"optim\.grad_clip must be > 0, got 0\.0; use null"),
    ({"optim": {"min_lr_ratio": 2.0}}, r"optim\.min_lr_ratio must lie in \[0, 1\]"),
    ({"train": {"save_every": -1}}, r"train\.save_every must be >= 0"),
    ({"data": {"label_smoothing": float("nan")}}, r"data\.label_smoothing=nan is not a finite number"),
    ({"train": {"seed": -1}}, r"train\.seed must lie in \[0, 2\*\*32\)"),  # numpy refused it mid-build
    ({"train": {"seed": 2**32}}, r"train\.seed must lie in \[0, 2\*\*32\)"),
    ({"data": {"format": "synthetic", "seq_len": 1}}, r"data\.seq_len must be >= 2 for model\.task='causal_lm'"),  # trained on nothing
    ({"model": {"task": "sequence_classification", "num_labels": 1}, "data": {"format": "classification", "train": "t"}},
     r"model\.num_labels must be >= 2"),
    ({"data": {"format": "text", "train": ""}}, r"data\.train is empty"),  # read the current folder as the corpus
    ({"train": {"output_dir": " "}}, r"train\.output_dir is empty"),
    ({"train": {"resume": ""}}, r"train\.resume is empty; use 'auto'"),
    ({"data": {"format": "synthetic", "label_smoothing": 0.1}}, r"data\.label_smoothing applies to the classification"),
    ({"data": {"format": "synthetic", "mixup_alpha": 0.8}}, r"mixup_alpha / data\.cutmix_alpha mix images"),
])
def test_numeric_config_values_are_checked(override, problem):
    with pytest.raises(ConfigError, match=problem):
        load_config({"data": {"format": "synthetic"}, **override})


def test_override_with_a_huge_number_is_refused():
    with pytest.raises(ConfigError, match=r"optim\.lr=inf is not a finite number"):
        load_config({"data": {"format": "synthetic"}}, ["optim.lr=1e999"])


DIVERGING = {"optim": {"lr": 1e12, "schedule": "constant", "grad_clip": None}}


def test_non_finite_loss_stops_the_run_naming_the_step(tiny_config, tmp_path):
    out = tmp_path / "run"
    trainer = Trainer(tiny_config(train={"max_steps": 5, "save_every": 1, "export": True, "output_dir": str(out)},
                                  **DIVERGING))
    with pytest.raises(NonFiniteLossError, match=r"step 2: the training loss is nan"):
        trainer.fit()
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000001"  # the good one; nothing saved after it
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000001"]
    state = torch.load(ckpts / "step_00000001" / "train_state.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
    assert not (out / "final").exists()


def test_switched_off_the_run_goes_on_but_never_saves_nan_weights(tiny_config, tmp_path):
    out = tmp_path / "run"
    trainer = Trainer(tiny_config(train={"max_steps": 4, "save_every": 1, "export": True, "output_dir": str(out),
                                         "stop_on_nonfinite": False}, **DIVERGING))
    summary = trainer.fit()
    assert summary["steps"] == 4 and trainer.first_nonfinite_step == 2
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000001"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000001"]
    assert summary["exported"] is None and not (out / "final").exists()


def test_export_replaces_the_previous_export_whole(tiny_config, tmp_path):
    out = tmp_path / "run"
    trainer = Trainer(tiny_config(train={"max_steps": 2, "output_dir": str(out)}))
    trainer.fit()
    final = trainer.export()
    (final / "README.md").write_text("my notes")
    (final / "model-00001-of-00002.safetensors").write_bytes(b"stale shard of an older export")
    trainer.history.append(trainer.train_step())
    trainer.export()
    assert sorted(p.name for p in final.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("device, problem", [("gpu", "not a device torch knows"), ("cuda", "CUDA is not available")])
def test_a_device_that_cannot_run_is_named(tiny_config, device, problem, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA, on any machine
    with pytest.raises(ValueError, match=f"train.device='{device}'.*{problem}"):
        Trainer(tiny_config(train={"device": device}))


def test_a_missing_data_path_is_named_by_its_key_from_python(tiny_config, tmp_path):
    """The CLI's preflight named it; Trainer(config) failed deep in the loader with the bare path."""
    with pytest.raises(FileNotFoundError, match=r"data\.eval: no data at .*nope\.jsonl.*data\.eval=null"):
        Trainer(tiny_config(data={"eval": str(tmp_path / "nope.jsonl")}))


def test_a_damaged_state_is_named_corrupt_and_a_missing_latest_folder_is_named(tiny_config, tmp_path):
    """Bytes that are no pickle at all were refused as 'pickled objects that could run code'; ``latest`` naming a
    deleted folder read as a truncated file."""
    import shutil

    _, ckpt = saved_run(tiny_config, tmp_path)
    (ckpt / "train_state.pt").write_bytes(b"this is not a checkpoint")
    with pytest.raises(ValueError, match="truncated or corrupt") as err:
        Trainer(tiny_config(train={"max_steps": 4, "output_dir": str(tmp_path / "run"), "resume": "auto"}))
    assert not isinstance(err.value, UnsafeCheckpointError)
    shutil.rmtree(ckpt)
    with pytest.raises(FileNotFoundError, match=f"names {ckpt.name}, which is not there"):
        Trainer(tiny_config(train={"max_steps": 4, "output_dir": str(tmp_path / "run"), "resume": "auto"}))


def test_overrides_on_a_pretrained_classifier_are_refused_not_ignored(tmp_path):
    """A pretrained BERT classifier (or an HF ViT folder) was loaded with its own config, the overrides dropped."""
    config = load_config({"model": {"name": "minilm", "pretrained": True, "task": "sequence_classification",
                                    "overrides": {"hidden_dropout_prob": 0.0}},
                          "data": {"format": "classification", "train": str(tmp_path / "rows.jsonl"), "tokenizer": "bytes"},
                          "train": {"device": "cpu", "output_dir": str(tmp_path / "run")}})
    (tmp_path / "rows.jsonl").write_text('{"text": "a", "label": 0}\n{"text": "b", "label": 1}\n')
    with pytest.raises(ValueError, match=r"\['hidden_dropout_prob'\] would be ignored"):
        Trainer(config)


def test_a_classifier_task_on_a_model_of_another_family_is_refused(tmp_path):
    """create_model('gpt2', architectures=['ViTForImageClassification']) built a GPT-2 LM for image classification;
    a decoder checkpoint for sequence classification failed with an AttributeError."""
    import flash_models as fm

    (tmp_path / "rows.jsonl").write_text('{"text": "a", "label": 0}\n{"text": "b", "label": 1}\n')
    fm.create_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=300).save_pretrained(tmp_path / "gpt2")
    text = {"format": "classification", "train": str(tmp_path / "rows.jsonl"), "tokenizer": "bytes"}
    images = {"format": "image_folder", "train": str(tmp_path)}
    cases = [
        ({"name": "gpt2", "task": "image_classification"}, images, r"trains a vit model, and 'gpt2' is a gpt2 preset"),
        ({"name": "llama-1b", "task": "sequence_classification"}, text, r"presets that fit: \['bert-base', 'bert-large'\]"),
        ({"name": str(tmp_path / "gpt2"), "pretrained": True, "task": "sequence_classification"}, text,
         "trains a BERT, and model.name is a GPT2LMHeadModel"),
        ({"name": str(tmp_path / "gpt2"), "task": "image_classification"}, images, "trains a ViT, and .* holds a GPT2LMHeadModel"),
    ]
    for model, data, problem in cases:
        config = load_config({"model": model, "data": data, "train": {"device": "cpu", "output_dir": str(tmp_path / "run")}})
        with pytest.raises(ValueError, match=problem):
            Trainer(config)
