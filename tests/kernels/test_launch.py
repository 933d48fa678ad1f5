"""flash_kernels._launch: the launch key separates every launch Triton would compile differently, the
decorator stays out of the interpreter's way, and on CUDA the lean path launches the kernel Triton compiled
with the same results (never calling Triton's per-launch path again for a key it has seen)."""

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from flash_kernels import _launch
from flash_kernels._launch import CompiledLaunch, LeanKernel, _RunnerLaunch, _Unkeyable, lean_launch


def _copy_scaled(X, Y, n, scale, stride, BLOCK: tl.constexpr, SCALE_IT: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(X + offsets * stride, mask=mask)
    if SCALE_IT:
        x = x * scale
    tl.store(Y + offsets, x, mask=mask)


_copy_scaled_jit = triton.jit(_copy_scaled)


def _keys() -> LeanKernel:
    """A LeanKernel over a compiled-mode JITFunction, built directly: its launch key needs no GPU."""
    return LeanKernel(JITFunction(_copy_scaled))


def test_compiled_kernels_are_wrapped_and_interpreted_ones_left_unchanged():
    """A compiled-mode kernel launches lean; a kernel of Triton's interpreter (how CI runs them) stays as it is."""
    from triton.runtime.interpreter import InterpretedFunction

    interpreted = InterpretedFunction(_copy_scaled)
    assert lean_launch(interpreted) is interpreted
    assert isinstance(lean_launch(JITFunction(_copy_scaled)), LeanKernel)


def test_launch_key_separates_what_triton_specializes():
    lean = _keys()
    x = torch.zeros(64, dtype=torch.bfloat16)
    y = torch.zeros(64, dtype=torch.bfloat16)
    kw = dict(BLOCK=16, SCALE_IT=True)

    def key(*args, **kwargs):
        return lean.launch_key(args, kwargs or kw)

    base = key(x, y, 48, 1.5, 2)
    assert key(torch.ones(64, dtype=torch.bfloat16), y, 48, 0.5, 2) == base  # values and float values: same
    assert key(x, y, 64, 1.5, 2) == base  # another multiple of 16
    assert key(x, y, 48, 1.5, 3) == key(x, y, 48, 1.5, 5)  # two non-multiples of 16 other than 1
    different = [
        key(x[1:], y, 48, 1.5, 2),  # a 2-byte offset: not 16-byte aligned
        key(x, y[3:], 48, 1.5, 2),  # the second argument misaligned
        key(x.float(), y, 48, 1.5, 2),  # dtype
        key(x, y, 1, 1.5, 2),  # the int 1
        key(x, y, 47, 1.5, 2),  # not a multiple of 16
        key(x, y, 2**31, 1.5, 2),  # beyond int32
        key(x, y, 48, 1.5, 2, BLOCK=32, SCALE_IT=True),  # a constexpr by keyword
        key(x, y, 48, 1.5, 2, BLOCK=16, SCALE_IT=True, num_warps=8),  # a launch option
        key(x, y, 48, None, 2),  # None instead of a float
    ]
    assert key(x, y[8:], 48, 1.5, 2) == base  # 8 bf16 elements = 16 bytes: still aligned
    for other in different:
        assert other != base
    assert len(set(different)) == len(different)


def test_launch_key_of_positional_constexprs_holds_their_values():
    lean = _keys()
    x = torch.zeros(64)
    assert lean.launch_key((x, x, 48, 1.5, 2, 16, True), {}) != lean.launch_key((x, x, 48, 1.5, 2, 32, True), {})
    assert lean.launch_key((x, x, 48, 1.5, 2, 16, True), {}) != lean.launch_key((x, x, 48, 1.5, 2, 16, False), {})


def test_parameters_key_like_tensors_and_unknown_arguments_are_refused():
    lean = _keys()
    x = torch.zeros(64)
    kw = dict(BLOCK=16, SCALE_IT=True)
    assert lean.launch_key((torch.nn.Parameter(x), x, 48, 1.5, 2), kw) == lean.launch_key((x, x, 48, 1.5, 2), kw)
    with pytest.raises(_Unkeyable):
        lean.launch_key((x, x, [48], 1.5, 2), kw)


class _Launcher:
    """Stands for a compiled kernel's launcher (Triton's ``CudaLauncher``): records what it is called with."""

    def __init__(self):
        self.calls = []

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        self.calls.append((gridX, gridY, gridZ, stream, function, *args))


class _OtherLauncher:
    def __call__(self, grid, stream, *args):  # a launcher of another layout: never called directly
        raise AssertionError("called a launcher of unknown layout directly")


class _Compiled:
    """Stands for a compiled kernel: its launcher, function handle and packed metadata, and the runner."""

    def __init__(self, launcher):
        self.run, self.function, self.packed_metadata = launcher, 0xF00, (4, 1, 0)
        self.runner_launches = []

    def __getitem__(self, grid):
        return lambda *args: self.runner_launches.append((grid, args))


class _HookChain:
    """Stands for Triton's launch-hook chain (``triton.knobs.HookChain``): the hooks registered, in order."""

    def __init__(self):
        self.calls = []


class _Hooks:
    """Stands for ``triton.knobs.runtime``: the enter and exit hook chains."""

    def __init__(self):
        self.launch_enter_hook, self.launch_exit_hook = _HookChain(), _HookChain()


def test_a_compiled_launch_calls_the_launcher_as_the_runner_does_unless_a_hook_is_registered(monkeypatch):
    # Triton's hook chains faked: the test does not depend on the installed Triton's knobs.
    hooks = _Hooks()
    monkeypatch.setattr(_launch, "_HookChain", _HookChain)
    monkeypatch.setattr(_launch, "_runtime_knobs", hooks)
    monkeypatch.setattr(_launch, "_raw_stream", lambda device: 1000 + device)
    compiled = _Compiled(_Launcher())
    launcher = CompiledLaunch.of(compiled, 2)
    assert isinstance(launcher, CompiledLaunch)
    launcher.launch((3, 2, 1), (7, "x"))
    # Grid, the device's current stream, the function and metadata, then no launch metadata and no hooks.
    assert compiled.run.calls == [(3, 2, 1, 1002, 0xF00, (4, 1, 0), None, None, None, 7, "x")]
    assert not compiled.runner_launches

    hooks.launch_enter_hook.calls.append(lambda metadata: None)  # a profiler's: it must see every launch
    launcher.launch((3, 2, 1), (7, "x"))
    assert compiled.runner_launches == [((3, 2, 1), (7, "x"))] and len(compiled.run.calls) == 1


def test_a_launcher_of_unknown_layout_launches_through_the_runner():
    compiled = _Compiled(_OtherLauncher())
    launcher = CompiledLaunch.of(compiled, 0)
    assert isinstance(launcher, _RunnerLaunch) and not launcher.takes_addresses
    launcher.launch((1, 1, 1), (5,))
    assert compiled.runner_launches == [((1, 1, 1), (5,))]


@pytest.mark.gpu
def test_gpu_lean_launches_match_and_skip_tritons_path(monkeypatch):
    kernel = LeanKernel(_copy_scaled_jit)
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(4096, device="cuda", dtype=torch.float16, generator=gen)
    # Aligned and misaligned inputs, strides 1 and 3, n of 1, 17 and 1024: several launch keys, each launched
    # twice (the second time by the lean path).
    cases = [(base, 1, 1024), (base[1:], 1, 1024), (base, 3, 17), (base[3:], 1, 1), (base, 1, 1)]
    for x, stride, n in cases * 2:
        y = torch.empty(n, device="cuda", dtype=torch.float16)
        kernel[(triton.cdiv(n, 128),)](x, y, n, 0.5, stride, BLOCK=128, SCALE_IT=True)
        torch.testing.assert_close(y, x[: n * stride : stride] * 0.5, rtol=0, atol=0)
    assert len(kernel.compiled) == len(cases)
    # This Triton's launcher is one CompiledLaunch calls directly (else every launch pays the runner's Python).
    assert all(isinstance(launcher, CompiledLaunch) for launcher, _ in kernel.compiled.values())

    # Once a key is known, Triton's per-launch path is not taken again.
    def refuse(*args, **kwargs):
        raise AssertionError("Triton's own launch path ran for a known key")

    monkeypatch.setattr(kernel.jit, "run", refuse)
    x, stride, n = cases[1]
    y = torch.empty(n, device="cuda", dtype=torch.float16)
    kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n, 2.0, stride, BLOCK=128, SCALE_IT=True)
    torch.testing.assert_close(y, x[:n] * 2.0, rtol=0, atol=0)

    # A registered launch hook (a profiler's) sees the launches of a known key too.
    if _launch._runtime_knobs is not None:
        seen = []
        hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731
        _launch._runtime_knobs.launch_enter_hook.add(hook)
        try:
            kernel[(triton.cdiv(n, 128),)](x, y, n, 3.0, stride, BLOCK=128, SCALE_IT=True)
        finally:
            _launch._runtime_knobs.launch_enter_hook.remove(hook)
        torch.testing.assert_close(y, x[:n] * 3.0, rtol=0, atol=0)
        assert seen == ["_copy_scaled"]


