"""``kernel_backend`` means what it says. A model built with "reference" runs plain PyTorch everywhere: its
forward, backward, fused loss and KV-cache generation (static and paged cache, left padding) launch no Triton
kernel, and every flash_kernels op it calls is asked for the reference, so that on a GPU too nothing falls
through to "auto". A model built with "triton" does launch our kernels, which shows that the watch below sees
them. Every registered preset, at the contract tests' tiny size.

On the CPU the kernels run under Triton's interpreter (tests/conftest.py): a launch is a call of
``InterpretedFunction.run``. On CUDA a launch may skip Triton's Python entirely (``_launch.lean_launch``), so the
gpu test also reads the kernel names off the profiler."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flash_kernels
import flash_models as fm
from flash_models.registry import get_preset
from tests.models.test_contract import is_decoder, tiny_overrides, training_loss

ON_CUDA = torch.cuda.is_available()


class KernelWatch:
    """What happened while ``watch`` was active: the Triton kernels launched through Triton's Python (by name)
    and the backend each flash_kernels op was asked for (None: the caller passed none)."""

    def __init__(self):
        self.launches: list[str] = []
        self.requests: list[str | None] = []
        self.ops: set[tuple[str, str | None]] = set()  # (op, backend) where the op names itself

    def not_reference(self) -> list[str]:
        return sorted(f"{op}: {backend!r}" for op, backend in self.ops if backend != "reference")


@contextlib.contextmanager
def watch(monkeypatch):
    """Record launches and backend requests (see KernelWatch). Requests are seen where every op resolves its
    ``backend=`` (``use_triton`` and ``check_backend_name``), patched in every flash_kernels module that holds
    them, however it imported them."""
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    from flash_kernels import _backend

    seen = KernelWatch()

    def spy_run(real):
        def run(self, *args, **kwargs):
            seen.launches.append(self.fn.__name__)
            return real(self, *args, **kwargs)

        return run

    monkeypatch.setattr(InterpretedFunction, "run", spy_run(InterpretedFunction.run))
    monkeypatch.setattr(triton.runtime.jit.JITFunction, "run", spy_run(triton.runtime.jit.JITFunction.run))

    real_use_triton, real_check = _backend.use_triton, _backend.check_backend_name

    def use_triton(backend, x, **kwargs):
        seen.requests.append(backend)
        seen.ops.add((kwargs["op"], backend))
        return real_use_triton(backend, x, **kwargs)

    def check_backend_name(backend):
        seen.requests.append(backend)
        return real_check(backend)

    for name, module in list(sys.modules.items()):
        if name == "flash_kernels" or name.startswith("flash_kernels."):
            if getattr(module, "use_triton", None) is real_use_triton:
                monkeypatch.setattr(module, "use_triton", use_triton)
            if getattr(module, "check_backend_name", None) is real_check:
                monkeypatch.setattr(module, "check_backend_name", check_backend_name)
    yield seen


def tiny(name, *, attn_impl, kernel_backend, device="cpu"):
    torch.manual_seed(0)
    return fm.create_model(name, attn_impl=attn_impl, kernel_backend=kernel_backend, device=device,
                           **tiny_overrides(get_preset(name)))


def exercise(model, name, device="cpu"):
    """The forward and backward of training (and the fused LM loss), then greedy generation with a KV cache:
    static and paged, one prompt left-padded. On CUDA training runs under bfloat16 autocast and generation in
    bfloat16, where "auto" takes our kernels (the decode step's GEMV chain included)."""
    decoder = is_decoder(name)
    model.train()
    with torch.device(device), torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        _, loss = training_loss(model, name)
        ids = torch.randint(0, 128, (2, 9))
        if decoder:
            loss = loss + model(ids, labels=ids, return_logits=False).loss
    loss.backward()
    if not decoder:
        return
    model.eval().to(torch.bfloat16 if device == "cuda" else torch.float32)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        for block_size in (None, 4):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, eos_token_id=[],
                                 kv_block_size=block_size)
            assert out.shape == (2, 13)


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", fm.list_models())
def test_reference_backend_launches_no_triton_kernel(monkeypatch, name, attn_impl):
    if attn_impl == "sdpa" and get_preset(name).hf_config.get("attn_logit_softcapping"):
        with pytest.raises(ValueError, match="attn_impl='sdpa' has no soft-capping"):  # as HF refuses sdpa there
            tiny(name, attn_impl=attn_impl, kernel_backend="reference")
        return
    model = tiny(name, attn_impl=attn_impl, kernel_backend="reference")
    with watch(monkeypatch) as seen:
        exercise(model, name)
    assert seen.launches == [], f"{name} with kernel_backend='reference' launched {sorted(set(seen.launches))}"
    assert seen.requests and set(seen.requests) == {"reference"}, (
        f"{name}: ops were asked for {sorted(set(map(str, seen.requests)))}, not only 'reference': {seen.not_reference()}"
    )


