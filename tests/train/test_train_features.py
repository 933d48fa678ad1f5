"""Trainer features: activation checkpointing, EMA, TensorBoard + profiler trace, classification data, the CLI,
the optimizer's parameter groups and schedules, the benchmark helpers and `bench train --dry-run`."""

import json

import pytest
import torch
import yaml

from flash_models.checkpoint import create_model
from flash_models.train import Trainer
from flash_models.train.config import OptimSection
from flash_models.train.classification import TextClassification, collate_classification
from flash_models.train.config import DataSection
from flash_models.train.optim import lr_lambda, param_groups


def test_activation_checkpointing_gives_the_same_losses(tiny_config, tmp_path):
    runs = {}
    for every in (0, 1, 2):
        trainer = Trainer(tiny_config(train={"max_steps": 3, "activation_checkpointing": every,
                                             "output_dir": str(tmp_path / str(every))}))
        trainer.fit()
        runs[every] = [h["loss"] for h in trainer.history]
        wrapped = ["CheckpointWrapper" in type(b).__name__ for b in trainer.model.blocks]
        assert wrapped == [bool(every) and i % every == 0 for i in range(len(wrapped))]
    assert runs[1] == pytest.approx(runs[0], rel=1e-6) and runs[2] == pytest.approx(runs[0], rel=1e-6)


def test_activation_checkpointing_of_a_bert_classifier(tmp_path, bert_example, tiny_bert_overrides):
    """A BERT task head keeps its blocks in .bert.blocks: they were not found ("cannot find the transformer
    blocks"), and FSDP failed on them with a TypeError."""
    from flash_models.train import load_config

    config, tiny_sentiment = bert_example
    train, _ = tiny_sentiment(tmp_path)
    runs = {}
    for every in (0, 1):
        overrides = tiny_bert_overrides(tmp_path / str(every), train, tokenizer="bytes")
        trainer = Trainer(load_config(config, [*overrides, "train.max_steps=2", "train.precision=fp32", "train.device=cpu",
                                               "train.progress=false", "train.export=false",
                                               f"train.activation_checkpointing={every}"]))
        trainer.fit()
        runs[every] = [h["loss"] for h in trainer.history]
        assert all(("CheckpointWrapper" in type(b).__name__) == bool(every) for b in trainer.model.bert.blocks)
    assert runs[1] == pytest.approx(runs[0], rel=1e-6)


def test_ema_tracks_weights(tiny_config):
    trainer = Trainer(tiny_config(train={"max_steps": 3, "ema_decay": 0.5}))
    before = [s.clone() for s in trainer.ema.shadow]
    trainer.train_step()
    params = dict(trainer.model.named_parameters())
    for name, old, new in zip(trainer.ema.names, before, trainer.ema.shadow):
        assert torch.allclose(new, 0.5 * old + 0.5 * params[name].detach()), name


def test_ema_export_holds_the_averaged_weights(tiny_config, tmp_path):
    """On the CPU the exported state dict was the live weights: swapping the EMA in and out left final_ema a copy
    of final."""
    from safetensors.torch import load_file

    trainer = Trainer(tiny_config(train={"max_steps": 2, "ema_decay": 0.5, "export": True}))
    trainer.fit()
    final, ema = (load_file(tmp_path / "run" / name / "model.safetensors") for name in ("final", "final_ema"))
    params = dict(trainer.model.named_parameters())
    shadow = dict(zip(trainer.ema.names, trainer.ema.shadow))
    assert torch.equal(final["transformer.h.0.attn.c_attn.bias"], params["blocks.0.attn.qkv.bias"].detach())
    assert torch.equal(ema["transformer.h.0.attn.c_attn.bias"], shadow["blocks.0.attn.qkv.bias"])
    assert not torch.equal(ema["transformer.h.0.attn.c_attn.bias"], final["transformer.h.0.attn.c_attn.bias"])


