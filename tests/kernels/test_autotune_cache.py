"""flash_kernels._autotune_cache: the Autotuner decides once per key, later launches of that key go straight
to the JIT function with its config, and the results are those of the plain autotuned kernel. Runs under
Triton's interpreter on the CPU (on CUDA, for real)."""

import torch
import triton
import triton.language as tl

from flash_kernels._autotune_cache import CachedAutotune, cached_autotune

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _configs():
    return [triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})]


def _one_config_per_bucket(configs, nargs, **kwargs):
    """The Autotuner's choice without benchmarking (the interpreter cannot time kernels): BLOCK 16 up to 64
    elements, 32 above."""
    return [configs[0] if nargs["n_bucket"] <= 64 else configs[1]]


@cached_autotune
@triton.autotune(configs=_configs(), key=["n_bucket"], prune_configs_by={"early_config_prune": _one_config_per_bucket})
@triton.jit
def _scale_kernel(X, Y, n, scale, n_bucket, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(Y + offsets, tl.load(X + offsets, mask=mask) * scale, mask=mask)


def _scale(x: torch.Tensor, scale: float) -> torch.Tensor:
    y = torch.empty_like(x)
    n = x.numel()
    _scale_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n, scale, triton.next_power_of_2(n))
    return y


def _count_autotuner_launches(monkeypatch) -> list:
    calls = []
    original = type(_scale_kernel.autotuner).run

    def counting(self, *args, **kwargs):
        calls.append(args[4])  # n_bucket
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(_scale_kernel.autotuner), "run", counting)
    return calls


def test_one_autotuner_launch_per_key_then_direct_launches_with_the_same_results(monkeypatch):
    assert isinstance(_scale_kernel, CachedAutotune)
    _scale_kernel.chosen.clear()
    calls = _count_autotuner_launches(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    for n, dtype in [(40, torch.float32), (37, torch.float32), (40, torch.float32), (100, torch.float32),
                     (40, torch.float16), (33, torch.float32)]:
        x = torch.randn(n, generator=gen).to(DEVICE, dtype)
        torch.testing.assert_close(_scale(x, 1.5), x * 1.5)
    # keys: (64, fp32) twice via 40/37/33, (128, fp32), (64, fp16): the Autotuner ran once for each
    assert calls == [64, 128, 64]
    assert {key[0]: meta["BLOCK"] for key, (meta, _) in _scale_kernel.chosen.items()} == {64: 16, 128: 32}
    assert len(_scale_kernel.chosen) == 3


def test_a_chosen_configs_pre_hook_runs_before_every_cached_launch(monkeypatch):
    """The hook sees the named arguments and the config's meta-parameters, as the Autotuner passes them, on the
    first launch (the Autotuner's) and on the later direct ones."""
    hooked = []
    kernel = cached_autotune(triton.autotune(
        configs=[triton.Config({"BLOCK": 16}, pre_hook=lambda nargs: hooked.append((nargs["n"], nargs["BLOCK"])))],
        key=["n_bucket"],
    )(_scale_kernel.autotuner.fn))
    calls = _count_autotuner_launches(monkeypatch)
    x = torch.arange(20, dtype=torch.float32, device=DEVICE)
    for _ in range(3):
        y = torch.empty_like(x)
        kernel[(2,)](x, y, 20, 2.0, 32)
        torch.testing.assert_close(y, x * 2)
    assert calls == [32] and hooked == [(20, 16)] * 3


def test_anything_but_an_autotuner_is_returned_unchanged():
    def plain(x):
        return x

    assert cached_autotune(plain) is plain
    assert cached_autotune(_scale_kernel.jit) is _scale_kernel.jit


def test_the_key_reads_positional_and_keyword_arguments_alike():
    x = torch.zeros(4, device=DEVICE)
    positional = _scale_kernel.key((x, x, 4, 1.0, 8), {})
    keyword = _scale_kernel.key((x, x, 4, 1.0), {"n_bucket": 8, "BLOCK": 16})
    assert positional == keyword == (8, torch.float32, torch.float32)
