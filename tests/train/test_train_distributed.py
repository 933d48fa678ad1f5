"""DDP, FSDP2 and DTensor tensor parallelism on gloo with CPU processes launched by torchrun: the losses must
equal single-process training on the same global batches (within float tolerance); a run resumed from a
checkpoint continues exactly, under the strategy and number of ranks that wrote it or another; a setup that
cannot run is refused alike on every rank before the data is read; the README's torchrun command trains."""

import json
import os
from pathlib import Path

import pytest
import torch
import transformers

import flash_models as fm
from flash_models.train import ConfigError, Trainer, load_config, train
from flash_models.train import distributed as D
from flash_models.train.distributed import fused_row_order

from dist_launch import torchrun

WORKER = Path(__file__).with_name("dist_worker.py")
LLAMA = {"vocab_size": 257, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 64, "bos_token_id": 256, "eos_token_id": 256}


def run_workers(runs: dict, tmp_path: Path, *, ranks: int = 2, timeout: float = 300) -> dict:
    """dist_worker.py under torchrun on ``ranks`` gloo ranks: each run's results, by name."""
    config_file, out_file = tmp_path / "runs.json", tmp_path / "out.json"
    config_file.write_text(json.dumps(runs))
    proc = torchrun([str(WORKER), str(config_file), str(out_file)], ranks=ranks, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out_file.read_text())


def test_fused_row_order_gives_each_rank_its_own_heads():
    order = fused_row_order([4, 2, 2], 2)  # q 4 rows, k 2, v 2 -> rank 0: q0 q1 k0 v0 | rank 1: q2 q3 k1 v1
    assert order.tolist() == [0, 1, 4, 6, 2, 3, 5, 7]


def test_tensor_parallel_splits_are_checked_against_every_part():
    """The kv heads of a GQA model, the MLP width, and a model with no decoder blocks (BERT) are each named."""
    llama = fm.create_model("llama-1b", **{**LLAMA, "num_key_value_heads": 1}, device="meta")
    with pytest.raises(ValueError, match=r"LlamaForCausalLM's kv heads 1: not divisible by 2; launch .* \(none above 1\)"):
        D.check_tp(llama, 2)
    D.check_tp(fm.create_model("llama-1b", **LLAMA, device="meta"), 2)
    with pytest.raises(ValueError, match=r"MLP width 48: not divisible by 5; .* divides them all \(\[2\]\)"):
        D.check_tp(fm.create_model("llama-1b", **{**LLAMA, "intermediate_size": 48, "num_attention_heads": 2,
                                                  "num_key_value_heads": 2, "hidden_size": 16}, device="meta"), 5)
    bert = fm.create_model("bert-base", num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                           architectures=["BertForSequenceClassification"], num_labels=2, device="meta")
    with pytest.raises(ValueError, match="splits our decoder models .* not a BertForSequenceClassification; use "
                                         "distributed.strategy=ddp or fsdp"):
        D.check_tp(bert, 2)


