"""Contract tests every registered preset gets automatically, at its family's test size (``Family.tiny``, which
keeps the preset's options: tied head, GQA ratio, activation): forward+backward with no NaN and a gradient for
every parameter, KV-cache decoding equal to a full forward (decoders), and a save -> load round trip. A new
family gets them by existing; what differs between kinds of model (inputs, which output) follows the HF auto
class that reads the family's checkpoints, not the family."""

import pytest
import torch

import flash_models as fm
from flash_models.models.protocols import is_causal_decoder
from flash_models.registry import get_family, get_preset
from flash_models.testing import max_rel_err, randomize_


def tiny_overrides(preset):
    return get_family(preset.model_type).tiny(preset.hf_config)


def is_decoder(name):
    return get_family(get_preset(name).model_type).hf_auto_class == "AutoModelForCausalLM"


DECODERS = [name for name in fm.list_models() if is_decoder(name)]


def training_loss(model, name):
    """A loss that reaches every parameter: the LM loss, the image classification loss, or for a bare encoder a
    function of both of its outputs."""
    auto_class = get_family(get_preset(name).model_type).hf_auto_class
    if auto_class == "AutoModelForImageClassification":
        c = model.config
        out = model(torch.randn(2, c.num_channels, c.image_size, c.image_size), labels=torch.randint(0, c.num_classes, (2,)))
        return out.logits, out.loss
    ids = torch.randint(0, tiny_overrides(get_preset(name))["vocab_size"], (2, 17))
    if auto_class == "AutoModel":
        mask = torch.ones_like(ids)
        mask[1, 12:] = 0
        out = model(ids, attention_mask=mask, token_type_ids=torch.randint(0, 2, ids.shape))
        return out.last_hidden_state, out.last_hidden_state[mask.bool()].square().mean() + out.pooler_output.square().mean()
    out = model(ids, labels=ids)
    assert out.logits is None  # training with labels: the fused LM head + loss, no (B, S, vocab) logits
    return out.last_hidden_state, out.loss


def tiny_model(name):
    model = fm.create_model(name, **tiny_overrides(get_preset(name)))
    return randomize_(model, seed=1)


@pytest.mark.parametrize("name", fm.list_models())
def test_forward_backward_reaches_every_parameter(name):
    model = tiny_model(name).train()
    output, loss = training_loss(model, name)
    assert torch.isfinite(output).all() and torch.isfinite(loss)
    loss.backward()
    for pname, param in model.named_parameters():
        assert param.grad is not None, f"{pname} got no gradient"
        assert torch.isfinite(param.grad).all(), f"{pname} has a non-finite gradient"
        assert param.grad.abs().sum() > 0, f"{pname} has an all-zero gradient"


@pytest.mark.parametrize("name", DECODERS)
def test_kv_cache_decode_equals_full_forward(name):
    model = tiny_model(name).eval()
    ids = torch.randint(0, model.decoder_config.vocab_size, (2, 15))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask, mask_positions=True).logits
        cache = model.new_kv_cache(2, 15)
        pieces = [model(ids[:, :9], attention_mask=mask[:, :9], kv_cache=cache).logits]
        for t in range(9, 15):
            pieces.append(model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], kv_cache=cache).logits)
    decoded = torch.cat(pieces, dim=1)
    real = mask.bool()
    assert max_rel_err(decoded[real], full[real]) < 1e-5


@pytest.mark.parametrize("name", fm.list_models())
def test_save_load_round_trip(name, tmp_path):
    model = tiny_model(name).eval()
    model.save_pretrained(tmp_path)
    again = fm.from_pretrained(tmp_path)
    assert type(again) is type(model) and again.config == model.config
    for (key, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), key


@pytest.mark.parametrize("name", fm.list_models())
def test_generation_protocol_is_offered_by_decoders_only(name):
    model = fm.create_model(name, device="meta", **tiny_overrides(get_preset(name)))
    assert is_causal_decoder(model) == (name in DECODERS)
    if name not in DECODERS:
        with pytest.raises(TypeError, match="cannot generate"):
            fm.generation.generate(model, torch.zeros(1, 3, dtype=torch.long))


def one_preset_per_family() -> list[str]:
    firsts = {}
    for name in fm.list_models():
        firsts.setdefault(get_preset(name).model_type, name)
    return sorted(firsts.values())


@pytest.mark.parametrize("name", one_preset_per_family())
def test_training_step_traces_as_one_graph(name):
    """The training forward and loss above are one torch.compile graph (fullgraph=True: a graph break raises),
    traced by Dynamo alone (the "eager" backend: what breaks a graph is decided there; tests/models/
    test_compile.py runs a whole compiled step). One preset per family: tracing takes seconds on the CPU."""
    torch._dynamo.reset()
    model = tiny_model(name).train()
    compiled = torch.compile(lambda: training_loss(model, name)[1], fullgraph=True, backend="eager")
    torch.manual_seed(0)
    got = compiled()
    torch.manual_seed(0)
    want = training_loss(model, name)[1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