@pytest.mark.parametrize("name", ["llama-1b", "gpt2"])
def test_the_watch_sees_triton_launches_and_unset_backends(monkeypatch, name):
    """The same model with kernel_backend="triton" launches our kernels (norms, rotary, KV-cache writes...) and
    asks for them; an op called without a backend is seen as None."""
    model = tiny(name, attn_impl="eager", kernel_backend="triton")
    with watch(monkeypatch) as seen:
        ids = torch.randint(0, 128, (1, 5))
        with torch.no_grad():
            model.eval().generate(ids, max_new_tokens=2, do_sample=False, eos_token_id=[])
        flash_kernels.gelu(torch.randn(3, 5))
    assert "_kv_append_kernel" in seen.launches or "_rotary_kv_append_kernel" in seen.launches
    assert any("norm" in kernel for kernel in seen.launches)
    assert "triton" in seen.requests and None in seen.requests


def test_kernel_backend_is_checked_when_the_model_is_built():
    with pytest.raises(ValueError, match="backend='cuda' is not a kernel backend"):
        tiny("llama-1b", attn_impl="eager", kernel_backend="cuda")


def test_an_explicit_triton_backend_that_cannot_run_says_why(monkeypatch):
    """No silent fallback: on a CPU without Triton's interpreter "triton" is an error naming the device."""
    model = tiny("llama-1b", attn_impl="eager", kernel_backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend='triton' cannot run on device 'cpu'"):
        model(torch.randint(0, 128, (1, 5)))


def test_the_retired_environment_variable_is_ignored_with_a_warning():
    """FLASH_KERNELS_BACKEND no longer picks anything: an op left without a backend is "auto", and whoever still
    sets the variable is told what to pass instead."""
    code = "from flash_kernels._backend import check_backend_name; print(check_backend_name(None))"
    env = {**os.environ, "FLASH_KERNELS_BACKEND": "triton"}
    run = subprocess.run([sys.executable, "-W", "always", "-c", code], env=env, capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "auto"
    assert "FLASH_KERNELS_BACKEND is no longer read; pass kernel_backend=" in run.stderr


def _our_kernel_names() -> set[str]:
    """Every function decorated as a Triton or Gluon kernel in flash_kernels: what its launches are named."""
    names = set()
    for path in Path(flash_kernels.__file__).parent.glob("*.py"):
        names |= set(re.findall(r"@(?:triton|gluon)\.jit[^\n]*\n(?:@[^\n]*\n)*def (\w+)", path.read_text()))
    return names


def _one_preset_per_family() -> list[str]:
    first = {}
    for name in fm.list_models():
        first.setdefault(get_preset(name).model_type, name)
    return sorted(first.values())


@pytest.mark.gpu
@pytest.mark.parametrize("name", _one_preset_per_family())
def test_gpu_reference_backend_launches_no_kernel_of_ours(monkeypatch, name):
    """On CUDA in bfloat16, where "auto" takes our kernels: forward, backward, generate (the decode step
    captured in a CUDA graph, programmatic launch on, as by default) with "reference" launch none of them,
    by the profiler's kernel names, and ask every op for the reference. The same run with "auto" does launch
    some, which shows the names are found."""
    ours = _our_kernel_names()
    launched = {}
    for backend in ("reference", "auto"):
        model = tiny(name, attn_impl="sdpa", kernel_backend=backend, device="cuda")
        with watch(monkeypatch) as seen, torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            exercise(model, name, device="cuda")
            torch.cuda.synchronize()
        monkeypatch.undo()
        launched[backend] = ({event.name for event in prof.events()} & ours) | set(seen.launches)
        if backend == "reference":
            assert set(seen.requests) == {"reference"}, seen.not_reference()
    assert launched["reference"] == set(), f"{name} with 'reference' launched {sorted(launched['reference'])}"
    assert launched["auto"], f"{name} with 'auto' launched none of our kernels: the profiler names are not found"
