"""sum_partials (the norm backward's second pass): k buffers of per-program float32 partials summed per column
in one launch, against torch, with more partial rows than one block and with the narrowed column blocks."""

import importlib

import pytest
import torch

ps = importlib.import_module("flash_kernels.partial_sums")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("sms", [1, 4, 1000])  # wide blocks, then narrower ones as the grid must cover more SMs
@pytest.mark.parametrize("k", [1, 2, 4])
def test_matches_torch(k, sms, monkeypatch):
    monkeypatch.setattr(ps, "num_programs", lambda device, per_sm=4: sms)
    partials = torch.randn(k, 77, 150, device=DEVICE)
    sums = ps.sum_partials(partials)
    assert len(sums) == k and all(s.dtype == torch.float32 for s in sums)
    torch.testing.assert_close(torch.stack(sums), partials.sum(1), rtol=1e-5, atol=1e-5)


def test_sums_stored_in_the_asked_dtypes():
    """Each sum is accumulated in float32 and stored in its own dtype (the norm backward's bf16 weight grads)."""
    partials = torch.randn(2, 77, 150, device=DEVICE)
    dw, db = ps.sum_partials(partials, (torch.bfloat16, torch.float32))
    dw32, db32 = ps.sum_partials(partials)
    assert dw.dtype == torch.bfloat16 and db.dtype == torch.float32
    # The float32 sum, rounded once to bf16: within one bf16 step of it (Triton's interpreter truncates where
    # the GPU rounds to nearest).
    torch.testing.assert_close(dw.float(), dw32, rtol=2**-7, atol=0)
    assert torch.equal(db, db32)
    torch.testing.assert_close(db32, partials[1].sum(0), rtol=1e-5, atol=1e-5)
