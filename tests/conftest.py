"""Test-session setup. Triton's interpreter must be switched on before triton is first imported, so this
runs before any test module: on a machine without CUDA, the Triton kernels run on the CPU interpreter."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: run on the device machine (see README, GPU tests)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
