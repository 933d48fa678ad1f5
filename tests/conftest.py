"""Test-session setup. Triton's interpreter must be switched on before triton is first imported, so this
runs before any test module: on a machine without CUDA, the Triton kernels run on the CPU interpreter."""

import os
import random
import tempfile
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The library's on-disk cache (GGUF tokenizers) goes to a fresh folder: tests neither read a stale user cache
# nor leave files in the home directory.
os.environ.setdefault("FLASH_MODELS_CACHE", tempfile.mkdtemp(prefix="flash-models-test-cache-"))

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: run on the device machine (see README, GPU tests)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    """Each test draws its random data from a seed of its own (from its id), not from whatever the tests before
    it left in torch's generator: a failure reproduces when the test runs alone (-k), in any order."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)


@pytest.fixture(autouse=True)
def _default_backward_threading():
    """Each test starts with autograd's default threading: a training forward of our models on CUDA leaves the
    calling thread (pytest's) running its backward calls there (flash_models.backward), for the tests after it."""
    yield
    torch.autograd.set_multithreading_enabled(True)


@pytest.fixture
def one_thread():
    """Tiny models stepped token by token are dominated by thread start-up: on a shared 2-core CI box one
    intra-op thread is tens of times faster. Restored after the test so other tests keep their setting. Test
    files of tiny step-by-step models use it for every test (``pytestmark = pytest.mark.usefixtures(...)``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
