"""MLPs that recompute their activation in the backward (the default for gated MLPs, a switch for plain ones):
the same gradients as keeping it (fp32 and under bf16 autocast), one (N, intermediate) tensor fewer saved, and
hooked or subclassed layers keep their own forward."""

import pytest
import torch
from torch import nn

from flash_models.config import MLPConfig
from flash_models.modules.mlp import MLP, GatedMLP
from flash_models.modules.recompute import activation_then_linear

CASES = {"gelu_new": (MLP, "gelu_new"), "relu": (MLP, "relu"), "swiglu": (GatedMLP, "silu"),
         "geglu": (GatedMLP, "gelu_pytorch_tanh")}
N, HIDDEN, INTER = 37, 24, 40


def make(name, bias=True):
    cls, act = CASES[name]
    torch.manual_seed(0)
    mlp = cls(MLPConfig(hidden_size=HIDDEN, intermediate_size=INTER, activation=act, bias=bias))
    mlp.recompute_activation = True  # the plain MLPs keep it by default
    return mlp, torch.randn(3, N, HIDDEN, requires_grad=True)


def grads(mlp, x, *, plain: bool, autocast: bool = False):
    for p in [x, *mlp.parameters()]:
        p.grad = None
    down = mlp.fc2 if isinstance(mlp, MLP) else mlp.down
    hook = down.register_forward_hook(lambda *args: None) if plain else None  # a hook turns recompute off
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = mlp(x)
    out.float().square().sum().backward()
    if hook is not None:
        hook.remove()
    return [out.detach()] + [p.grad.clone() for p in [x, *mlp.parameters()]]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", list(CASES))
def test_same_gradients_as_keeping_the_activation(name, bias):
    mlp, x = make(name, bias)
    for got, want in zip(grads(mlp, x, plain=False), grads(mlp, x, plain=True), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["swiglu", "geglu"])
