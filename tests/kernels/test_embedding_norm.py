"""embedding_layer_norm: the fused lookups + LayerNorm (Triton, the interpreter on CPU) against the unfused
reference, its input checks, and on a GPU the same bits as the unfused path at BERT's size."""

import pytest
import torch
import torch.nn.functional as F

from flash_kernels import embedding_layer_norm, layer_norm
from flash_kernels._testing import assert_close
from flash_kernels.embedding_norm import embedding_layer_norm_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(hidden, dtype, *, positions=True, types=True, offset=0, shape=(3, 5), bias=True):
    gen = torch.Generator().manual_seed(0)
    tables = dict(token_table=torch.randn(50, hidden, generator=gen).to(DEVICE, dtype))
    ids = dict(input_ids=torch.randint(0, 50, shape, generator=gen).to(DEVICE))
    if positions:
        tables["position_table"] = torch.randn(16 + offset, hidden, generator=gen).to(DEVICE, dtype)
        ids["position_ids"] = torch.randint(0, 16, shape, generator=gen).to(DEVICE)
    if types:
        tables["type_table"] = torch.randn(2, hidden, generator=gen).to(DEVICE, dtype)
        ids["token_type_ids"] = torch.randint(0, 2, shape, generator=gen).to(DEVICE)
    weight = torch.randn(hidden, generator=gen).to(DEVICE)
    b = torch.randn(hidden, generator=gen).to(DEVICE) if bias else None
    return dict(**ids, **tables, weight=weight, bias=b, position_offset=offset, eps=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("positions,types,offset,bias", [(True, True, 0, True), (True, False, 2, False),
                                                         (False, True, 0, True), (False, False, 0, True)])
@torch.no_grad()
def test_matches_the_unfused_reference(dtype, positions, types, offset, bias):
    kw = _inputs(77, dtype, positions=positions, types=types, offset=offset, bias=bias)
    out = embedding_layer_norm(**kw, backend="triton")
    assert out.shape == (3, 5, 77) and out.dtype == dtype
    assert_close(out, embedding_layer_norm_ref(**kw), dtype)


@torch.no_grad()
def test_reference_is_the_unfused_sum_then_norm():
    kw = _inputs(32, torch.bfloat16)
    h = (F.embedding(kw["input_ids"], kw["token_table"]) + F.embedding(kw["position_ids"], kw["position_table"])
         + F.embedding(kw["token_type_ids"], kw["type_table"]))
    want = layer_norm(h, kw["weight"], kw["bias"], eps=1e-12, backend="reference")
    assert torch.equal(embedding_layer_norm(**kw, backend="reference"), want)


def test_inference_only():
    kw = _inputs(32, torch.float32)
    kw["token_table"].requires_grad_()
    with pytest.raises(ValueError, match="needs gradients"):
        embedding_layer_norm(**kw, backend="triton")
    out = embedding_layer_norm(**kw, backend="auto")  # "auto" keeps the differentiable reference
    out.sum().backward()
    assert kw["token_table"].grad is not None


@torch.no_grad()
def test_bad_inputs_and_out_of_range_ids():
    kw = _inputs(32, torch.float32)
    with pytest.raises(ValueError, match="position_ids and position_table together"):
        embedding_layer_norm(**{**kw, "position_table": None}, backend="triton")
    with pytest.raises(ValueError, match="shaped like input_ids"):
        embedding_layer_norm(**{**kw, "token_type_ids": kw["token_type_ids"][:, :2]}, backend="triton")
    with pytest.raises(ValueError, match="weight shape"):
        embedding_layer_norm(**{**kw, "weight": kw["weight"][:5]}, backend="triton")
    with pytest.raises(ValueError, match="type_table must be"):
        embedding_layer_norm(**{**kw, "type_table": kw["type_table"].double()}, backend="triton")
    with pytest.raises(ValueError, match="move them to one device"):
        embedding_layer_norm(**{**kw, "input_ids": kw["input_ids"].to("meta")}, backend="triton")
    if DEVICE == "cpu":  # on CUDA an out-of-range id is a device assert, which ends the process
        for backend in ("triton", "reference"):
            with pytest.raises(ValueError, match="position_ids must lie in"):
                embedding_layer_norm(**{**kw, "position_ids": kw["position_ids"] + 16}, backend=backend)
            with pytest.raises(ValueError, match="input_ids out of range"):
                embedding_layer_norm(**{**kw, "input_ids": kw["input_ids"] - 50}, backend=backend)
        # a negative position within position_offset of 0 would read another position's row of the table
        shifted = _inputs(32, torch.float32, offset=2)
        shifted["position_ids"][0, 0] = -1
        with pytest.raises(ValueError, match="position_ids must lie in"):
            embedding_layer_norm(**shifted, backend="reference")


@pytest.mark.gpu
@torch.no_grad()
@pytest.mark.parametrize("hidden", [768, 1024])
def test_gpu_bert_size_equals_the_unfused_kernels(hidden):
    """16k tokens of BERT-base / BERT-large, bf16: bit for bit the unfused path's result (lookups summed in
    bf16, then the Triton layer_norm)."""
    kw = _inputs(hidden, torch.bfloat16, shape=(128, 128))
    h = (F.embedding(kw["input_ids"], kw["token_table"]) + F.embedding(kw["position_ids"], kw["position_table"])
         + F.embedding(kw["token_type_ids"], kw["type_table"]))
    want = layer_norm(h, kw["weight"], kw["bias"], eps=1e-12, backend="triton")
    assert torch.equal(embedding_layer_norm(**kw, backend="triton"), want)


@pytest.mark.gpu
@torch.no_grad()
def test_gpu_bert_embedding_module_takes_it():
    """BERT's Embeddings.normalized runs the kernel without grad (the same bits as norm(embed(...))), and the
    unfused path when gradients are recorded."""
    from flash_models.modules import Embeddings, Norm

    embed = Embeddings(97, 64, max_positions=32, type_vocab_size=2).cuda()
    norm = Norm(64, kind="layer_norm", eps=1e-12).cuda()
    ids, positions = torch.randint(0, 97, (4, 9), device="cuda"), torch.arange(9, device="cuda").expand(4, 9)
    types = torch.randint(0, 2, (4, 9), device="cuda")
    assert torch.equal(embed.normalized(norm, ids, positions, types), norm(embed(ids, positions, types)))
    with torch.enable_grad():
        assert embed.normalized(norm, ids, positions, types).requires_grad