def test_tensorboard_and_profiler_trace(tiny_config, tmp_path):
    pytest.importorskip("tensorboard")  # in the test extra; importorskip only for a bare install
    out = tmp_path / "tb"
    Trainer(tiny_config(train={"max_steps": 4, "tensorboard": True, "profile_steps": 1, "output_dir": str(out),
                               "log_every": 1})).fit()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert list((out / "profile").glob("*.json*"))


def test_param_groups_skip_biases_norms_embeddings():
    model = create_model("gpt2", n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    names = {id(p): n for n, p in model.named_parameters()}
    skipped = {names[id(p)] for p in no_decay["params"]}
    assert {"embed.tokens.weight", "embed.positions.weight", "norm_f.weight", "norm_f.bias", "blocks.0.attn.qkv.bias"} <= skipped


def test_schedules():
    cos = lr_lambda(OptimSection(schedule="cosine", warmup_steps=10, min_lr_ratio=0.1), 110)
    assert cos(0) == pytest.approx(0.1) and cos(9) == pytest.approx(1.0) and cos(10) == pytest.approx(1.0)
    assert cos(60) == pytest.approx(0.55) and cos(110) == pytest.approx(0.1)
    lin = lr_lambda(OptimSection(schedule="linear", warmup_steps=0, min_lr_ratio=0.0), 100)
    assert lin(50) == pytest.approx(0.5) and lin(100) == 0.0


def test_classification_rows_and_string_labels(tmp_path):
    from flash_models.train.data import ByteTokenizer

    class Tok:  # the HF call convention: tokenizer(texts, pairs, truncation=..., max_length=...)
        pad_token_id = 0

        def __call__(self, texts, pairs, truncation, max_length):
            ids = [ByteTokenizer().encode(t)[:max_length] for t in texts]
            return {"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids]}

    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"text": "good film", "label": "pos"}, {"text": "bad", "label": "neg"}, {"text": "fine", "label": "pos"}]))
    cfg = DataSection(format="classification", train=str(tmp_path / "c.jsonl"), seq_len=6)
    ds = TextClassification(cfg.train, Tok(), cfg)
    assert ds.label_names == ["neg", "pos"] and ds.labels == [1, 0, 1]
    batch = collate_classification([ds[0], ds[1]])
    assert batch["input_ids"].shape == (2, 6) and batch["attention_mask"][1].tolist() == [1, 1, 1, 0, 0, 0]
    (tmp_path / "v.jsonl").write_text(json.dumps({"text": "x", "label": "meh"}))
    with pytest.raises(ValueError, match="meh"):
        TextClassification(str(tmp_path / "v.jsonl"), Tok(), cfg, label_names=ds.label_names)


def test_classification_rows_in_byte_tokens(tmp_path):
    """data.tokenizer=bytes for text classification: the text, then EOS and the pair, cut to seq_len, with
    token_type_ids marking the pair."""
    from flash_models.train.data import ByteTokenizer

    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"text": "ab", "other": "cd", "label": 1}, {"text": "abcdef", "other": "g", "label": 0}]))
    cfg = DataSection(format="classification", train=str(tmp_path / "p.jsonl"), seq_len=5, text_pair_field="other")
    ds = TextClassification(cfg.train, ByteTokenizer(), cfg)
    eos = ByteTokenizer.eos_token_id
    assert ds[0]["input_ids"] == [97, 98, eos, 99, 100] and ds[0]["token_type_ids"] == [0, 0, 1, 1, 1]
    assert ds[1]["input_ids"] == [97, 98, 99, 100, 101] and ds[1]["token_type_ids"] == [0] * 5
    assert ds[1]["attention_mask"] == [1] * 5 and ds.labels == [1, 0] and ds[0]["pad_id"] == eos


