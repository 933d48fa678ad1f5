"""Training semantics: the positional limit of packed documents, and micro-batches without a labelled token."""

import copy

import pytest
import torch

import flash_models as fm
from flash_models.train import Trainer
from tests.train.conftest import TINY_GPT2


def test_packed_rows_longer_than_the_position_table_train(tiny_config):
    """micro_batch_size rows of seq_len = n_positions pack into one row twice the table: positions restart at
    every document, so only the documents must fit."""
    cfg = tiny_config(model={"overrides": {**TINY_GPT2, "n_positions": 32}}, data={"seq_len": 32},
                      train={"max_steps": 2, "micro_batch_size": 2})
    assert cfg.data.packing == "documents"
    trainer = Trainer(cfg)
    trainer.fit()
    assert len(trainer.history) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.history)


def test_a_packed_document_longer_than_the_position_table_is_refused():
    model = fm.create_model("gpt2", **{**TINY_GPT2, "n_positions": 16})
    ids = torch.randint(0, 257, (1, 30))
    ok = torch.tensor([0, 14, 30], dtype=torch.int32)
    assert torch.isfinite(model(ids, labels=ids, cu_seqlens=ok).loss)
    with pytest.raises(ValueError, match="sequence of 17 positions exceeds the model's 16 positions"):
        model(ids, cu_seqlens=torch.tensor([0, 13, 30], dtype=torch.int32))


@pytest.mark.parametrize("fused_loss", [True, False])
def test_a_micro_batch_without_labels_is_left_out_of_the_loss_average(tiny_config, fused_loss):
    """Its mean loss is NaN (as torch's and HF's): the step averages the other micro-batch, and the update
    stays finite."""
    trainer = Trainer(tiny_config(train={"max_steps": 1, "global_batch_size": 4, "micro_batch_size": 2,
                                         "fused_loss": fused_loss}))
    collate, seen = trainer.batches.collate, []

    def first_unlabelled(items):
        batch = collate(items)
        if not seen:
            batch["labels"] = torch.full_like(batch["labels"], -100)
        seen.append(batch)
        return batch

    trainer.batches.collate = first_unlabelled
    before = copy.deepcopy(trainer.raw_model)
    record = trainer.train_step()
    assert len(seen) >= 2  # this step's two micro-batches (then the next step's, prefetched)
    with torch.no_grad():
        assert before(seen[0]["input_ids"], labels=seen[0]["labels"], cu_seqlens=seen[0]["cu_seqlens"]).loss.isnan()
        want = before(seen[1]["input_ids"], labels=seen[1]["labels"], cu_seqlens=seen[1]["cu_seqlens"]).loss
    assert record["loss"] == pytest.approx(want.item(), rel=1e-5)
    changed = False
    for p, q in zip(trainer.raw_model.parameters(), before.parameters()):
        assert torch.isfinite(p).all()
        changed |= not torch.equal(p, q)
    assert changed


def test_an_hf_model_is_refused_packed_documents_and_trains_plain_windows(tiny_config):
    """transformers' GPT-2 took the packed row's cu_seqlens as an unused keyword and trained across documents."""
    import transformers

    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=257,
                                                              n_positions=64))
    with pytest.raises(ValueError, match="GPT2LMHeadModel takes no document boundaries.*data.packing=stream"):
        Trainer(tiny_config(data={"packing": "documents"}), model=hf)
    trainer = Trainer(tiny_config(data={"packing": "stream"}, train={"max_steps": 1}), model=hf)
    trainer.fit()
    assert trainer.history[0]["loss"] > 0


def test_data_smaller_than_a_global_batch_trains_with_a_warning(tiny_config, tmp_path, caplog):
    (tmp_path / "small.txt").write_text("a short document of a few words\n\nand another one")  # 3 windows of 16
    with caplog.at_level("WARNING", logger="flash_models.train.trainer"):
        trainer = Trainer(tiny_config(data={"train": str(tmp_path / "small.txt"), "seq_len": 16},
                                      train={"max_steps": 2, "global_batch_size": 8, "micro_batch_size": 4}))
    assert len(trainer.data.train) == 3
    assert "holds 3 items" in caplog.text and "fewer than train.global_batch_size=8" in caplog.text
    trainer.fit()
    assert [h["rows"] for h in trainer.history] == [8, 8]


@pytest.mark.parametrize("packing", ["stream", "documents"])
def test_a_seq_len_past_the_position_table_is_refused_before_training(tiny_config, packing):
    """It failed at the first batch holding a row (or document) that long, possibly deep into the run, asking to
    'truncate the input'."""
    with pytest.raises(ValueError, match=r"data\.seq_len=65 is longer than the 64 positions.*set data\.seq_len=64"):
        Trainer(tiny_config(data={"seq_len": 65, "packing": packing}))
