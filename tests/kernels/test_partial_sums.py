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
