"""Launch plans (flash_kernels._launch_plans, _launch.Relaunch, LeanKernel.bind) and their use by the attention
forward and backward and the fused norms: a plan is kept only for a key seen twice, takes the new call's
tensors and keeps none of the old ones, and each op's key separates every call whose launch arguments differ.
On CUDA, calls that run from a plan match the reference on fresh data."""

import importlib

import pytest
import torch
from triton.runtime.jit import JITFunction

import flash_kernels as fk
from flash_kernels import attention
from flash_kernels import _launch
from flash_kernels._launch import CompiledLaunch, LeanKernel, Relaunch
from flash_kernels._launch_plans import LaunchPlans, all_aligned, present_slots
from flash_kernels._testing import assert_close

layer_norm = importlib.import_module("flash_kernels.layer_norm")  # the module (the package exports the function)
partial_sums = importlib.import_module("flash_kernels.partial_sums")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_a_plan_is_kept_the_second_time_a_key_is_seen():
    plans = LaunchPlans(limit=3)
    made = []

    def make():
        made.append(1)
        return lambda: "plan"

    plans.consider("a", make)
    assert plans.get("a") is None and not made  # one sighting: nothing made
    plans.consider("a", make)
    assert plans.get("a")() == "plan" and len(made) == 1
    plans.consider(None, make)  # a call that gets no plan
    assert plans.get(None) is None and len(made) == 1
    plans.consider("b", lambda: None)
    plans.consider("b", lambda: None)  # the launch could not be bound: no plan
    assert plans.get("b") is None


def test_the_table_empties_at_its_limit():
    plans = LaunchPlans(limit=2)
    for key in ("a", "a", "b"):
        plans.consider(key, lambda: (lambda: None))
    assert plans.get("a") is not None
    plans.consider("c", lambda: (lambda: None))  # a third new key: everything goes
    assert plans.get("a") is None and plans.seen == {"c"}


class _RecordingLauncher:
    """Stands for a kernel's launcher: records each launch's grid and arguments."""

    def __init__(self, takes_addresses: bool, device: int = -1):  # -1: what get_device() says of a CPU tensor
        self.takes_addresses, self.device = takes_addresses, device
        self.launches = []

    def launch(self, grid3, args):
        self.launches.append((grid3, tuple(args)))


def test_a_relaunch_takes_new_tensors_and_keeps_none_of_the_old():
    old = (torch.zeros(2), torch.ones(3))
    dummy = torch.empty(1)
    launcher = _RecordingLauncher(takes_addresses=False)
    relaunch = Relaunch(launcher, (4, 1, 1), (old[0], 7, old[1], 2.5, None, dummy), slots=(0, 2))
    assert relaunch.template == [None, 7, None, 2.5, None, dummy] and relaunch.kept == (dummy,)
    new = (torch.full((2,), 4.0), torch.full((3,), 5.0))
    relaunch(*new)
    relaunch(*new)
    assert len(launcher.launches) == 2
    grid3, got = launcher.launches[0]
    assert grid3 == (4, 1, 1)
    assert got[0] is new[0] and got[2] is new[1] and got[1:2] + got[3:] == (7, 2.5, None, dummy)


def test_a_relaunch_on_a_launcher_taking_addresses_passes_every_tensor_as_its_address():
    """A ``CompiledLaunch`` takes addresses (a tensor would cost its launcher a driver query): the new tensors
    and the template's own ones (a dummy pointer, kept alive by the Relaunch) both go as ints."""
    old, dummy = torch.zeros(2), torch.empty(1)
    launcher = _RecordingLauncher(takes_addresses=True)
    relaunch = Relaunch(launcher, (1, 1, 1), (old, 3, None, dummy), slots=(0,))
    assert relaunch.kept == (dummy,)
    new = torch.ones(5)[1:]
    relaunch(new)
    (_, got), = launcher.launches
    assert got == (new.data_ptr(), 3, None, dummy.data_ptr())


def test_a_relaunch_taking_addresses_refuses_a_tensor_on_another_device():
    """An address is not checked by the kernel's launcher: a tensor not on the kernel's device (a CPU weight
    beside CUDA activations) must raise, never reach the kernel as a host address."""
    launcher = _RecordingLauncher(takes_addresses=True, device=0)
    relaunch = Relaunch(launcher, (1, 1, 1), (None, 3), slots=(0,))
    with pytest.raises(ValueError, match="got a tensor on cpu: pass the op its inputs on the current CUDA device"):
        relaunch(torch.zeros(4))
    assert not launcher.launches


def _copy(X, Y, n, BLOCK):  # signature only: bind never compiles
    pass


