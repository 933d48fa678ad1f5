"""`bench train` runs end to end on tiny shapes on the CPU (--dry-run): the plain-loop sides of ours and HF
start from the same weights and the rows say what they measured. Nothing here is timed."""

import json
import math

from flash_models.bench import train


def test_train_bench_dry_run_plain_loop_sides(tmp_path):
    out = tmp_path / "train.json"
    train.main(["--dry-run", "--cases", "gpt2,llama-1b", "--sides", "loop:ours,loop:hf,loop:hf+fm_attention", "--steps", "1",
                "--warmup", "0", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["case"], r["side"]) for r in rows] == [(c, s) for c in ("gpt2", "llama-1b") for s in ("loop:ours", "loop:hf", "loop:hf+fm_attention")]
    for case, vocab in (("gpt2", 257), ("llama-1b", 301)):
        by_side = {r["side"]: r for r in rows if r["case"] == case}
        assert all(r["vocab"] == vocab and r["tokens_per_s"] > 0 for r in by_side.values())
        # One step, no warm-up: the loss read is the first forward's, before any update, so the same weights
        # give the same loss (bf16 autocast on both sides).
        ours, hf = by_side["loop:ours"]["final_loss"], by_side["loop:hf"]["final_loss"]
        assert math.isclose(ours, hf, rel_tol=2e-2), (case, ours, hf)
        # HF's model with our attention (the reference kernels on the CPU) computes the same loss as with sdpa.
        assert math.isclose(by_side["loop:hf+fm_attention"]["final_loss"], hf, rel_tol=1e-3), case
        assert math.isclose(ours, math.log(vocab), rel_tol=0.2)  # a fresh model: about uniform
        for side in ("loop:ours", "loop:hf+fm_attention"):
            assert by_side[side]["x_vs_hf"] == by_side[side]["tokens_per_s"] / by_side["loop:hf"]["tokens_per_s"]
        assert "x_vs_hf_compile" not in by_side["loop:ours"]  # that side did not run


def test_cases_use_real_vocabularies_and_label_the_padded_ones():
    vocabs = {name: train.hf_config_for(case).vocab_size for name, case in train.CASES.items()}
    assert {vocabs[n] for n in ("gpt2", "gpt2-medium")} == {50257}
    assert (vocabs["llama-1b"], vocabs["smollm2-135m"], vocabs["smollm2-360m"], vocabs["qwen2-0.5b"]) == (32000, 49152, 49152, 151936)
    assert all(case.note for name, case in train.CASES.items() if vocabs[name] == 50304)
    assert train.hf_config_for(train.CASES["smollm2-360m"]).hidden_size == 960


def test_train_bench_dry_run_sft_case_pads_rows_and_counts_real_tokens(tmp_path):
    """An @sft case: right-padded rows with the attention mask and labels -100 at the padding, the same batches
    for both sides (the same first loss); tokens/s counts the real tokens; the Trainer's sides refuse it."""
    import pytest

    out = tmp_path / "sft.json"
    train.main(["--dry-run", "--cases", "llama-1b@sft", "--sides", "loop:ours,loop:hf", "--steps", "1", "--warmup", "0",
                "--out", str(out)])
    ours, hf = json.loads(out.read_text())["rows"]
    assert math.isclose(ours["final_loss"], hf["final_loss"], rel_tol=2e-2)
    case = train.DRY_CASES["llama-1b@sft"]
    batch = train._batch(case, 301, train.torch.device("cpu"), train.torch.Generator().manual_seed(0))
    real = batch["attention_mask"].bool()
    assert not real.all() and (batch["labels"][~real] == -100).all() and (batch["labels"][real] >= 0).all()
    assert ours["tokens_per_s"] * ours["step_ms"] * 1e-3 < case.batch * case.seq_len
    with pytest.raises(SystemExit, match="loop: sides only"):
        train.main(["--dry-run", "--cases", "llama-1b@sft", "--sides", "ours", "--out", str(tmp_path / "x.json")])


def test_train_bench_dry_run_eval_sides(tmp_path):
    """The eval: sides run the evaluation forward (eval mode, no grad, logits and loss) on an @sft case's padded
    batches: the same loss for the same weights on both sides, the model untouched (no optimizer step), the MFU
    of forward FLOPs, and the ratio against eval:hf."""
    out = tmp_path / "eval.json"
    train.main(["--dry-run", "--cases", "llama-1b@sft", "--sides", "eval:ours,eval:hf,loop:ours", "--steps", "2",
                "--warmup", "1", "--out", str(out)])
    ours, hf, loop = json.loads(out.read_text())["rows"]
    assert (ours["side"], hf["side"]) == ("eval:ours", "eval:hf")
    assert math.isclose(ours["final_loss"], hf["final_loss"], rel_tol=2e-2)
    assert ours["x_vs_hf"] == ours["tokens_per_s"] / hf["tokens_per_s"] and "x_vs_hf" not in loop
    assert math.isclose(ours["flops_per_token"] * 3, loop["flops_per_token"])
    step = train.loop_step("eval:ours", train.DRY_CASES["llama-1b@sft"], train.torch.device("cpu"))
    before = [p.clone() for p in step.model.parameters()]
    first = step(0)
    assert not step.model.training and not first.requires_grad and step.opt is None
    assert all(train.torch.equal(a, b) for a, b in zip(before, step.model.parameters())) and step(0) == first