def test_gated_backward_on_the_kernels_matches_keeping_the_activation(name):
    """The Triton path (on the CPU, the interpreter): the activation's output and gradient come from one kernel."""
    cls, act = CASES[name]
    device = "cuda" if torch.cuda.is_available() else "cpu"  # Triton takes CUDA tensors where a GPU is present
    torch.manual_seed(0)
    mlp = cls(MLPConfig(hidden_size=HIDDEN, intermediate_size=INTER, activation=act, bias=True),
              kernel_backend="triton").to(device)
    x = torch.randn(3, N, HIDDEN, device=device, requires_grad=True)
    for got, want in zip(grads(mlp, x, plain=False), grads(mlp, x, plain=True), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gelu_new", "swiglu"])
def test_same_gradients_under_bf16_autocast(name):
    mlp, x = make(name)
    for got, want in zip(grads(mlp, x, plain=False, autocast=True), grads(mlp, x, plain=True, autocast=True), strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def saved_intermediate_tensors(mlp, x) -> int:
    """How many distinct (.., intermediate)-wide tensors the forward saves for the backward."""
    saved = {}

    def pack(t):
        if t.numel() == 3 * N * INTER:  # activations only (the weights are smaller)
            saved[t.untyped_storage().data_ptr()] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlp(x)
    return len(saved)


def test_activation_output_is_not_saved():
    mlp, x = make("gelu_new")
    recomputed = saved_intermediate_tensors(mlp, x)
    hook = mlp.fc2.register_forward_hook(lambda *args: None)
    kept = saved_intermediate_tensors(mlp, x)
    hook.remove()
    assert (recomputed, kept) == (1, 2)  # fc1's output only, vs fc1's output and the activation's


def test_hooked_and_subclassed_layers_run_their_own_forward():
    class Doubling(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    pre = torch.randn(5, 8, requires_grad=True)
    plain = nn.Linear(8, 3)
    doubling = Doubling(8, 3)
    doubling.load_state_dict(plain.state_dict())
    torch.testing.assert_close(activation_then_linear(pre, torch.tanh, doubling, backend="auto"), 2 * plain(torch.tanh(pre)))
    plain.register_forward_hook(lambda module, args, out: out + 1)
    torch.testing.assert_close(activation_then_linear(pre, torch.tanh, plain, backend="auto"), plain(torch.tanh(pre)))


def test_defaults_recompute_gated_mlps_only():
    assert GatedMLP.recompute_activation and not MLP.recompute_activation
    mlp, x = make("gelu_new")
    mlp.recompute_activation = False
    assert saved_intermediate_tensors(mlp, x) == 2


# ----------------------------------------------------------------------------------------------------------
# Norm outputs recomputed from the residual stream (PreNormBlock.recompute_norm_outputs)
# ----------------------------------------------------------------------------------------------------------

def tiny_llama(**kw):
    import flash_models as fm

    torch.manual_seed(0)
    return fm.create_model("llama-1b", num_hidden_layers=2, hidden_size=32, intermediate_size=48,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=97, attn_impl="eager", **kw)


def loss_and_grads(model, ids, *, recompute: bool):
    for block in model.blocks:
        block.recompute_norm_outputs = recompute
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype,backend", [(torch.float32, "reference"), (torch.bfloat16, "triton")])
def test_recomputed_norm_outputs_give_the_same_bits(dtype, backend):
    """The fused norm normalizes the stream as stored, so recomputing from the stored stream is exact: the same
    loss and gradients, bit for bit (bf16 through the Triton kernels on the interpreter)."""
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"  # else the interpreter
    model = tiny_llama(kernel_backend=backend).to(device, dtype)
    ids = torch.randint(0, 97, (2, 11), device=device)
    for got, want in zip(loss_and_grads(model, ids, recompute=True), loss_and_grads(model, ids, recompute=False),
                         strict=True):
        assert torch.equal(got, want)


def test_recomputed_norm_outputs_are_not_saved(monkeypatch):
    """With recompute on, nothing keeps the norm outputs alive between the forward and the backward, and the
    backward recomputes each of them once."""
    import gc
    import weakref

    model = tiny_llama()
    ids = torch.randint(0, 97, (2, 11))
    outputs, calls = [], []
    for block in model.blocks:
        for norm in (block.norm1, block.norm2):
            norm.register_forward_hook(lambda module, args, out: outputs.append(weakref.ref(out[0])))
            original = norm.normalize_stream  # what the backward calls to recompute a norm's output
            monkeypatch.setattr(norm, "normalize_stream",
                                lambda *args, original=original, **kwargs: calls.append(1) or original(*args, **kwargs))
    for on in (False, True):
        for block in model.blocks:
            block.recompute_norm_outputs = on
        outputs.clear()
        loss = model(ids, labels=ids).loss
        gc.collect()
        alive = sum(ref() is not None for ref in outputs)
        assert alive == (0 if on else 2 * len(model.blocks)), (on, alive)
        calls.clear()
        loss.backward()
        assert len(calls) == (2 * len(model.blocks) if on else 0)


def test_only_gated_decoders_recompute_and_checkpointing_turns_norm_recompute_off():
    import flash_models as fm
    from flash_models.train.trainer import apply_activation_checkpointing

    gpt2 = fm.create_model("gpt2", n_layer=1, n_embd=32, n_head=4, vocab_size=97)
    block = gpt2.blocks[0]
    assert not (block.recompute_norm_outputs or block.attn.recompute_weight_casts or block.mlp.recompute_weight_casts)
    model = tiny_llama()
    assert all(b.recompute_norm_outputs and b.attn.recompute_weight_casts and b.mlp.recompute_weight_casts
               for b in model.blocks)
    apply_activation_checkpointing(model, 1)
    assert not any(block.recompute_norm_outputs for block in model.modules() if hasattr(block, "recompute_norm_outputs"))


def test_plain_projections_recompute_without_saved_tensor_hooks(monkeypatch):
    """A saved-tensor hook is Python called for every tensor saved under it: plain projections save the residual
    stream in place of their input instead, so a training forward enters no such hook."""
    entered = []
    original = torch.autograd.graph.saved_tensors_hooks
    monkeypatch.setattr(torch.autograd.graph, "saved_tensors_hooks",
                        lambda *args: entered.append(1) or original(*args))
    model = tiny_llama()
    ids = torch.randint(0, 97, (2, 11))
    model(ids, labels=ids).loss.backward()
    assert entered == []


def test_a_hooked_projection_runs_its_own_forward_with_the_same_gradients():
    """A projection that is not a plain nn.Linear (here: one with a forward hook, as adapters and profilers add)
    runs its own forward, which keeps its input (module docstring): the same gradients, bit for bit, and its
    hook runs."""
    model = tiny_llama()
    ids = torch.randint(0, 97, (2, 11))
    want = loss_and_grads(model, ids, recompute=False)
    calls = []
    for block in model.blocks:
        block.attn.qkv.register_forward_hook(lambda module, args, out: calls.append(1))
        block.mlp.gate_up.register_forward_hook(lambda module, args, out: calls.append(1))
    for got, expected in zip(loss_and_grads(model, ids, recompute=True), want, strict=True):
        assert torch.equal(got, expected)
    assert len(calls) == 2 * len(model.blocks)
