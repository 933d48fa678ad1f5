"""Launch ``@triton.jit`` kernels with less host work than ``kernel[grid](...)`` once a kernel is compiled.

``JITFunction.run`` redoes at every launch what only changes when the compiled kernel would: it reads Triton's
knobs, binds every argument through a generated function, specializes each one, builds and hashes a cache key
from the specialization and the options, and checks the kernel's globals. For a launch of 33 arguments like
our norm kernel's that is several times the compiled kernel's own launcher's host time (measured on an H100's
host); a norm forward + backward makes three such launches, an attention one four, and an eager training step
hundreds.

``lean_launch`` wraps a ``@triton.jit`` kernel behind the same ``kernel[grid](*args, **kwargs)`` call. The
first launch of each *launch key* goes through Triton (which compiles or finds the kernel) and keeps the
compiled kernel it returns; later launches with the same key call that compiled kernel directly.

The launch key holds everything Triton's own specialization reads, never less:
- per positional argument: a tensor's dtype and whether its address is 16-byte aligned; an int's three
  classes (equal to 1, a multiple of 16, fits in int32); the type of a float, a bool or None; the value itself
  for a ``tl.constexpr`` parameter;
- a host tensor descriptor's (Gluon's or ``triton.tools``') dtype, box shape, padding and, for Gluon's, its
  shared-memory layout (Triton specializes on those only: the base address, shape and strides become the
  launch's own arguments, its CUtensorMap made per launch by the compiled kernel's launcher);
- every keyword argument's name and value (our constexprs and launch options: ``num_warps``, ``BLOCK``...);
- the current CUDA device (a compiled kernel is loaded per device).
It may be finer than Triton's (one compiled kernel under several keys), which costs only a first launch each.
An argument of any other type (a custom object) or a tensor passed by keyword takes Triton's own path at every
launch. A grid given as a function is called as Triton calls it.
Triton's global knobs (``TRITON_DEBUG``...) are read when a key is first launched; changing them later is not
seen here.

A kept kernel is launched by ``CompiledLaunch``: the compiled kernel's launcher called as Triton's runner
(``CompiledKernel.__getitem__``) calls it, less the runner's per-launch Python (the device and stream lookups
through Triton's driver proxy, a dict of launch metadata and two calls of empty hook chains), which only the
launch hooks of a profiler such as proton read: while one is registered, the runner launches instead. A
``Relaunch`` on that launcher passes its tensors as their addresses, which the launcher takes as they are;
a tensor costs it a ``data_ptr`` call and a driver query (``cuPointerGetAttribute``) that checks the address
is a device's. The Relaunch checks instead that each tensor is on the kernel's device, which its own call
costs less: a host address would reach the kernel unchecked. This takes an eager norm forward + backward step
less host time (``flash-models bench overhead`` and ``scripts/profile/host_cost.py`` measure our ops' host time
per call).

Every kernel GPU test runs with it. Under Triton's interpreter (``TRITON_INTERPRET=1``, how CI runs the kernels) or without
Triton, the decorator returns the kernel unchanged.
"""

from __future__ import annotations

import functools
import inspect

import torch

from ._triton_compat import TRITON_AVAILABLE, triton

_INT32 = range(-(2**31), 2**31)  # `in range` is a constant-time bounds check for an int
_Tensor = torch.Tensor

_GluonDescriptor = ()  # without Gluon's Hopper descriptor (Triton 3.6+) no argument is one
_ToolsDescriptor = ()  # without triton.tools' host descriptor (Triton 3.3+) no argument is one
_HookChain, _runtime_knobs = (), None  # Triton 3.5+: launch hooks are chains, empty unless a profiler registers one
if TRITON_AVAILABLE:  # not Triton's own import where it is not loaded (see _triton_compat)
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonDescriptor
    except (ImportError, AttributeError):  # pragma: no cover - depends on the installed Triton
        pass
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor as _ToolsDescriptor
    except ImportError:  # pragma: no cover - depends on the installed Triton
        pass
    try:
        from triton.knobs import HookChain as _HookChain
        from triton.knobs import runtime as _runtime_knobs
    except ImportError:  # pragma: no cover - depends on the installed Triton
        pass

# The current device's index and its current stream's handle, without torch.cuda.current_device's lazy-init
# check (a launch's tensors are CUDA tensors: CUDA is initialized) or Triton's driver proxy.
_device_index = getattr(torch._C, "_cuda_getDevice", None)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

# The parameters Triton's runner passes the compiled kernel's launcher first (Triton 3.4-3.8): only a
# launcher taking these is called directly.
_LAUNCHER_PARAMETERS = ("gridX", "gridY", "gridZ", "stream", "function")


class _Unkeyable(Exception):
    """An argument whose specialization the launch key cannot express: Triton's own path launches it."""


