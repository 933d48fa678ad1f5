"""A decoder training with labels runs the fused LM head + loss by default and keeps no logits; explicit
``return_logits`` wins; eval mode and forwards without labels return logits as in HF."""

import pytest
import torch

import flash_models as fm


def tiny():
    torch.manual_seed(0)
    return fm.create_model("gpt2", n_layer=1, n_embd=32, n_head=4, vocab_size=131, n_positions=32, resid_pdrop=0.0,
                           embd_pdrop=0.0, attn_pdrop=0.0, kernel_backend="reference")


def test_return_logits_default_follows_training_and_labels():
    model = tiny()
    ids = torch.randint(0, 131, (2, 9))
    model.train()
    fused = model(ids, labels=ids)
    assert fused.logits is None and fused.loss is not None
    kept = model(ids, labels=ids, return_logits=True)
    assert kept.logits.shape == (2, 9, 131)
    torch.testing.assert_close(fused.loss, kept.loss, rtol=1e-5, atol=1e-6)
    assert model(ids).logits.shape == (2, 9, 131)  # no labels: logits
    model.eval()
    with torch.no_grad():
        out = model(ids, labels=ids)
        assert out.logits.shape == (2, 9, 131) and out.loss is not None
        assert model(ids, labels=ids, return_logits=False).logits is None


@pytest.mark.gpu
def test_gpu_default_training_forward_does_not_allocate_the_logits():
    """GPT-2's real vocabulary, 16 x 1024 tokens: the default training step's peak stays under the (B, S, V) bf16
    logits, so they never exist whole (the fused loss holds one chunk of rows at a time); return_logits=True goes
    past them."""
    torch.manual_seed(0)
    model = fm.create_model("gpt2", n_layer=2, n_embd=256, n_head=4, device="cuda", resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0).train()
    ids = torch.randint(0, 50257, (16, 1024), device="cuda")
    logits_bytes = ids.numel() * 50257 * 2

    def peak_of(**kwargs):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=ids, **kwargs).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return torch.cuda.max_memory_allocated() - base

    peak_of()  # warm-up: kernels, workspaces
    assert peak_of() < logits_bytes
    assert peak_of(return_logits=True) > logits_bytes
