"""torch.compile traces a decoder's training forward as one graph (fullgraph=True: a graph break raises): the
fused LM head + loss over a padded vocabulary, an attention mask and explicit position ids included; the
compiled loss and gradients equal the eager ones. One model only: compiling takes a while on the CPU."""

import torch
import transformers

from flash_models.checkpoint.loader import build_model
from flash_models.testing import randomize_



def test_llama_training_forward_compiles_as_one_graph():
    config = transformers.LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch._dynamo.reset()
    model = randomize_(build_model(config, kernel_backend="reference", device="cpu"), seed=3).train()
    ids = torch.randint(0, 257, (2, 13))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding: positions come from the mask
    positions = torch.arange(13).expand(2, 13)

    def losses(m):
        return (m(ids, attention_mask=mask, labels=ids).loss  # training with labels: the fused head + loss
                + m(ids, position_ids=positions, labels=ids, return_logits=True).loss)

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got = losses(compiled)
    got_grads = torch.autograd.grad(got, list(model.parameters()))
    want = losses(model)
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for (key, _), g, w in zip(model.named_parameters(), got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6, msg=lambda m: f"{key}: {m}")
