"""A padded batch in a decoder's forward without a cache (TRL's SFT collator, a tokenizer's padded batch; training
or eval): on our attention kernels (here through Triton's interpreter) the layers run on the real tokens alone,
each row a document of one packed row, where no loss term is read at a padding position; the loss, gradients and
logits are then the rows' own, as if each ran alone. Padding that a loss term reads keeps the padded path."""

import pytest
import torch

import flash_models as fm

VOCAB = 97


def tiny(preset: str):
    torch.manual_seed(0)
    shape = (dict(n_layer=2, n_embd=64, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                  bos_token_id=0, eos_token_id=0)
             if preset == "gpt2" else
             dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1))
    return fm.create_model(preset, vocab_size=VOCAB, attn_impl="flash", dtype=torch.bfloat16, **shape).train()


def batch():
    """Three rows: right-padded, left-padded (its first real token predicted by no one: label -100, as after
    padding), and full; labels -100 wherever a token is padding."""
    ids = torch.randint(0, VOCAB, (3, 11))
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0
    mask[1, :4] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 4] = -100
    return ids, mask, labels


def blocks_see(model) -> list:
    seen = []
    for block in model.blocks:
        block.register_forward_hook(lambda module, args, output: seen.append(tuple(args[0].shape)))
    return seen


@pytest.mark.parametrize("preset", ["llama-1b", "gpt2"])
def test_padded_rows_train_as_their_real_tokens_alone(preset):
    model = tiny(preset)
    ids, mask, labels = batch()
    counted = int((labels[:, 1:] != -100).sum())
    seen = blocks_see(model)
    out = model(ids, attention_mask=mask, labels=labels, num_items_in_batch=counted)
    assert seen == [(1, int(mask.sum()), 64)] * 2
    assert out.logits is None and out.last_hidden_state.shape == (3, 11, 64)
    assert (out.last_hidden_state[mask == 0] == 0).all()
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    alone = 0.0
    for row in range(3):
        real = mask[row].bool()
        # a left-padded row alone starts at position 0, while the padded forward numbers it from its padding:
        # give it those positions
        positions = torch.arange(11)[real].unsqueeze(0)
        loss = model(ids[row, real].unsqueeze(0), position_ids=positions, labels=labels[row, real].unsqueeze(0),
                     num_items_in_batch=counted).loss
        loss.backward()
        alone += loss.item()
    assert out.loss.item() == pytest.approx(alone, rel=1e-5)
    for name, p in model.named_parameters():  # bf16 gradients: within 2% of each tensor's largest
        if name in grads:
            scale = p.grad.float().abs().max().item()
            torch.testing.assert_close(grads[name].float(), p.grad.float(), rtol=0, atol=2e-2 * scale, msg=name)


def test_padding_a_loss_term_reads_keeps_the_padded_rows():
    """Labels = input ids on padding too (a plain ``labels=ids``): the padded positions' terms count, so the
    layers run the padded batch as before."""
    model = tiny("llama-1b")
    ids, mask, _ = batch()
    seen = blocks_see(model)
    model(ids, attention_mask=mask, labels=ids)
    assert seen == [(3, 11, 64)] * 2


def rows_alone(forward, ids, mask):
    """Each row's real tokens run alone through ``forward`` (a model, or its backbone), at the positions the
    padded forward gives them: its outputs."""
    positions = torch.arange(ids.shape[1])
    return [forward(ids[row, real].unsqueeze(0), position_ids=positions[real].unsqueeze(0))
            for row, real in enumerate(mask.bool())]


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_logits_of_padded_rows_are_each_rows_own(mode):
    """Eval forwards (a Trainer's evaluation, a reference model's scores) and training forwards that keep the
    logits run the real tokens alone too: the logits at real positions are each row's own, the loss (read at real
    positions only) the padded forward's; at the padding the hidden states are zeros and the logits the head's
    of a zero state (no attention reached them before either). A row of padding alone gives zeros."""
    model = getattr(tiny("llama-1b"), mode)()
    ids, mask, labels = batch()
    mask[2, 9:] = 0  # the full row gets two padding tokens, which no label reads
    labels[2, 9:] = -100
    seen = blocks_see(model)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, labels=labels, return_logits=True)
        alone = rows_alone(model, ids, mask)
    assert seen[:2] == [(1, int(mask.sum()), 64)] * 2 and out.logits.shape == (3, 11, VOCAB)
    for row, single in enumerate(alone):
        real = mask[row].bool()
        torch.testing.assert_close(out.logits[row, real].float(), single.logits[0].float(), rtol=2e-2, atol=2e-2)
    assert (out.last_hidden_state[mask == 0] == 0).all() and (out.logits[mask == 0] == 0).all()
    shifted = labels[:, 1:].reshape(-1)
    expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB).float(), shifted, ignore_index=-100)
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-5)
    seen.clear()
    with torch.no_grad():
        empty = model(ids, attention_mask=torch.zeros_like(mask).index_fill_(0, torch.tensor([0]), 1)).logits
    assert seen[0] == (1, 11, 64) and (empty[1:] == 0).all()