def _other_arg_key(arg) -> object:
    """The launch key's part for an argument that is neither a plain tensor nor an int."""
    if isinstance(arg, torch.Tensor):  # a subclass (nn.Parameter)
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    kind = type(arg)
    if kind is float or kind is bool or arg is None:
        return kind
    if isinstance(arg, _GluonDescriptor):  # (its layout is a frozen dataclass: hashable, compared by value)
        return (kind, arg.base.dtype, tuple(arg.block_shape), arg.layout, getattr(arg, "padding", "zero"))
    if isinstance(arg, _ToolsDescriptor):  # (as Triton's: the box, not the base, shape or strides)
        return (kind, arg.base.dtype, tuple(arg.block_shape), getattr(arg, "padding", "zero"),
                getattr(arg, "round_f32_to_tf32", False))
    raise _Unkeyable


def arguments_key(args: tuple) -> list:
    """The launch key's part for positional arguments (constexprs aside): what Triton specializes each on.
    Raises _Unkeyable for an argument it cannot express."""
    # Plain tensors and ints take the inline branches: this runs at every launch, for 20-40 arguments.
    return [
        (a.dtype, a.data_ptr() % 16 == 0) if type(a) is _Tensor
        else (a == 1, a % 16 == 0, a in _INT32) if type(a) is int
        else _other_arg_key(a)
        for a in args
    ]


def lean_launch(kernel):
    """Decorator over ``@triton.jit``: launches as ``kernel[grid](*args, **kwargs)``, cheaper after the first
    launch of each key. Returns the kernel unchanged under the interpreter or without Triton."""
    if not TRITON_AVAILABLE:
        return kernel
    if not isinstance(kernel, triton.runtime.jit.JITFunction):
        return kernel
    return LeanKernel(kernel)


class LeanKernel:
    def __init__(self, jit):
        self.jit = jit
        self.__name__ = jit.__name__
        params = inspect.signature(jit.fn).parameters
        self.arg_names = list(params)
        self.defaults = {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty}
        self.constexpr_positions = tuple(p.num for p in jit.params if p.is_constexpr)
        self.compiled: dict[tuple, tuple] = {}  # launch key -> (compiled kernel, the arguments after args)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch_key(self, args: tuple, kwargs: dict) -> tuple:
        """The key of a launch on the current device (which ``launch`` adds); raises _Unkeyable."""
        specs = arguments_key(args)
        if self.constexpr_positions:
            specs += [("constexpr", args[i]) for i in self.constexpr_positions if i < len(args)]
        return (*specs, *kwargs.items())

    def launch(self, grid, args: tuple, kwargs: dict):
        try:
            key = (_device_index(), *self.launch_key(args, kwargs))
            entry = self.compiled.get(key)
        except (_Unkeyable, TypeError):  # TypeError: an unhashable keyword argument
            return self.jit[grid](*args, **kwargs)
        if entry is None:
            return self._first_launch(key, grid, args, kwargs)
        launcher, rest = entry
        launcher.launch(_grid3(grid, self.arg_names, args, rest), (*args, *rest))
        return launcher.compiled

    def bind(self, grid, args: tuple, kwargs: dict, slots: tuple[int, ...]) -> "Relaunch | None":
        """The compiled kernel, grid and arguments of an earlier launch with exactly these arguments, as a
        ``Relaunch`` taking new tensors at the positional indices ``slots``; None where no compiled kernel is
        kept for them (not launched yet, or launched through Triton's own path)."""
        try:
            key = (_device_index(), *self.launch_key(args, kwargs))
        except (_Unkeyable, TypeError):
            return None
        entry = self.compiled.get(key)
        if entry is None:
            return None
        launcher, rest = entry
        return Relaunch(launcher, _grid3(grid, self.arg_names, args, rest), (*args, *rest), slots)

    def _first_launch(self, key: tuple, grid, args: tuple, kwargs: dict):
        compiled = self.jit.run(*args, grid=grid, warmup=False, **kwargs)
        if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
            return compiled  # a tensor's key is its specialization, not its value: never cache one by value
        if not (hasattr(compiled, "run") and hasattr(compiled, "__getitem__")):
            return compiled  # a Triton whose launch returns something else: keep its own path
        try:
            rest = tuple(kwargs[name] if name in kwargs else self.defaults[name] for name in self.arg_names[len(args):])
        except KeyError:
            return compiled
        self.compiled[key] = (CompiledLaunch.of(compiled, key[0]), rest)
        return compiled


def _grid3(grid, arg_names: list[str], args: tuple, rest: tuple) -> tuple[int, int, int]:
    """The launch's three-dimensional grid. A grid function is called as Triton calls it: with every parameter
    by name (autotuned block sizes included)."""
    if callable(grid):
        grid = grid(dict(zip(arg_names, (*args, *rest))))
    return (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)


