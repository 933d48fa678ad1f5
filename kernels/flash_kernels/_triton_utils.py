"""Small helpers shared by the Triton op files: launch geometry, row views and custom-op placeholders."""

from __future__ import annotations

import functools

import torch

from ._backend import records_grad, triton_interpreter_enabled


# Host-side launch arithmetic in plain Python: in recent Triton (3.9 on the CPU machine this was measured on)
# ``triton.next_power_of_2`` and ``triton.cdiv`` are constexpr functions whose call from host code cost 3.5-4.7
# us each there (these: 0.15 us), and an eager attention forward computed three of them.
def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    n = int(n)
    return 1 << (n - 1).bit_length() if n > 1 else 1


def cdiv(a: int, b: int) -> int:
    """a / b rounded up, for positive b."""
    return -(-a // b)


def warps_for_block(block: int, *, elems_per_thread: int = 8, max_warps: int = 16) -> int:
    """Warps for a 1-D tile of ``block`` elements: enough threads that each holds a few elements."""
    return max(1, min(max_warps, block // (32 * elems_per_thread)))


@functools.cache
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (cached: get_device_properties costs about 8 us a call)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def device_capability(device_index: int) -> tuple[int, int]:
    """A CUDA device's compute capability (cached: torch's query costs microseconds a call)."""
    return torch.cuda.get_device_capability(device_index)


def hopper_or_newer(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or newer (TMA, programmatic dependent launch)."""
    return device.type == "cuda" and device_capability(
        device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch (a kernel launched while its predecessor still runs, waiting in-kernel with
    ``tl.extra.cuda.gdc_wait``) works here: a Hopper-or-newer GPU, not Triton's interpreter."""
    return hopper_or_newer(device) and not triton_interpreter_enabled()


def num_programs(device: torch.device, per_sm: int = 4) -> int:
    """Programs for a persistent-style grid: a few per SM on CUDA, a handful under the interpreter."""
    if device.type == "cuda":
        return sm_count(device.index if device.index is not None else torch.cuda.current_device()) * per_sm
    return 4


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x viewed as (rows, last dim) with a unit stride on the last dim (copying only when it must). A 2-D x with
    a unit last stride is returned as it is: a reshape would still make a view, which autograd records as a
    node of its own (one more backward step, host time an eager norm cannot spare)."""
    if x.dim() == 2 and x.stride(-1) == 1:
        return x
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def placeholder(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An empty tensor standing in for an absent custom-op output (custom ops cannot return None)."""
    return torch.empty(0, device=device, dtype=dtype)


def or_placeholder(t: torch.Tensor | None, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """t, or an empty stand-in where t is None: what a custom op returns for an output its eager twin omits."""
    return t if t is not None else placeholder(device, dtype)


_DUMMIES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def dummy_pointer(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor passed where a kernel takes a pointer it never reads (an absent optional input),
    made once per device and dtype rather than allocated at every launch."""
    key = (device, dtype)
    if key not in _DUMMIES:
        _DUMMIES[key] = torch.empty(1, device=device, dtype=dtype)
    return _DUMMIES[key]


def unit_last_stride(t: torch.Tensor | None) -> torch.Tensor | None:
    """t with a unit stride on its last dim, copied only where it has none (None stays None). The kernels take
    the outer strides of their tables (cos/sin, block tables) and none of their 1-D inputs (weights, labels,
    offsets, ids): a strided or expanded one would be read as if it were contiguous."""
    return t if t is None or t.dim() == 0 or t.stride(-1) == 1 else t.contiguous()


def or_dummy(t: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """t, or the dummy pointer where t is None (a kernel argument its constexpr flags never touch)."""
    return t if t is not None else dummy_pointer(device, dtype)


def dropout_seed(device: torch.device) -> torch.Tensor:
    """A fresh Philox seed drawn from torch's generator, kept on the device so that no host sync is needed.

    Kernels load it from memory; the backward regenerates the same keep mask from it instead of storing it.
    """
    return torch.randint(0, 2**31 - 1, (1,), device=device, dtype=torch.int64)


def eager_function(name: str, forward_impl, setup_context, backward):
    """An autograd.Function calling ``forward_impl`` directly, sharing a custom op's setup_context/backward.

    Eager calls use it instead of the torch.library custom op: the dispatcher costs tens of microseconds per
    call in Python, as much as a memory-bound kernel takes on the GPU. Under torch.compile the public functions
    call the custom op, which the compiler traces as one opaque node. With grad mode off, ``forward_impl`` is
    called directly, as it is when no input needs a gradient.
    """

    def forward(ctx, *args):
        ctx.set_materialize_grads(False)  # unused outputs get None, not a buffer of zeros
        out = forward_impl(*args)
        setup_context(ctx, args, out)
        return out

    fn = type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})

    def apply(*args):
        # Where nothing would be recorded (grad mode off, or no input that needs a gradient), skip
        # autograd.Function's own host cost (tens of microseconds): its result would be the same tensors.
        if records_grad(*args):
            return fn.apply(*args)
        return forward_impl(*args)

    return apply


def pick(custom_op, eager):
    """The custom op while torch.compile traces, else the low-overhead eager path."""
    return custom_op if torch.compiler.is_compiling() else eager
