import json
import re
from pathlib import Path

import pytest
import torch
import transformers

from flash_models.train import Trainer
from flash_models.train.checkpoint import check_resumed_config


def losses(trainer):
    return [h["loss"] for h in trainer.history]


def test_stopped_and_resumed_run_reproduces_losses_bit_for_bit(tiny_config, tmp_path):
    """Dropout on, EMA on, grad accumulation, warmup + cosine: all of it must continue exactly."""
    common = dict(model={"overrides": {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 257, "n_positions": 64,
                                       "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
                                       "bos_token_id": 256, "eos_token_id": 256}})
    full = Trainer(tiny_config(train={"max_steps": 6, "output_dir": str(tmp_path / "full"), "ema_decay": 0.9}, **common))
    full.fit()
    first = Trainer(tiny_config(train={"max_steps": 6, "output_dir": str(tmp_path / "cut"), "ema_decay": 0.9,
                                       "save_every": 3}, **common))
    for _ in range(3):  # "stop" after step 3, as a killed job would, right after its checkpoint
        first.history.append(first.train_step())
    first.save()
    del first
    resumed = Trainer(tiny_config(train={"max_steps": 6, "output_dir": str(tmp_path / "cut"), "ema_decay": 0.9,
                                         "resume": "auto"}, **common))
    assert resumed.step == 3
    resumed.fit()
    assert losses(resumed) == losses(full)[3:]  # exact float equality
    assert resumed.history[-1]["tokens_seen"] == full.history[-1]["tokens_seen"] == 6 * 4 * 32
    for a, b in zip(full.ema.shadow, resumed.ema.shadow):
        assert torch.equal(a, b)
    for (n, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), n


def test_checkpoint_is_atomic_and_latest_points_to_complete_one(tiny_config, tmp_path):
    trainer = Trainer(tiny_config(train={"max_steps": 3, "save_every": 1, "keep_checkpoints": 2,
                                         "output_dir": str(tmp_path / "r")}))
    trainer.fit()
    ckpts = tmp_path / "r" / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000003"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000002", "step_00000003"]  # no temp dirs
    state = torch.load(ckpts / "step_00000002" / "train_state.pt", weights_only=True)
    assert {"model", "optimizer", "scheduler", "sampler", "step"} <= set(state) and state["sampler"]["cursor"] > 0
    assert (ckpts / "step_00000002" / "rng_rank0.pt").is_file()


def test_export_is_hf_layout_and_metrics_log(tiny_config, tmp_path):
    out = tmp_path / "e"
    trainer = Trainer(tiny_config(train={"max_steps": 3, "export": True, "output_dir": str(out), "log_every": 1,
                                         "precision": "bf16_autocast"}))
    summary = trainer.fit()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "final")
    ids = torch.randint(0, 257, (1, 12))
    with torch.no_grad():
        assert torch.allclose(hf(ids).logits, trainer.model(ids).logits, atol=1e-5)
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines if "step" in l and "summary" not in l] == [1, 2, 3]
    assert lines[-1]["summary"] and summary["tokens_per_s"] > 0 and 0 < summary["mfu"] < 1
    assert summary["flops_per_token"] > 6 * 32 * 32 * 2


def test_pure_bf16_with_master_weights_and_activation_checkpointing(tiny_config):
    trainer = Trainer(tiny_config(train={"max_steps": 8, "precision": "bf16", "activation_checkpointing": 1},
                                  optim={"lr": 1e-2}))
    trainer.fit()
    assert next(trainer.model.parameters()).dtype == torch.bfloat16
    assert all(m.dtype == torch.float32 for m in trainer.master.masters())
    assert trainer.history[-1]["loss"] < trainer.history[0]["loss"]
    assert "CheckpointWrapper" in type(trainer.model.blocks[0]).__name__


def test_resumed_image_finetune_draws_the_same_augmentations(tiny_vit_config, tmp_path):
    """Random crops, flips and mixup/cutmix draw from the generators a checkpoint records, while the next step's
    batches load ahead: the resumed run continues with the uninterrupted run's losses exactly."""
    overrides = ("train.max_steps=4", "train.micro_batch_size=4", "train.ema_decay=null", "train.export=false")
    full = Trainer(tiny_vit_config(*overrides, f"train.output_dir={tmp_path / 'full'}"))
    full.fit()
    first = Trainer(tiny_vit_config(*overrides, f"train.output_dir={tmp_path / 'cut'}"))
    for _ in range(2):
        first.train_step()
    first.save()
    del first
    resumed = Trainer(tiny_vit_config(*overrides, f"train.output_dir={tmp_path / 'cut'}", "train.resume=auto"))
    resumed.fit()
    assert losses(resumed) == losses(full)[2:]


def test_resume_takes_the_configured_optimizer_settings_and_names_what_changed(tiny_config, tmp_path, caplog):
    """Loading the optimizer's and scheduler's states brought back the saved lr and weight decay, whatever the
    resuming config said."""
    Trainer(tiny_config(train={"save_every": 2})).fit()
    checkpoint = str(tmp_path / "run" / "checkpoints" / "step_00000002")
    same = Trainer(tiny_config(train={"resume": checkpoint}))
    with caplog.at_level("WARNING", logger="flash_models.train.checkpoint"):
        changed = Trainer(tiny_config(train={"resume": checkpoint}, optim={"lr": 1e-5, "weight_decay": 0.03}))
    factor = same.optimizer.param_groups[0]["lr"] / 3e-3  # the schedule's factor at step 2 (lr 3e-3 saved)
    assert 0 < factor < 1
    for group in changed.optimizer.param_groups:
        assert group["lr"] == 1e-5 * factor and group["initial_lr"] == 1e-5
    assert sorted(g["weight_decay"] for g in changed.optimizer.param_groups) == [0.0, 0.03]
    assert changed.scheduler.get_last_lr() == [1e-5 * factor] * 2
    assert "optim.lr=0.003 (now 1e-05)" in caplog.text and "optim.weight_decay=0.1 (now 0.03)" in caplog.text
    changed.fit()
    assert [h["lr"] for h in changed.history] == [1e-5 * changed.scheduler.lr_lambdas[0](s) for s in (2, 3)]