def test_cli_train(tiny_config, tmp_path, capsys):
    from flash_models.cli import main

    cfg = tiny_config(train={"max_steps": 2}).to_dict()
    cfg["optim"]["betas"] = list(cfg["optim"]["betas"])
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    main(["train", str(path), "train.max_steps=3", f"train.output_dir={tmp_path / 'cli'}"])
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 3 and (tmp_path / "cli" / "metrics.jsonl").is_file()
    with pytest.raises(SystemExit):
        main(["train", str(path), "train.max_step=3"])
    assert "did you mean 'train.max_steps'" in capsys.readouterr().err


def test_cli_train_prints_the_summary_on_the_main_rank_only(tmp_path, capsys, monkeypatch):
    """Under torchrun every rank printed it (the others with no export)."""
    from flash_models import train as train_package
    from flash_models.cli import main

    (tmp_path / "exp.yaml").write_text("data: {format: synthetic}\n")
    monkeypatch.setattr(train_package, "train", lambda config, overrides: {"steps": 1})
    for rank, printed in (("1", ""), ("0", '{\n "steps": 1\n}\n')):
        monkeypatch.setenv("RANK", rank)
        main(["train", str(tmp_path / "exp.yaml")])
        assert capsys.readouterr().out == printed


def test_benchmark_helpers():
    from flash_models.bench.measure import benchmark_all, benchmark_memory

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    x = torch.randn(16, 32, requires_grad=True)
    timings = benchmark_all(model, x, repeats=3, warmup=1)
    assert set(timings) == {"forward", "backward", "fwd_bwd"} and all(t.median_ms > 0 for t in timings.values())
    assert benchmark_memory(model, x) >= 0


def test_bench_train_dry_run(tmp_path, capsys):
    from flash_models.bench.train import main

    result = main(["--dry-run", "--cases", "gpt2", "--out", str(tmp_path / "b.json")])
    sides = [r["side"] for r in result.rows]
    assert sides == ["ours", "hf"] and all(r["tokens_per_s"] > 0 for r in result.rows)
    assert result.rows[1]["x_vs_hf"] == 1.0
    assert all("x_vs_hf_compile" not in r for r in result.rows)  # hf+compile did not run: blank, not NaN
    assert json.loads((tmp_path / "b.json").read_text())["env"]["dry_run"] is True
    assert "DRY RUN" in capsys.readouterr().out


def test_compiled_training_matches_eager(tiny_config, tmp_path):
    """torch.compile through dynamo + AOTAutograd ("aot_eager": the same graphs inductor gets, without its C++
    code generation, which takes minutes on this CPU); the losses equal eager training."""
    runs = {}
    for compile_ in (False, True):
        trainer = Trainer(tiny_config(train={"max_steps": 3, "compile": compile_, "compile_backend": "aot_eager",
                                             "output_dir": str(tmp_path / str(compile_))}))
        trainer.fit()
        runs[compile_] = [h["loss"] for h in trainer.history]
    assert runs[True] == pytest.approx(runs[False], rel=1e-6)


@pytest.mark.parametrize("amp", [False, True])
def test_fused_lm_loss_equals_logits_path(amp):
    """return_logits=False (what the trainer uses): same loss and gradients, no logits kept."""
    import transformers

    from flash_models.testing import ours_from_hf, random_hf_model

    hf_cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = ours_from_hf(random_hf_model(hf_cfg, seed=2))
    ids = torch.randint(0, 97, (2, 13))
    labels = ids.clone()
    labels[0, :4] = -100
    results = []
    for return_logits in (True, False):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = model(ids, labels=labels, return_logits=return_logits)
        out.loss.backward()
        results.append((out.loss.detach(), [p.grad.clone() for p in model.parameters()]))
        assert (out.logits is None) == (not return_logits)
    (loss_a, grads_a), (loss_b, grads_b) = results
    tol = 2e-2 if amp else 1e-5
    assert torch.allclose(loss_a, loss_b, rtol=tol)
    for a, b in zip(grads_a, grads_b):
        assert torch.allclose(a, b, rtol=tol, atol=tol * a.abs().max().item())


