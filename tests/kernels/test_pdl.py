"""flash_kernels.programmatic_launch: the context that turns on programmatic dependent launch for our decode-path
kernels. Off the GPU (and on GPUs before Hopper) it changes nothing; the GPU tests of the kernels that take
part (test_attention_decode, tests/generation/test_generate_gpu.py) check that it changes no result there."""

import torch

from flash_kernels import _pdl, programmatic_launch


def test_the_context_nests_and_restores():
    assert not _pdl._MODE.get()
    with programmatic_launch():
        assert _pdl._MODE.get()
        with programmatic_launch(False):
            assert not _pdl._MODE.get()
        assert _pdl._MODE.get()
    assert not _pdl._MODE.get()


def test_never_enabled_off_a_hopper_gpu():
    """The CPU (and Triton's interpreter) cannot run the grid-dependency instructions: nothing launches with
    PDL there, inside the context or not."""
    with programmatic_launch():
        assert not _pdl.enabled(torch.device("cpu"))
    assert _pdl.launch_options(False) == {}
    assert _pdl.launch_options(True) == {"launch_pdl": True}


def test_never_while_compiling(monkeypatch):
    """Code torch.compile traces launches plainly (and never reads the context variable, which Dynamo of torch
    2.11 cannot trace: a compiled decode step failed on it)."""
    monkeypatch.setattr(_pdl, "pdl_supported", lambda device: True)
    with programmatic_launch():
        assert _pdl.enabled(torch.device("cuda"))
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not _pdl.enabled(torch.device("cuda"))


def test_the_trigger_order_follows_early_trigger(monkeypatch):
    """The PDL constexpr kernels get says where they trigger their successor; the decode attention reads its
    first key tile before its wait only in the early-trigger mode (batch 1), the one where that measured faster."""
    import importlib

    attention_decode = importlib.import_module("flash_kernels.attention_decode")
    monkeypatch.setattr(_pdl, "pdl_supported", lambda device: True)
    cuda = torch.device("cuda")
    assert _pdl.enabled(cuda) == _pdl.OFF and not attention_decode._prefetch_kv(cuda)
    with programmatic_launch():
        assert _pdl.enabled(cuda) == _pdl.TRIGGER_AFTER_WAIT and not attention_decode._prefetch_kv(cuda)
        with programmatic_launch(early_trigger=True):
            assert _pdl.enabled(cuda) == _pdl.TRIGGER_BEFORE_WAIT and attention_decode._prefetch_kv(cuda)
        with programmatic_launch(False, early_trigger=True):
            assert _pdl.enabled(cuda) == _pdl.OFF
    assert _pdl.launch_options(_pdl.TRIGGER_BEFORE_WAIT) == {"launch_pdl": True}
