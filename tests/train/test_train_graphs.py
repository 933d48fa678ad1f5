"""train.cuda_graphs on the CPU: what rules it out (with the setting to change), the per-signature capture
bookkeeping and the in-place gradient zeroing. The graphs themselves run in test_train_gpu.py."""

import pytest
import torch

from flash_models.train import Trainer
from flash_models.runtime.train_graphs import MAX_SIGNATURES, GraphedLoss, check_graphable

OK = dict(device=torch.device("cuda"), task="causal_lm", packing="stream", compile=False, activation_checkpointing=0,
          strategy="none")


def test_graphable_settings_pass():
    check_graphable(**OK)
    check_graphable(**{**OK, "task": "image_classification", "packing": "documents"})  # packing is for text only
    check_graphable(**{**OK, "task": "sequence_classification"})  # rows packed into buckets by the collate


@pytest.mark.parametrize("change, named", [
    ({"device": torch.device("cpu")}, "a CUDA device"),
    ({"compile": True}, "train.compile=false"),
    ({"activation_checkpointing": 2}, "train.activation_checkpointing=0"),
    ({"strategy": "ddp"}, "distributed.strategy=none"),
    ({"packing": "documents"}, "data.packing=stream"),
])
def test_each_blocking_setting_is_named(change, named):
    with pytest.raises(ValueError, match="train.cuda_graphs=true needs") as err:
        check_graphable(**{**OK, **change})
    assert named in str(err.value)


def test_trainer_refuses_graphs_on_the_cpu(tiny_config):
    with pytest.raises(ValueError, match="a CUDA device"):
        Trainer(tiny_config(data={"packing": "stream"}, train={"cuda_graphs": True}))


class _Counted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))
        self.unused = torch.nn.Parameter(torch.ones(2))


def _fake_capture(monkeypatch):
    """Stands in for make_graphed_callables (CUDA only): returns the module unchanged, counting captures (the
    sample shapes; ``captured.pools`` the memory pool each capture was given)."""

    class Captures(list):
        pools: list

    captured = Captures()
    captured.pools = pools = []

    def fake(module, samples, **kwargs):
        captured.append(tuple(s.shape for s in samples))
        pools.append(kwargs.get("pool"))
        return module

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", fake)
    return captured


def test_one_capture_per_batch_signature_and_a_clear_limit(monkeypatch):
    captured = _fake_capture(monkeypatch)
    model = _Counted()
    graphs = GraphedLoss(model, lambda m, batch: (m.w * batch["x"].float().sum()).sum())
    x3, x5 = torch.ones(2, 3), torch.ones(2, 5)
    assert graphs({"x": x3}).item() == pytest.approx(18.0)
    graphs({"x": torch.zeros(2, 3)})  # same signature: no new capture
    graphs({"x": x5})
    assert captured == [((2, 3),), ((2, 5),)]
    graphs({"x": x3.long()})  # a dtype change is a new signature
    assert len(captured) == 3
    for n in range(MAX_SIGNATURES - 3):
        graphs({"x": torch.ones(1, n + 7)})
    with pytest.raises(RuntimeError, match="fix the batch shapes or set train.cuda_graphs=false"):
        graphs({"x": torch.ones(9, 9)})
    # Every signature's captures share one memory pool (a micro-step never interleaves two signatures).
    assert len(captured.pools) == MAX_SIGNATURES and captured.pools[0] is not None
    assert all(pool == captured.pools[0] for pool in captured.pools)


def test_prepare_grads_allocates_then_zeroes_in_place_for_accumulation():
    model = _Counted()
    graphs = GraphedLoss(model, lambda m, batch: m.w.sum())
    graphs.prepare_grads(2)
    grad = model.w.grad
    assert grad is not None and torch.equal(grad, torch.zeros(3)) and torch.equal(model.unused.grad, torch.zeros(2))
    model.w.grad.add_(5.0)
    graphs.prepare_grads(2)
    assert model.w.grad is grad and torch.equal(grad, torch.zeros(3))  # same buffer, zeroed


def test_prepare_grads_clears_for_a_single_micro_step():
    """One micro-step: autograd may keep the graph's own gradient buffer as .grad, so nothing is zeroed."""
    model = _Counted()
    graphs = GraphedLoss(model, lambda m, batch: m.w.sum())
    graphs.prepare_grads(2)
    graphs.prepare_grads(1)
    assert model.w.grad is None and model.unused.grad is None


def test_packed_text_batches_give_the_padded_batches_loss(tmp_path, bert_example, tiny_bert_overrides):
    """Text classification under train.cuda_graphs: the collate packs rows into buckets, and the Trainer's
    loss over the packed batch (one logit row per sequence, the bucket's padding sequences left out) equals
    the padded batch's. A tiny BERT, fp32 on the CPU."""
    from flash_models.train import load_config
    from flash_models.train.classification import collate_classification, collate_packed_classification

    config, tiny_sentiment = bert_example
    train, _ = tiny_sentiment(tmp_path)
    trainer = Trainer(load_config(config, tiny_bert_overrides(tmp_path / "out", train, "bytes") + [
        "train.device=cpu", "train.precision=fp32"]))
    try:
        items = [trainer.data.train[i] for i in range(8)]
        padded = collate_classification(items)
        packed = collate_packed_classification(items, seq_len=32)
        with torch.no_grad():
            loss_padded, logits_padded = trainer.loss_of(trainer.model, padded, train=True)
            loss_packed, logits_packed = trainer.loss_of(trainer.model, packed, train=True)
        assert logits_packed.shape == logits_padded.shape == (8, 2)
        torch.testing.assert_close(loss_packed, loss_padded, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(logits_packed, logits_padded, rtol=1e-4, atol=1e-5)
    finally:
        trainer.close()