class _FakeCompiled:
    """Stands for a compiled kernel: ``[grid]`` gives a launcher that records its grid and arguments."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args: self.launches.append((grid, args))


def test_bind_relaunches_the_kept_compiled_kernel_with_the_grid_of_its_arguments(monkeypatch):
    monkeypatch.setattr(_launch, "_device_index", lambda: 0)
    lean = LeanKernel(JITFunction(_copy))
    x, y = torch.zeros(32), torch.zeros(32)
    args, kwargs = (x, y, 32), {"BLOCK": 16}
    grid = lambda meta: (meta["n"] // meta["BLOCK"],)  # noqa: E731
    assert lean.bind(grid, args, kwargs, (0, 1)) is None  # never launched: nothing to bind
    compiled = _FakeCompiled()
    lean.compiled[(0, *lean.launch_key(args, kwargs))] = (CompiledLaunch.of(compiled, 0), (16,))
    relaunch = lean.bind(grid, args, kwargs, (0, 1))
    x2, y2 = torch.ones(32), torch.ones(32)
    relaunch(x2, y2)
    (grid3, launched), = compiled.launches
    assert grid3 == (2, 1, 1)
    assert launched[0] is x2 and launched[1] is y2 and launched[2:] == (32, 16)


def _qkv(b=2, s=33, h=4, d=64, dtype=torch.float16):
    q = torch.randn(b, s, h, d, device=DEVICE, dtype=dtype)
    return q, torch.randn_like(q), torch.randn_like(q)


def _key(q, k, v, cu=None, causal=True, window=(-1, -1), softcap=0.0, alibi=None, dropout_p=0.0, scale=0.125):
    max_q = q.shape[-3] if cu is None else 40
    return attention._fwd_plan_key(q, k, v, cu, cu, max_q, max_q, causal, scale, *window, softcap, alibi, dropout_p)


def test_the_forward_plan_key_separates_calls_whose_launches_differ():
    q, k, v = _qkv()
    base = _key(q, k, v)
    assert _key(*_qkv()) == base  # other values, same launch
    cu = torch.tensor([0, 33, 66], dtype=torch.int32, device=DEVICE)
    packed = q.reshape(-1, 4, 64)
    different = [
        _key(*_qkv(s=34)),
        _key(*_qkv(h=8)),
        _key(*_qkv(dtype=torch.bfloat16)),
        _key(q.transpose(0, 1).contiguous().transpose(0, 1), k, v),  # same shape, other strides
        _key(q, k[:, :20], v[:, :20]),  # Sk != Sq
        _key(q, k, v, causal=False),
        _key(q, k, v, window=(8, 0)),
        _key(q, k, v, softcap=30.0),
        _key(q, k, v, scale=0.1),
        _key(packed, packed, packed, cu=cu),
    ]
    assert None not in different and base not in different and len(set(different)) == len(different)
    storage = torch.randn(2 * 33 * 4 * 64 + 1, device=DEVICE, dtype=torch.float16)
    misaligned = storage[1:].view(2, 33, 4, 64)
    assert _key(misaligned, k, v) is None  # Triton would specialize it unlike an aligned q
    assert _key(q, k, v, alibi=torch.ones(4, device=DEVICE)) is None
    assert _key(q, k, v, dropout_p=0.1) is None


def test_the_backward_plan_key_adds_the_gradient_layouts():
    q, k, v = _qkv()
    out, do = torch.randn_like(q), torch.randn_like(q)

    def key(do=do, grads=None, dropout_p=0.0):
        return attention._bwd_plan_key(do, q, k, v, out, None, None, 33, 33, True, 0.125, -1, -1, 0.0, None,
                                       dropout_p, grads)

    base = key()
    assert base is not None and key(do=torch.randn_like(do)) == base
    packed = torch.randn(2, 33, 12, 64, device=DEVICE, dtype=torch.float16)
    grads = (packed[:, :, :4], packed[:, :, 4:8], packed[:, :, 8:])  # dq, dk, dv in one buffer (packed qkv)
    different = [key(do=do.transpose(0, 1).contiguous().transpose(0, 1)), key(grads=grads)]
    assert None not in different and base not in different and different[0] != different[1]
    storage = torch.randn(do.numel() + 1, device=DEVICE, dtype=torch.float16)
    assert key(do=storage[1:].view_as(do)) is None  # a misaligned dO: no plan
    assert key(dropout_p=0.1) is None  # dropout: no plan


def _grads(fn, tensors, dout):
    leaves = [t.detach().requires_grad_() for t in tensors]
    out = fn(*leaves)
    return (out, *torch.autograd.grad(out, leaves, dout))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense_causal", "dense_window_gqa", "varlen", "packed_qkv"])
def test_calls_from_a_plan_match_the_reference_on_fresh_data(case):
    """Forward and backward: the first call sees the key, the second keeps the plans, the rest run from them."""
    attention._FWD_PLANS.clear()
    attention._BWD_PLANS.clear()
    cu = torch.tensor([0, 7, 7, 50, 61], dtype=torch.int32, device="cuda")
    varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=43, max_seqlen_k=43, causal=True)
    for call in range(4):
        if case == "varlen":
            tensors = [torch.randn(61, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
            fn = lambda *t, b: fk.flash_attn_varlen_func(*t, **varlen, backend=b)  # noqa: E731
        elif case == "packed_qkv":
            tensors = [torch.randn(61, 3, 4, 64, device="cuda", dtype=torch.bfloat16)]
            fn = lambda qkv, b: fk.flash_attn_varlen_qkvpacked_func(  # noqa: E731
                qkv, cu_seqlens=cu, max_seqlen=43, causal=True, backend=b)
        else:
            gqa = case == "dense_window_gqa"
            q = torch.randn(3, 77, 8, 128, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(3, 91, 2 if gqa else 8, 128, device="cuda", dtype=torch.bfloat16)
            tensors = [q, k, torch.randn_like(k)]
            window = (19, 0) if gqa else (-1, -1)
            fn = lambda *t, b: fk.flash_attn_func(*t, causal=True, window_size=window, backend=b)  # noqa: E731
        dout = torch.randn_like(fn(*tensors, b="reference"))
        got = _grads(lambda *t: fn(*t, b="triton"), tensors, dout)
        want = _grads(lambda *t: fn(*t, b="reference"), [t.float() for t in tensors], dout.float())
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.float(), w, atol=3e-2, rtol=3e-2)
        assert len(attention._FWD_PLANS.plans) == len(attention._BWD_PLANS.plans) == (0 if call == 0 else 1)


# ----------------------------------------------------------------------------------------------------------
# The norms' plans (layer_norm._FWD_PLANS / _BWD_PLANS, partial_sums._PLANS)
# ----------------------------------------------------------------------------------------------------------


def _norm_fwd_key(x, w, b=None, w1=None, b1=None, res=None, eps=1e-5, rms=True, zero=False, res_dtype=None,
                  out_dtype=None, store=False, pdl=0):
    return layer_norm._fwd_plan_key(x, w, b, w1, b1, res, eps, rms, zero, res_dtype or x.dtype, out_dtype or x.dtype,
                                    store, pdl)


def test_the_norm_forward_plan_key_separates_calls_whose_launches_differ():
    x, w = torch.randn(6, 40, device=DEVICE, dtype=torch.bfloat16), torch.randn(40, device=DEVICE)
    base = _norm_fwd_key(x, w)
    assert base is not None and _norm_fwd_key(torch.randn_like(x), torch.randn_like(w)) == base
    wide = torch.randn(6, 80, device=DEVICE, dtype=torch.bfloat16)
    different = [
        _norm_fwd_key(x[:5], w),
        _norm_fwd_key(wide[:, :40], w),  # same shape, other row stride
        _norm_fwd_key(x.half(), w),
        _norm_fwd_key(x, w.bfloat16()),
        _norm_fwd_key(x, w, b=torch.zeros_like(w)),
        _norm_fwd_key(x, w, w1=w, b1=w),
        _norm_fwd_key(x, w, res=torch.randn_like(x)),
        _norm_fwd_key(x, w, res=torch.randn_like(x), store=True),
        _norm_fwd_key(x, w, res=torch.randn_like(x), res_dtype=torch.float32),
        _norm_fwd_key(x, w, eps=1e-6),
        _norm_fwd_key(x, w, rms=False),
        _norm_fwd_key(x, w, zero=True),
        _norm_fwd_key(x, w, out_dtype=torch.float32),
        _norm_fwd_key(x, w, pdl=1),
    ]
    assert None not in different and base not in different and len(set(different)) == len(different)
    misaligned = torch.randn(6 * 40 + 1, device=DEVICE, dtype=torch.bfloat16)[1:].view(6, 40)
    assert _norm_fwd_key(misaligned, w) is None


def test_the_norm_backward_plan_key_separates_calls_whose_launches_differ():
    h, w = torch.randn(6, 40, device=DEVICE, dtype=torch.bfloat16), torch.randn(40, device=DEVICE)
    dy, rstd, mean = torch.randn_like(h), torch.rand(6, device=DEVICE), torch.randn(6, device=DEVICE)

    def key(h=h, dy=dy, dy1=None, dres=None, w1=None, mean=None, rms=True, bias=False, res=False, x_dtype=None):
        return layer_norm._bwd_plan_key(h, dy, dy1, dres, w, w1, mean, rstd, rms, False, bias, False, res,
                                        x_dtype or h.dtype, h.dtype)

    base = key()
    assert base is not None and key(h=torch.randn_like(h), dy=torch.randn_like(dy)) == base
    different = [key(h=h[:5], dy=dy[:5]), key(dy=torch.randn(6, 80, device=DEVICE, dtype=torch.bfloat16)[:, :40]),
                 key(dy1=dy, w1=w), key(dres=dy), key(mean=mean, rms=False), key(bias=True), key(res=True),
                 key(x_dtype=torch.float32)]
    assert None not in different and base not in different and len(set(different)) == len(different)
    assert key(dy=torch.randn(6 * 40 + 1, device=DEVICE, dtype=torch.bfloat16)[1:].view(6, 40)) is None


_NORM_CASES = {
    "rms_norm": lambda x, r, w, b, be: fk.rms_norm(x, w, eps=1e-6, backend=be),
    "add_rms_norm_prenorm": lambda x, r, w, b, be: fk.rms_norm(x, w, residual=r, prenorm=True, eps=1e-6, backend=be),
    "layer_norm_bias": lambda x, r, w, b, be: fk.layer_norm(x, w, b, backend=be),
    "layer_norm_residual_fp32": lambda x, r, w, b, be: fk.layer_norm(x, w, b, residual=r, prenorm=True,
                                                                     residual_in_fp32=True, backend=be),
    "dual_layer_norm": lambda x, r, w, b, be: fk.layer_norm_dual(x, w, b, w.flip(0), b.flip(0), residual=r,
                                                                 backend=be),
}


def _outputs_and_grads(fn, tensors, douts):
    """fn's outputs and the gradients of every input (None where an input does not reach the outputs)."""
    leaves = [t.detach().requires_grad_() for t in tensors]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return (*outs, *torch.autograd.grad(outs, leaves, douts, allow_unused=True))


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(_NORM_CASES))
def test_norms_from_a_plan_match_the_reference_on_fresh_data(case, monkeypatch):
    """Forward and backward of the fused norms over four calls with fresh data: the second call keeps the plans
    (forward, backward, the partial sums), the last two run from them. Every call matches the reference, and
    a call from plans gives bit for bit what the same call gives without them (the kernels are deterministic)."""
    for table in (layer_norm._FWD_PLANS, layer_norm._BWD_PLANS, partial_sums._PLANS):
        table.clear()
    fn = _NORM_CASES[case]
    for call in range(4):
        x, r = (torch.randn(300, 1000, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        w, b = torch.randn(1000, device="cuda"), torch.randn(1000, device="cuda")
        ref_outs = fn(x, r, w, b, "reference")
        douts = [torch.randn_like(o) for o in (ref_outs if isinstance(ref_outs, tuple) else (ref_outs,))]
        got = _outputs_and_grads(lambda *t: fn(*t, "triton"), (x, r, w, b), douts)
        want = _outputs_and_grads(lambda *t: fn(*t, "reference"), [t.float() for t in (x, r, w, b)],
                                  [d.float() for d in douts])
        with monkeypatch.context() as m:  # the same call on the full launch path: no plan used or made
            m.setattr(LaunchPlans, "get", lambda self, key: None)
            m.setattr(LaunchPlans, "consider", lambda self, key, make_plan: None)
            unplanned = _outputs_and_grads(lambda *t: fn(*t, "triton"), (x, r, w, b), douts)
        for i, (g, w_, u) in enumerate(zip(got, want, unplanned, strict=True)):
            assert (g is None) == (w_ is None) == (u is None)
            if g is not None:
                assert_close(g.float(), w_.float(), torch.bfloat16, scale=2.0, name=f"{case} output/grad {i}")
                assert torch.equal(g, u), f"{case}: output/grad {i} from plans differs from the full launch path"
        expected = 0 if call == 0 else 1
        assert len(layer_norm._FWD_PLANS.plans) == len(layer_norm._BWD_PLANS.plans) == expected
        assert len(partial_sums._PLANS.plans) == expected


def test_present_slots_and_alignment_helpers():
    a, b = torch.zeros(4), torch.zeros(4)
    assert present_slots((0, 3, 5, 9), (a, None, b, None)) == (0, 5)
    assert all_aligned(a, None, b)
    assert not all_aligned(a, torch.zeros(5)[1:])
