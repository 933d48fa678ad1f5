"""Shared fixtures for the training tests: a small text corpus and tiny experiment configs on it."""

import random
from pathlib import Path

import pytest
import torch

from flash_models.train import load_config

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def write_corpus(path, n_docs=120, seed=0):
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30))) for _ in range(n_docs)]
    path.write_text("\n\n".join(docs))
    return path


@pytest.fixture(autouse=True)
def _train_tests_on_one_thread(one_thread):
    """Every training test steps tiny models: one intra-op thread (tests/conftest.py, ``one_thread``)."""
    yield


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "corpus.txt")


TINY_GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 257, "n_positions": 64,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 256, "eos_token_id": 256}


@pytest.fixture
def tiny_config(tmp_path, corpus):
    """A factory: a tiny GPT-2 on the byte tokenizer, fp32 on the CPU, with dict overrides per section."""

    def make(**sections):
        base = {
            "model": {"name": "gpt2", "overrides": dict(TINY_GPT2), "attn_impl": "sdpa"},
            "data": {"format": "text", "train": str(corpus), "tokenizer": "bytes", "seq_len": 32,
                     "cache_dir": str(tmp_path / "cache")},
            "train": {"max_steps": 4, "global_batch_size": 4, "micro_batch_size": 2, "precision": "fp32",
                      "device": "cpu", "output_dir": str(tmp_path / "run"), "progress": False, "export": False},
            "optim": {"lr": 3e-3, "warmup_steps": 1},
        }
        for section, values in sections.items():
            base[section] = {**base.get(section, {}), **values}
        return load_config(base)

    return make


@pytest.fixture
def tiny_vit_config(tmp_path):
    """A factory: configs/vit-finetune.yaml on a tiny random timm ViT (32 px, 2 blocks, 2 classes) and a generated
    two-colour image folder, with ``key=value`` overrides after the tiny ones."""
    from pathlib import Path

    from flash_models.testing import write_color_image_folder

    images = write_color_image_folder(tmp_path / "images")
    config = Path(__file__).resolve().parents[2] / "configs" / "vit-finetune.yaml"

    def make(*overrides):
        return load_config(config, [
            "model.name=vit_tiny_patch16_224", "model.pretrained=false", "model.num_labels=2",
            "model.overrides={img_size: 32, depth: 2}", "data.image_size=32", f"data.train={images}", "data.eval=null",
            "train.global_batch_size=8", "train.micro_batch_size=8", "train.device=cpu", "train.precision=fp32",
            "train.progress=false", "optim.warmup_steps=0", f"train.output_dir={tmp_path / 'run'}", *overrides])

    return make


@pytest.fixture
def bert_example(monkeypatch):
    """(CONFIG, tiny_sentiment) of examples/finetune_bert_classification.py: its YAML and a tiny labelled corpus."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples"))
    from finetune_bert_classification import CONFIG, tiny_sentiment

    return CONFIG, tiny_sentiment


@pytest.fixture
def tiny_bert_overrides():
    """Config overrides for a 2-layer random-init BERT classifier (MiniLM's tokenizer unless told otherwise,
    dropout off, head dim 32 for the flash kernels) on ``train``, 5 steps of 8 rows, writing to ``output_dir``."""

    def make(output_dir, train, tokenizer: str = "minilm") -> list[str]:
        model = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return ["model.name=bert-base", "model.pretrained=false", f"data.tokenizer={tokenizer}", f"data.train={train}",
                "data.eval=null", "data.seq_len=32", "train.max_steps=5", "train.global_batch_size=8",
                "train.micro_batch_size=8", f"train.output_dir={output_dir}",
                *(f"model.overrides.{k}={v}" for k, v in model.items())]

    return make