@pytest.mark.parametrize("change, named", [
    ({"model": {"overrides": {"n_layer": 3}}}, "model.overrides.n_layer=2 (now 3)"),
    ({"train": {"precision": "bf16"}}, "train.precision='fp32' (now 'bf16')"),
])
def test_resume_with_another_model_or_weight_precision_is_refused_naming_the_key(tiny_config, tmp_path, change, named):
    Trainer(tiny_config(train={"save_every": 2})).fit()
    checkpoint = str(tmp_path / "run" / "checkpoints" / "step_00000002")
    change = {**change, "train": {**change.get("train", {}), "resume": checkpoint}}
    if "model" in change:  # one field of the tiny model changed
        change["model"] = {"overrides": {**tiny_config().model.overrides, **change["model"]["overrides"]}}
    with pytest.raises(ValueError, match=re.escape(named)):
        Trainer(tiny_config(**change))


def test_tensor_parallel_checkpoints_in_rank_row_order_resume_only_with_the_same_ranks():
    saved = {"model": {"overrides": {}}, "distributed": {"strategy": "tp"}}
    check_resumed_config(saved, saved, saved_world=2, world=2, path=Path("ckpt"))
    with pytest.raises(ValueError, match="in its tensor-parallel ranks. row order"):
        check_resumed_config(saved, saved, saved_world=2, world=4, path=Path("ckpt"))
    with pytest.raises(ValueError, match="distributed.strategy='tp', and this run has 2 with 'ddp'"):
        check_resumed_config(saved, {**saved, "distributed": {"strategy": "ddp"}}, saved_world=2, world=2, path=Path("ckpt"))
    # saved with the fused rows in the canonical order: any strategy and number of ranks
    check_resumed_config(saved, {**saved, "distributed": {"strategy": "ddp"}}, saved_world=2, world=4, path=Path("ckpt"),
                         canonical_rows=True)
    check_resumed_config({**saved, "distributed": {"strategy": "none"}}, saved, saved_world=1, world=2, path=Path("ckpt"),
                         canonical_rows=True)


def test_pure_bf16_checkpoints_resume_on_their_side_of_fsdp():
    """Pure bf16 keeps fp32 master copies in the checkpoint except under FSDP, and TP's optimizer groups its shards
    apart: across those lines the masters or their optimizer state would not fit. fp32 and bf16 autocast
    checkpoints move between any strategies."""
    def config(precision, strategy):
        return {"model": {"overrides": {}}, "train": {"precision": precision}, "distributed": {"strategy": strategy}}

    for a, b in (("none", "ddp"), ("ddp", "none"), ("fsdp", "fsdp"), ("tp", "tp")):
        check_resumed_config(config("bf16", a), config("bf16", b), saved_world=1, world=2, path=Path("ckpt"),
                             canonical_rows=True)
    for a, b, fix in (("none", "fsdp", "none or ddp"), ("fsdp", "ddp", "fsdp"), ("tp", "none", "tp"), ("ddp", "tp", "none or ddp")):
        check_resumed_config(config("fp32", a), config("fp32", b), saved_world=1, world=2, path=Path("ckpt"),
                             canonical_rows=True)
        with pytest.raises(ValueError, match=f"precision='bf16' and distributed.strategy='{a}'.*resumes with "
                                             f"distributed.strategy={fix}"):
            check_resumed_config(config("bf16", a), config("bf16", b), saved_world=1, world=2, path=Path("ckpt"),
                                 canonical_rows=True)


def test_a_new_run_refuses_a_folder_of_checkpoints_and_starts_a_fresh_log(tiny_config, tmp_path):
    """Started without resume over another run's checkpoints, its step_00000002 sorted before their step_00000004:
    keep_checkpoints deleted the checkpoint just written and left ``latest`` naming it."""
    Trainer(tiny_config(train={"save_every": 2, "log_every": 1})).fit()
    with pytest.raises(ValueError, match="holds checkpoints of an earlier run \\(newest: step_00000004\\); continue it "
                                         "with train.resume=auto"):
        Trainer(tiny_config(train={"save_every": 2, "keep_checkpoints": 1}))
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text('{"step": 7, "loss": 1.0}\n')  # an earlier run that saved no checkpoint
    Trainer(tiny_config(train={"max_steps": 2, "log_every": 1, "output_dir": str(other)})).fit()
    steps = [json.loads(line).get("step") for line in (other / "metrics.jsonl").read_text().splitlines()]
    assert steps[:2] == [1, 2]


def test_keeping_one_checkpoint_after_resuming_an_earlier_one_keeps_the_new_one(tiny_config, tmp_path):
    Trainer(tiny_config(train={"max_steps": 6, "save_every": 2})).fit()
    checkpoints = tmp_path / "run" / "checkpoints"
    resumed = Trainer(tiny_config(train={"max_steps": 6, "save_every": 3, "keep_checkpoints": 1,
                                         "resume": str(checkpoints / "step_00000002")}))
    resumed.train_step()
    resumed.save()  # step 3: step 4 and 6 of the first run sort after it
    assert (checkpoints / "latest").read_text() == "step_00000003"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_00000003", "step_00000004", "step_00000006"]
    assert Trainer(tiny_config(train={"max_steps": 6, "resume": "auto"})).step == 3