def _no_hook(hook) -> bool:
    return hook is None or (isinstance(hook, _HookChain) and not hook.calls)


def launch_hooks_idle() -> bool:
    """Whether no launch hook is registered (a profiler such as proton registers one)."""
    return _no_hook(_runtime_knobs.launch_enter_hook) and _no_hook(_runtime_knobs.launch_exit_hook)


class _RunnerLaunch:
    """Launches through the compiled kernel's own runner (``compiled[grid](*args)``): a kernel whose launcher
    ``CompiledLaunch`` does not know, and a stand-in compiled kernel in the tests."""

    __slots__ = ("compiled",)
    takes_addresses = False

    def __init__(self, compiled):
        self.compiled = compiled

    def launch(self, grid3: tuple[int, int, int], args) -> None:
        self.compiled[grid3](*args)


class CompiledLaunch:
    """Launches one compiled kernel on one device by calling its launcher as Triton's runner does, less the
    runner's per-launch Python (module docstring); while a launch hook is registered, the runner launches."""

    __slots__ = ("compiled", "run", "function", "metadata", "device")
    takes_addresses = True  # a tensor argument may be passed as its address (a plain int)

    def __init__(self, compiled, device: int):
        self.compiled = compiled
        self.run = compiled.run  # (Triton's property loads the kernel's module and function on first use)
        self.function, self.metadata = compiled.function, compiled.packed_metadata
        self.device = device

    @staticmethod
    def of(compiled, device: int) -> "CompiledLaunch | _RunnerLaunch":
        """The direct launcher where this Triton's launcher takes the runner's arguments, else the runner's."""
        if _runtime_knobs is None or _raw_stream is None or not all(
                hasattr(compiled, name) for name in ("run", "function", "packed_metadata")):
            return _RunnerLaunch(compiled)
        if _launcher_parameters(type(compiled.run)) != _LAUNCHER_PARAMETERS:
            return _RunnerLaunch(compiled)
        return CompiledLaunch(compiled, device)

    def launch(self, grid3: tuple[int, int, int], args) -> None:
        if not launch_hooks_idle():
            self.compiled[grid3](*args)
            return
        # The runner's call, with no launch metadata and no hooks: the launcher skips both where they are None.
        self.run(grid3[0], grid3[1], grid3[2], _raw_stream(self.device), self.function, self.metadata,
                 None, None, None, *args)


@functools.cache
def _launcher_parameters(launcher_type: type) -> tuple[str, ...]:
    """The first parameters of a compiled kernel's launcher, after self (the runner's positional order)."""
    try:
        names = list(inspect.signature(launcher_type.__call__).parameters)
    except (TypeError, ValueError):
        return ()
    return tuple(names[1:1 + len(_LAUNCHER_PARAMETERS)])


class Relaunch:
    """One compiled kernel launch, kept with its grid and every argument, that runs again on new tensors.

    Made by ``LeanKernel.bind`` (or ``CachedAutotune.bind``) right after a launch; the caller owns the promise
    that makes reuse valid: its own key covers every value the arguments were computed from, and the new
    tensors specialize as the old ones did (same dtypes, 16-byte aligned where those were). The tensors at
    ``slots`` are not kept (a kept launch must not hold on to a caller's memory). On a ``CompiledLaunch`` every
    tensor goes to the kernel as its address (module docstring); the template's own tensors (dummy pointers)
    are kept alive by ``kept``.
    """

    __slots__ = ("launcher", "grid", "template", "slots", "addresses", "kept")

    def __init__(self, launcher, grid3: tuple[int, int, int], args: tuple, slots: tuple[int, ...]):
        self.launcher, self.grid = launcher, grid3
        self.addresses = launcher.takes_addresses
        template = list(args)
        for i in slots:
            template[i] = None
        self.kept = tuple(a for a in template if isinstance(a, torch.Tensor))
        if self.addresses:
            template = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in template]
        self.template = template
        self.slots = slots

    def __call__(self, *tensors: torch.Tensor) -> None:
        args = self.template.copy()
        if self.addresses:
            device = self.launcher.device
            for i, t in zip(self.slots, tensors):
                if t.get_device() != device:
                    raise ValueError(
                        f"flash_kernels: a kernel launched on cuda:{device} (the current device) got a tensor on "
                        f"{t.device}: pass the op its inputs on the current CUDA device (tensor.to('cuda:{device}'), "
                        f"or make theirs current with torch.cuda.set_device)")
                args[i] = t.data_ptr()
        else:
            for i, t in zip(self.slots, tensors):
                args[i] = t
        self.launcher.launch(self.grid, args)