def test_backward_runs_on_the_calling_thread_in_one_process(tiny_config, monkeypatch):
    """The micro-step's backward runs under flash_models.backward_on_this_thread when the run is one process,
    and under autograd's default threading when torchrun made it one of several (where DDP measured slower)."""
    trainer = Trainer(tiny_config(train={"max_steps": 1}))
    seen = []
    original = torch.Tensor.backward

    def recording_backward(tensor, *args, **kwargs):
        seen.append(torch._C._is_multithreading_enabled())
        return original(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "backward", recording_backward)
    trainer.train_step()
    assert seen and not any(seen) and torch._C._is_multithreading_enabled()  # one per micro-step, all off
    # A world of two without data parallelism runs no collective: this process stands for a rank of a torchrun
    # run, where a real second process would cost seconds.
    monkeypatch.setattr(trainer.dist, "world", 2)
    assert trainer.dist.dp_world == 1
    seen.clear()
    trainer.train_step()
    assert seen and all(seen)


def test_vit_finetune_reports_patch_tokens_images_per_second_and_mfu(tiny_vit_config):
    """Image classification counts a ViT's sequence (patches + class token) as its tokens, so tokens/s and MFU
    are those of the transformer; rows/s is images/s."""
    trainer = Trainer(tiny_vit_config("train.max_steps=2"))
    summary = trainer.fit()
    tokens_per_image = (32 // 16) ** 2 + 1
    assert trainer.tokens_per_image == tokens_per_image
    assert summary["tokens_seen"] == 2 * 8 * tokens_per_image
    assert summary["rows_per_s"] > 0 and summary["mfu"] > 0
    assert summary["tokens_per_s"] == pytest.approx(summary["rows_per_s"] * tokens_per_image)


def test_packed_classification_buckets():
    """Rows packed for CUDA-graph training: at most token_buckets shapes per row count, padding sequences no
    longer than seq_len, positions restarting per sequence, labels one per row."""
    from flash_models.train.classification import TOKEN_BUCKETS, collate_packed_classification
    from flash_models.runtime.train_graphs import MAX_SIGNATURES

    assert TOKEN_BUCKETS <= MAX_SIGNATURES  # every bucket of one row count fits the graphs' limit

    gen = torch.Generator().manual_seed(0)
    shapes = set()
    for trial in range(40):
        lengths = torch.randint(1, 17, (6,), generator=gen).tolist()
        items = [{"input_ids": [7] * n, "labels": i % 2, "pad_id": 0} for i, n in enumerate(lengths)]
        batch = collate_packed_classification(items, seq_len=16, token_buckets=4)
        tokens = batch["input_ids"].shape[1]
        offsets = batch["cu_seqlens"].tolist()
        shapes.add((tokens, len(offsets)))
        assert tokens % 24 == 0 and sum(lengths) <= tokens < sum(lengths) + 24  # quantum 6 x 16 / 4
        seq_lengths = [b - a for a, b in zip(offsets, offsets[1:])]
        assert seq_lengths[:6] == lengths and offsets[-1] == tokens
        assert all(0 <= n <= 16 for n in seq_lengths[6:])
        assert batch["position_ids"][0].tolist() == [p for n in seq_lengths for p in range(n)]
        assert batch["input_ids"][0, sum(lengths):].eq(0).all() and batch["labels"].tolist() == [0, 1] * 3
        fine = collate_packed_classification(items, seq_len=16)["input_ids"].shape[1]  # TOKEN_BUCKETS sizes
        assert fine % (96 // TOKEN_BUCKETS) == 0 and sum(lengths) <= fine < sum(lengths) + 96 // TOKEN_BUCKETS
    assert len({n for _, n in shapes}) == 1 and len(shapes) <= 4
    with pytest.raises(ValueError, match="longer than seq_len=16"):
        collate_packed_classification([{"input_ids": [1] * 17, "labels": 0, "pad_id": 0}], seq_len=16)


def test_param_groups_do_not_decay_a_vits_tokens_and_position_table():
    """timm's recipes (and configs/vit-finetune.yaml's weight decay) exempt them; they were decayed as matrices."""
    from flash_models import from_timm

    model = from_timm("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=1, num_classes=3)
    decay, no_decay = param_groups(model, 0.05)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {"cls_token", "pos_embed"} <= {names[id(p)] for p in no_decay["params"]}
    assert {names[id(p)] for p in decay["params"]} == {"patch_embed.weight", "head.weight"} | {
        f"blocks.0.{n}.weight" for n in ("attn.qkv", "attn.out_proj", "mlp.fc1", "mlp.fc2")}


def test_classes_beyond_num_labels_are_refused_and_the_export_names_the_classes(tmp_path, bert_example, tiny_bert_overrides):
    """Labels outside the head failed mid-step in cross-entropy, without naming model.num_labels; string labels were
    exported as LABEL_0.. instead of their names."""
    import transformers

    from flash_models.train import load_config

    config, _ = bert_example
    names = ["pos", "neg", "neutral"]
    rows = [{"text": f"row {i} " * (i % 5 + 1), "label": names[i % 3]} for i in range(16)]
    (tmp_path / "three.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    overrides = tiny_bert_overrides(tmp_path / "run", tmp_path / "three.jsonl", tokenizer="bytes") + [
        "train.max_steps=1", "train.precision=fp32", "train.device=cpu", "train.progress=false"]
    with pytest.raises(ValueError, match=r"3 classes \['neg', 'neutral', 'pos'\].*set model\.num_labels=3"):
        Trainer(load_config(config, overrides))
    (tmp_path / "ids.jsonl").write_text("\n".join(json.dumps({"text": r["text"], "label": i % 3}) for i, r in enumerate(rows)))
    with pytest.raises(ValueError, match=r"labels \[2\] outside 0\.\.1 \(model\.num_labels=2\)"):
        Trainer(load_config(config, [*overrides, f"data.train={tmp_path / 'ids.jsonl'}"]))
    Trainer(load_config(config, [*overrides, "model.num_labels=4", "train.export=true"])).fit()
    hf = transformers.AutoConfig.from_pretrained(tmp_path / "run" / "final")
    assert hf.id2label == {0: "neg", 1: "neutral", 2: "pos", 3: "LABEL_3"}
    assert hf.label2id == {"neg": 0, "neutral": 1, "pos": 2, "LABEL_3": 3}


def test_an_eval_image_class_the_training_images_lack_is_named(tmp_path):
    """timm dropped its images without a word: the eval accuracy covered the other classes only."""
    import shutil

    from flash_models.testing import write_color_image_folder
    from flash_models.train.classification import ImageFolderData

    train = ImageFolderData(str(write_color_image_folder(tmp_path / "train", images_per_class=2, size=8)),
                            image_size=8, train=True)
    shutil.copytree(tmp_path / "train", tmp_path / "eval")
    shutil.copytree(tmp_path / "train" / "red", tmp_path / "eval" / "green")
    with pytest.raises(ValueError, match=r"has classes \['green'\] that the training images lack"):
        ImageFolderData(str(tmp_path / "eval"), image_size=8, train=False, class_to_idx=train.class_to_idx)
    shutil.rmtree(tmp_path / "eval" / "green")
    assert len(ImageFolderData(str(tmp_path / "eval"), image_size=8, train=False, class_to_idx=train.class_to_idx)) == 4


def test_a_model_without_an_hf_layout_is_refused_export_before_training(tiny_vit_config):
    """A timm ViT with average pooling has no HF layout: export failed after the last step."""
    overrides = ("model.overrides={img_size: 32, depth: 1, global_pool: avg}", "train.max_steps=1")
    with pytest.raises(ValueError, match="train.export=true saves the final model in HF layout.*set train.export=false"):
        Trainer(tiny_vit_config(*overrides, "train.export=true"))
    trainer = Trainer(tiny_vit_config(*overrides, "train.export=false"))
    trainer.fit()
    assert len(trainer.history) == 1