def test_launch_key_of_a_gluon_descriptor_holds_what_triton_specializes():
    """A Gluon host descriptor keys by its dtype, box and layout (Triton's specialization of it); its base
    address, shape and strides are launch arguments, so descriptors differing only there share a key."""
    hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    gl = pytest.importorskip("triton.experimental.gluon.language")
    lean = _keys()
    kw = dict(BLOCK=16, SCALE_IT=True)

    def key(t, box, layout=None, shape=(64, 64), strides=(64, 1)):
        layout = layout or gl.NVMMASharedLayout.get_default_for(list(box), gl.bfloat16)
        desc = hopper.TensorDescriptor(t, list(shape), list(strides), list(box), layout)
        return lean.launch_key((desc, t, 48, 1.5, 2), kw)

    x = torch.zeros(64 * 128, dtype=torch.bfloat16)
    base = key(x, (64, 64))
    assert key(torch.ones(64 * 128, dtype=torch.bfloat16), (64, 64), shape=(128, 32), strides=(32, 1)) == base
    narrower_swizzle = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    different = [key(x, (32, 64)), key(x.half(), (64, 64)), key(x, (64, 64), narrower_swizzle)]
    assert all(other != base for other in different)
    assert len(set(different)) == len(different)


def test_launch_key_of_a_triton_tools_descriptor_holds_what_triton_specializes():
    """triton.tools' host descriptor (linear_act's) keys by its dtype, box and padding; like Gluon's, its base,
    shape and strides are the launch's own arguments."""
    tools = pytest.importorskip("triton.tools.tensor_descriptor")
    lean = _keys()
    kw = dict(BLOCK=16, SCALE_IT=True)

    def key(t, box, shape=(64, 64), strides=(64, 1), padding="zero"):
        desc = tools.TensorDescriptor(t, list(shape), list(strides), list(box), padding=padding)
        return lean.launch_key((desc, t, 48, 1.5, 2), kw)

    x = torch.zeros(64 * 128, dtype=torch.bfloat16)
    base = key(x, (64, 64))
    assert key(torch.ones(64 * 128, dtype=torch.bfloat16), (64, 64), shape=(128, 32), strides=(32, 1)) == base
    different = [key(x, (32, 64)), key(x, (64, 32)), key(x.half(), (64, 64)), key(x.float(), (64, 64), padding="nan")]
    assert all(other != base for other in different)
    assert len(set(different)) == len(different)