def test_teardown_waits_at_a_barrier_only_after_a_run_that_went_well(monkeypatch):
    """A finished run: barrier, a GIL-free wait for the backend's threads, then leave the group. A failed one
    leaves at once (the other ranks may never reach a barrier); one process has no group to leave."""
    calls = []
    monkeypatch.setattr(D.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(D.dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(D.dist, "destroy_process_group", lambda: calls.append("destroy"))
    monkeypatch.setattr(D.time, "sleep", lambda seconds: calls.append(("sleep", seconds)))
    D.teardown(D.DistState(strategy="fsdp", world=2))
    assert calls == ["barrier", ("sleep", D.SETTLE_SECONDS), "destroy"] and D.SETTLE_SECONDS > 0
    calls.clear()
    D.teardown(D.DistState(strategy="ddp", world=2), failed=True)
    assert calls == ["destroy"]
    calls.clear()
    D.teardown(D.DistState())
    assert calls == []


def test_train_closes_without_the_barrier_after_an_error(tiny_config, monkeypatch):
    closed = []
    monkeypatch.setattr(Trainer, "close", lambda self, failed=False: closed.append(failed))
    monkeypatch.setattr(Trainer, "fit", lambda self: {"steps": 0})
    assert train(tiny_config()) == {"steps": 0}
    monkeypatch.setattr(Trainer, "fit", lambda self: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        train(tiny_config())
    assert closed == [False, True]


def test_ddp_fsdp_tp_match_single_process(tiny_config, tmp_path, corpus):
    configs = {}
    for family, overrides, name in (("gpt2", None, "gpt2"), ("llama", LLAMA, "llama-1b")):
        base = tiny_config(data={"packing": "documents", "eval": str(corpus)},
                           train={"max_steps": 4, "global_batch_size": 4, "micro_batch_size": 2, "eval_batches": 5})
        base = base.to_dict()
        if overrides is not None:
            base["model"] = {"name": name, "overrides": overrides, "attn_impl": "sdpa"}
        configs[family] = base
    runs = {}
    for family, base in configs.items():
        strategies = {"ddp": {"strategy": "ddp"}, "fsdp": {"strategy": "fsdp"}, "tp": {"strategy": "tp"}}
        if family == "gpt2":
            strategies["ddp_bf16"] = {"strategy": "ddp", "ddp_bf16_compress": True}
            strategies["fsdp_bf16"] = {"strategy": "fsdp"}  # bf16 compute over sharded fp32 master weights
            strategies["tp_bf16"] = {"strategy": "tp"}  # fp32 masters of TP shards: saved whole, resumed per rank
        for key, dist_cfg in strategies.items():
            run = json.loads(json.dumps(base))
            run["distributed"] = dist_cfg
            if key != "tp":  # 2 sequences per rank in micro-batches of 1: exercises no_sync / deferred reduce
                run["train"]["micro_batch_size"] = 1
            if key in ("fsdp_bf16", "tp_bf16"):
                run["train"]["precision"] = "bf16"
            if family == "llama" or key in ("ddp_bf16", "tp_bf16"):  # save at step 2, resume from it in a new Trainer
                run["check_resume"] = True
                run["train"]["save_every"] = 2
                run["train"]["ema_decay"] = 0.9
            run["train"]["output_dir"] = str(tmp_path / f"{key}-{family}")
            run["train"]["export"] = key == "tp"
            runs[f"{key}-{family}"] = run
    results = run_workers(runs, tmp_path)
    assert sorted(results) == sorted(runs)
    assert all("resumed_losses" in results[k] for k in runs if runs[k].get("check_resume"))

    for family, base in configs.items():
        base = json.loads(json.dumps(base))
        base["train"]["output_dir"] = str(tmp_path / f"single-{family}")
        single = Trainer(load_config(base))
        single.fit()
        reference = [h["loss"] for h in single.history]
        for key in results:
            if not key.endswith(family):
                continue
            got = results[key]["losses"]
            tol = 3e-2 if "bf16" in key else 1e-5  # bf16 gradients or compute: close to fp32, not equal
            assert len(got) == len(reference)
            for step, (a, b) in enumerate(zip(got, reference), 1):
                assert abs(a - b) <= tol * abs(b), f"{key} step {step}: {a} vs single-process {b}"
            if "resumed_losses" in results[key]:
                assert results[key]["resumed_losses"] == got[2:], f"{key}: resumed run differs"
            # evaluation: data-parallel ranks split the 5 batches (3 forwards each, the last one uncounted),
            # tensor-parallel ranks run them all; the loss is the single process's on the same weights
            micro = 2 if key.startswith("tp") else 1
            expected = single.evaluate() if micro == 2 else evaluate_with_micro_batch(single, micro)
            assert results[key]["eval_forwards"] == ([5, 5] if key.startswith("tp") else [3, 3]), key
            assert abs(results[key]["eval"]["eval_loss"] - expected["eval_loss"]) <= tol * expected["eval_loss"], key
            # data-parallel ranks draw their own dropout masks and augmentations; tensor-parallel ranks share one
            seeds = results[key]["seeds"]
            assert len(set(seeds)) == (1 if key.startswith("tp") else 2), (key, seeds)
        # fused/foreach AdamW takes one tensor kind per call: TP's DTensor matrices and plain norms/embeddings
        # must sit in separate groups (a mixed group failed on CUDA: "got mixed torch.Tensor and DTensor")
        kinds = results[f"tp-{family}"]["group_kinds"]
        assert all(len(k) == 1 for k in kinds) and {"DTensor", "Parameter"} <= {k[0] for k in kinds}, kinds
        qkv_rows = single.model.blocks[0].attn.qkv.out_features
        assert results[f"tp-{family}"]["local_qkv_rows"] == qkv_rows // 2
        # the TP export undoes the fused-row permutation: HF reads it and matches the single-process model
        hf = transformers.AutoModelForCausalLM.from_pretrained(results[f"tp-{family}"]["exported"])
        ids = torch.randint(0, 257, (1, 16))
        with torch.no_grad():
            assert torch.allclose(hf(ids).logits, single.model(ids).logits, atol=1e-4)


def evaluate_with_micro_batch(trainer, micro: int) -> dict:
    """``trainer.evaluate()`` with another micro-batch size (the distributed runs' own), for the same batches."""
    saved, trainer.cfg.train.micro_batch_size = trainer.cfg.train.micro_batch_size, micro
    try:
        return trainer.evaluate()
    finally:
        trainer.cfg.train.micro_batch_size = saved


def test_bert_classifier_ddp_and_fsdp_match_single_process(tmp_path, bert_example, tiny_bert_overrides):
    """Sequence classification on 2 gloo ranks: FSDP found no blocks in a BERT task head (a TypeError)."""
    config, tiny_sentiment = bert_example
    train, _ = tiny_sentiment(tmp_path)
    base = load_config(config, [*tiny_bert_overrides(tmp_path / "single", train, tokenizer="bytes"), "train.max_steps=3",
                                "train.micro_batch_size=2", "train.precision=fp32", "train.device=cpu",
                                "train.progress=false", "train.export=true", "train.ema_decay=0.5"]).to_dict()
    runs = {}
    for strategy in ("ddp", "fsdp"):
        run = json.loads(json.dumps(base))
        run["distributed"]["strategy"] = strategy
        run["train"]["output_dir"] = str(tmp_path / strategy)
        runs[f"{strategy}-bert"] = run
    results = run_workers(runs, tmp_path)
    single = Trainer(load_config(base))
    single.fit()
    reference = [h["loss"] for h in single.history]
    for key, result in results.items():
        assert result["losses"] == pytest.approx(reference, rel=1e-5), key
    # DDP's CPU state dict was the live weights: final_ema came out a copy of final
    from safetensors.torch import load_file

    weights = {run: {name: load_file(tmp_path / run / name / "model.safetensors") for name in ("final", "final_ema")}
               for run in ("single", "ddp", "fsdp")}
    for run in ("ddp", "fsdp"):
        for name in ("final", "final_ema"):
            for key, value in weights["single"][name].items():
                assert torch.allclose(weights[run][name][key], value, atol=1e-6), (run, name, key)
    assert not torch.equal(weights["ddp"]["final"]["classifier.weight"], weights["ddp"]["final_ema"]["classifier.weight"])


def test_other_strategies_options_are_refused():
    """An option of a strategy the run does not use would be ignored silently."""
    with pytest.raises(ConfigError, match=r"distributed.ddp_bf16_compress=true .*strategy='fsdp' has none; set distributed.strategy=ddp"):
        load_config({"distributed": {"strategy": "fsdp", "ddp_bf16_compress": True}})
    with pytest.raises(ConfigError, match=r"fsdp_reshard_after_forward=false applies to distributed.strategy='fsdp', not 'ddp'"):
        load_config({"distributed": {"strategy": "ddp", "fsdp_reshard_after_forward": False}})
    load_config({"distributed": {"strategy": "ddp", "ddp_bf16_compress": True}})
    load_config({"distributed": {"strategy": "fsdp", "fsdp_reshard_after_forward": False}})


def test_bad_distributed_setups_are_refused_alike_on_every_rank_before_the_data(tiny_config, tmp_path):
    """3 gloo ranks. A tensor-parallel size that does not divide the heads, or only the MLP width (GPT-2's fc1:
    a DTensor shape error inside the first step), a global batch smaller than the ranks, and torchrun without a
    strategy (3 separate runs writing one output_dir): each rank raises the same ValueError naming the key and
    the fix, before the data is tokenized into the cache."""
    wide = {"n_head": 6, "n_embd": 48, "n_inner": 50}  # heads divide by 3, the MLP width does not
    cases = {
        "tp-heads": ({"strategy": "tp"}, {}, {}, "query heads 4, kv heads 4, MLP width 128: not divisible by 3"),
        "tp-mlp": ({"strategy": "tp"}, wide, {}, "GPT2LMHeadModel's MLP width 50: not divisible by 3; launch a "
                   "number of ranks (torchrun --nproc-per-node) that divides them all ([2])"),
        "batch": ({"strategy": "ddp"}, {}, {"global_batch_size": 2, "micro_batch_size": 1},
                  "train.global_batch_size=2 must split into 3 data-parallel ranks x micro_batch_size=1 x accumulation "
                  "steps; set train.global_batch_size to a multiple of 3"),
        "none": ({"strategy": "none"}, {}, {}, "one of 3 that torchrun started, and distributed.strategy='none' "
                 "would train a separate copy in each"),
    }
    runs = {}
    for name, (distributed, model, train_overrides, _) in cases.items():
        config = tiny_config(data={"cache_dir": str(tmp_path / f"cache-{name}")},
                             train={"output_dir": str(tmp_path / name), **train_overrides}).to_dict()
        config["model"]["overrides"].update(model)
        runs[name] = {**config, "distributed": distributed, "expect_error": True}
    results = run_workers(runs, tmp_path, ranks=3, timeout=120)
    for name, (*_, message) in cases.items():
        raised = results[name]["raised"]
        assert len(set(raised)) == 1 and raised[0].startswith("ValueError: ") and message in raised[0], (name, raised)
        assert not (tmp_path / f"cache-{name}").exists(), f"{name}: the data was read before the refusal"


def test_checkpoints_resume_across_strategies_and_export_the_single_process_model(tmp_path, tiny_config):
    """A LLaMA with an EMA, saved at step 2 by one process and by DDP and TP on 2 gloo ranks, resumes under FSDP2
    (with activation checkpointing), TP and in one process: the losses continue the uninterrupted single-process
    run's (the EMA's names carried DDP's "module." prefix and the checkpoint wrapper's, a single process's
    optimizer state was keyed by position where FSDP's state-dict API reads names, TP saved its fused rows
    permuted). The FSDP2 export loads in fm and transformers with the
    single-process model's logits, and the files written are one process's (plus each rank's RNG state)."""
    def config(name, **train):
        base = tiny_config(data={"packing": "documents"},
                           train={"max_steps": 4, "ema_decay": 0.9, "output_dir": str(tmp_path / name), **train}).to_dict()
        base["model"] = {"name": "llama-1b", "overrides": LLAMA, "attn_impl": "sdpa"}
        return base

    uninterrupted = Trainer(load_config(config("uninterrupted")))
    uninterrupted.fit()
    reference = [h["loss"] for h in uninterrupted.history]
    Trainer(load_config(config("single-save", max_steps=2, save_every=2))).fit()
    step2 = "checkpoints/step_00000002"
    runs = {"ddp-save": {**config("ddp-save", max_steps=2, save_every=2, micro_batch_size=1),
                         "distributed": {"strategy": "ddp"}},
            "tp-save": {**config("tp-save", max_steps=2, save_every=2), "distributed": {"strategy": "tp"}},
            "fsdp-from-single": {**config("fsdp-from-single", resume=str(tmp_path / "single-save" / step2), export=True,
                                          activation_checkpointing=1), "distributed": {"strategy": "fsdp"}},
            "tp-from-single": {**config("tp-from-single", resume=str(tmp_path / "single-save" / step2)),
                               "distributed": {"strategy": "tp"}}}
    results = run_workers(runs, tmp_path)
    for name in ("ddp-save", "tp-save"):
        assert results[name]["losses"] == pytest.approx(reference[:2], rel=1e-5), name
    for name in ("fsdp-from-single", "tp-from-single"):
        assert results[name]["losses"] == pytest.approx(reference[2:], rel=1e-5), name
    for source in ("ddp", "tp"):  # TP's fused rows are saved in the canonical order: one process reads them
        resumed = Trainer(load_config(config(f"single-from-{source}", resume=str(tmp_path / f"{source}-save" / step2))))
        resumed.fit()
        assert [h["loss"] for h in resumed.history] == pytest.approx(reference[2:], rel=1e-5), source
        for got, expected in zip(resumed.ema.shadow, uninterrupted.ema.shadow, strict=True):
            assert torch.allclose(got, expected, atol=1e-5), source  # fp32 rounding through Adam's steps

    def files(name):
        folder = tmp_path / name
        return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())

    assert files("ddp-save") == sorted([*files("single-save"), f"{step2}/rng_rank1.pt"])
    umask = os.umask(0)
    os.umask(umask)
    for name in ("ddp-save", "single-save"):  # as open() makes files (mkstemp's owner-only 0600 hid it from others)
        assert (tmp_path / name / "checkpoints" / "latest").stat().st_mode & 0o777 == 0o666 & ~umask
    logged = [(tmp_path / name / "metrics.jsonl").read_text().splitlines() for name in ("ddp-save", "single-save")]
    assert len(logged[0]) == len(logged[1]) == 2  # the last step and the summary, once: rank 0 alone writes the log
    exported = results["fsdp-from-single"]["exported"]
    ids = torch.randint(0, 257, (2, 16))
    with torch.no_grad():
        expected = uninterrupted.model.eval()(ids).logits
        assert torch.allclose(fm.from_pretrained(exported)(ids).logits, expected, atol=1e-4)
        assert torch.allclose(transformers.AutoModelForCausalLM.from_pretrained(exported)(ids).logits, expected, atol=1e-4)


def test_the_readme_torchrun_command_trains_on_the_cpu_through_gloo(tmp_path, corpus):
    """README's `torchrun --standalone --nproc-per-node N -m flash_models train CONFIG distributed.strategy=fsdp`, on
    the CPU (gloo) with a tiny model: one summary on stdout (rank 0's), the export in place."""
    tiny = "{n_layer: 2, n_embd: 32, n_head: 4, vocab_size: 257, n_positions: 64, bos_token_id: 256, eos_token_id: 256}"
    args = ["-m", "flash_models", "train", "configs/gpt2-small.yaml", "train.device=cpu", "train.compile=false",
            "train.precision=fp32", "data.format=text", f"data.train={corpus}", "data.eval=null", "data.tokenizer=bytes",
            "data.seq_len=32", f"data.cache_dir={tmp_path / 'cache'}", f"model.overrides={tiny}", "train.max_steps=2",
            "train.global_batch_size=4", "train.micro_batch_size=2", "train.save_every=0", "train.progress=false",
            "train.peak_tflops=1", f"train.output_dir={tmp_path / 'run'}", "distributed.strategy=fsdp"]
    proc = torchrun(args, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout)
    assert summary["steps"] == 2 and summary["exported"] == str(tmp_path / "run" / "final")
    assert torch.isfinite(fm.from_pretrained(tmp_path / "run" / "final")(torch.randint(0, 257, (1, 8))).logits).all()
