"""The trainer on CUDA (skipped without a GPU; run on the device machine): packed documents through our flash
varlen attention, fused AdamW, bf16 autocast and pure bf16, torch.compile (inductor), and ours vs HF."""

import copy
import math

import pytest
import transformers

from flash_models.testing import ours_from_hf, random_hf_model
from flash_models.train import Trainer

pytestmark = pytest.mark.gpu

FLASH_GPT2 = {"n_layer": 2, "n_embd": 128, "n_head": 2, "vocab_size": 257, "n_positions": 128, "resid_pdrop": 0.0,
              "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 256, "eos_token_id": 256}


def gpu_config(tiny_config, **train):
    return tiny_config(model={"overrides": dict(FLASH_GPT2), "attn_impl": "flash"},
                       data={"packing": "documents", "seq_len": 64},
                       train={"device": "cuda", "max_steps": 8, "precision": "bf16_autocast", **train})


@pytest.mark.parametrize("precision", ["bf16_autocast", "bf16"])
def test_packed_flash_training(tiny_config, precision):
    trainer = Trainer(gpu_config(tiny_config, precision=precision))
    summary = trainer.fit()
    losses = [h["loss"] for h in trainer.history]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert trainer.optimizer.defaults["fused"] is True
    assert summary["peak_memory_bytes"] > 0 and 0 < summary["mfu"] < 1


def test_compiled_training_close_to_eager(tiny_config, tmp_path):
    runs = {}
    for compile_ in (False, True):
        trainer = Trainer(gpu_config(tiny_config, compile=compile_, output_dir=str(tmp_path / str(compile_))))
        trainer.fit()
        runs[compile_] = [h["loss"] for h in trainer.history]
    assert runs[True] == pytest.approx(runs[False], rel=2e-2)


def test_ours_tracks_hf_in_bf16(tiny_config, tmp_path):
    hf = random_hf_model(transformers.LlamaConfig(
        vocab_size=257, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=256, eos_token_id=256), seed=3)
    ours = ours_from_hf(hf)
    hf = copy.deepcopy(hf)
    losses = {}
    for name, model in (("ours", ours), ("hf", hf)):
        trainer = Trainer(tiny_config(data={"packing": "stream", "seq_len": 64},
                                      train={"device": "cuda", "max_steps": 10, "precision": "bf16_autocast",
                                             "output_dir": str(tmp_path / name)}), model=model)
        trainer.fit()
        losses[name] = [h["loss"] for h in trainer.history]
    assert losses["ours"] == pytest.approx(losses["hf"], rel=2e-2)


@pytest.mark.parametrize("precision,micro_batch", [("bf16_autocast", 2), ("bf16", 2), ("bf16_autocast", 4)])
def test_cuda_graph_training_equals_eager(tiny_config, tmp_path, precision, micro_batch):
    """Graphed micro-steps with two-step accumulation (micro batch 2) or none (4, where .grad is the graph's own
    buffer): the same losses and gradient norms as eager, step for step (a gradient buffer reused across
    micro-steps would change the norms), and one capture for the run."""
    runs = {}
    for graphs in (False, True):
        trainer = Trainer(tiny_config(
            model={"overrides": dict(FLASH_GPT2), "attn_impl": "flash"}, data={"packing": "stream", "seq_len": 64},
            train={"device": "cuda", "max_steps": 6, "precision": precision, "cuda_graphs": graphs,
                   "global_batch_size": 4, "micro_batch_size": micro_batch, "output_dir": str(tmp_path / str(graphs))}))
        trainer.fit()
        runs[graphs] = [h[key] for key in ("loss", "grad_norm") for h in trainer.history]  # flat: approx is not nested
        if graphs:
            assert len(trainer.graphs.graphed) == 1
    assert runs[True] == pytest.approx(runs[False], rel=1e-3)


def test_clipping_inside_fused_adamw_equals_clipping_the_gradients(tiny_config, tmp_path, monkeypatch):
    """Fused AdamW dividing by grad_scale (how the trainer clips on CUDA) gives the steps of multiplying the
    gradients by the clip coefficient first: a clip norm small enough that every step clips.

    In float32 with plain attention: the two ways round differently in the last bit, and under bf16 autocast
    (or a kernel with atomics) such a bit can flip a weight's bf16 rounding and grow into a 0.3% difference in a
    later step's gradient norm, which says nothing about the clipping."""
    runs = {}
    for inside in (True, False):
        if not inside:
            monkeypatch.setattr(Trainer, "_clips_in_optimizer", lambda self: False)  # the other way, not a setting
        trainer = Trainer(tiny_config(
            model={"overrides": dict(FLASH_GPT2), "attn_impl": "eager"}, data={"packing": "stream", "seq_len": 64},
            train={"device": "cuda", "max_steps": 5, "precision": "fp32", "output_dir": str(tmp_path / str(inside))},
            optim={"grad_clip": 0.05}))
        assert trainer._clips_in_optimizer() is inside
        trainer.fit()
        runs[inside] = [h[key] for key in ("loss", "grad_norm") for h in trainer.history]
        assert all(h["grad_norm"] > 0.05 for h in trainer.history)  # every step clipped
    assert runs[True] == pytest.approx(runs[False], rel=1e-3)


def test_cuda_graph_vit_finetune_equals_eager(tiny_vit_config, tmp_path):
    """Image classification under train.cuda_graphs (Mixup/CutMix eager, then the graphed loss of soft targets):
    the losses and gradient norms of eager training, one capture for the run."""
    runs = {}
    for graphs in (False, True):
        trainer = Trainer(tiny_vit_config("train.device=cuda", "train.precision=bf16_autocast", "train.max_steps=5",
                                          f"train.cuda_graphs={str(graphs).lower()}",
                                          f"train.output_dir={tmp_path / str(graphs)}"))
        trainer.fit()
        runs[graphs] = [h[key] for key in ("loss", "grad_norm") for h in trainer.history]
        if graphs:
            assert len(trainer.graphs.graphed) == 1
    assert runs[True] == pytest.approx(runs[False], rel=1e-3)


def test_cuda_graph_bert_finetune_equals_eager(tmp_path, bert_example, tiny_bert_overrides):
    """Text classification under train.cuda_graphs: rows packed into buckets by the collate, forward and
    backward replayed per bucket; losses and gradient norms follow eager training on padded batches (dropout
    off: the two runs draw their masks over different layouts). Byte tokens: the device machine does not carry
    MiniLM's embedded checkpoint."""
    from flash_models.train import load_config

    CONFIG, tiny_sentiment = bert_example
    train, _ = tiny_sentiment(tmp_path)
    runs = {}
    for graphs in (False, True):
        trainer = Trainer(load_config(CONFIG, tiny_bert_overrides(tmp_path / str(graphs), train, "bytes") + [
            "train.device=cuda", "train.precision=bf16_autocast", f"train.cuda_graphs={str(graphs).lower()}"]))
        trainer.fit()
        runs[graphs] = [h[key] for key in ("loss", "grad_norm") for h in trainer.history]
        if graphs:
            assert 1 <= len(trainer.graphs.graphed) <= 4
        trainer.close()
    assert runs[True] == pytest.approx(runs[False], rel=2e-2)