def test_eval_with_labels_on_padding_keeps_the_padded_rows():
    """``labels=ids`` on padding (no -100 there): the padding positions' loss terms count, so the layers run the
    padded batch."""
    model = tiny("llama-1b").eval()
    ids, mask, _ = batch()
    seen = blocks_see(model)
    with torch.no_grad():
        model(ids, attention_mask=mask, labels=ids)
    assert seen == [(3, 11, 64)] * 2


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_the_backbone_runs_the_real_tokens_alone(mode):
    """TRL's fused LM head calls ``model.base_model`` (the backbone) and projects only the positions it scores;
    its reference scores come from the same call in eval: the backbone runs a padded batch's real tokens alone,
    each row's own hidden states, zeros at the padding."""
    model = getattr(tiny("llama-1b"), mode)()
    ids, mask, _ = batch()
    seen = blocks_see(model)
    packed = model.base_model(ids, attention_mask=mask).last_hidden_state
    assert seen == [(1, int(mask.sum()), 64)] * 2 and packed.shape == (3, 11, 64)
    with torch.no_grad():
        alone = torch.cat([out.last_hidden_state[0] for out in rows_alone(model.base_model, ids, mask)])
    real = mask.bool()
    torch.testing.assert_close(packed[real].float(), alone.float(), rtol=2e-2, atol=2e-2)
    assert (packed[~real] == 0).all()


FAMILIES = {  # each family's own block, positions and attention options
    "gptj-6b": dict(n_layer=2, n_embd=64, n_head=2, rotary_dim=16, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                    attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
    "pythia-160m": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=2,
                        max_position_embeddings=32, bos_token_id=0, eos_token_id=0),
    "opt-125m": dict(num_hidden_layers=2, hidden_size=64, ffn_dim=96, num_attention_heads=2, word_embed_proj_dim=64,
                     max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
                     pad_token_id=1),
    "mistral-7b": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=2,
                       num_key_value_heads=1, sliding_window=4),
    "qwen3-0.6b": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=32),
}


@pytest.mark.parametrize("preset", FAMILIES)
def test_every_family_trains_its_padded_rows_as_alone(preset):
    """GPT-J's and Pythia's parallel blocks, OPT's positions counted from the mask, Mistral's window, Qwen3's
    q/k norms: the packed real tokens give each row's own loss."""
    torch.manual_seed(0)
    model = fm.create_model(preset, vocab_size=VOCAB, attn_impl="flash", dtype=torch.bfloat16, **FAMILIES[preset]).train()
    ids, mask, labels = batch()
    counted = int((labels[:, 1:] != -100).sum())
    seen = blocks_see(model)
    loss = model(ids, attention_mask=mask, labels=labels, num_items_in_batch=counted).loss
    assert seen[0] == (1, int(mask.sum()), 64)
    alone = 0.0
    for row in range(3):
        real = mask[row].bool()
        # the padded forward's positions (OPT counts them from the mask: a row alone gets the same ones)
        positions = None if model.decoder_config.positions_from_mask else torch.arange(11)[real].unsqueeze(0)
        alone += model(ids[row, real].unsqueeze(0), position_ids=positions, labels=labels[row, real].unsqueeze(0),
                       num_items_in_batch=counted).loss.item()
    assert loss.item() == pytest.approx(alone, rel=1e-5)


@pytest.mark.gpu
def test_gpu_padded_rows_train_as_their_real_tokens_alone():
    """The same on CUDA with the compiled kernels, float32 weights under bf16 autocast (the Trainer's bf16=True),
    and an eval forward's logits."""
    torch.manual_seed(0)
    model = fm.create_model("llama-1b", vocab_size=VOCAB, num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                            num_attention_heads=2, num_key_value_heads=1, device="cuda").train()
    ids, mask, labels = (t.cuda() for t in batch())
    counted = int((labels[:, 1:] != -100).sum())
    seen = blocks_see(model)
    positions = torch.arange(11, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(ids, attention_mask=mask, labels=labels, num_items_in_batch=counted).loss
        alone = 0.0
        for row in range(3):
            real = mask[row].bool()
            alone += model(ids[row, real].unsqueeze(0), position_ids=positions[real].unsqueeze(0),
                           labels=labels[row, real].unsqueeze(0), num_items_in_batch=counted).loss.item()
    assert seen[0] == (1, int(mask.sum()), 128)
    assert loss.item() == pytest.approx(alone, rel=1e-3)
    seen.clear()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):  # an eval forward's logits, row by row
        logits = model.eval()(ids, attention_mask=mask).logits
        assert seen[0] == (1, int(mask.sum()), 128)
        for row in range(3):
            real = mask[row].bool()
            single = model(ids[row, real].unsqueeze(0), position_ids=positions[real].unsqueeze(0)).logits[0]
            torch.testing.assert_close(logits[row, real].float(), single.float(), rtol=2e-2, atol=2e-2)
