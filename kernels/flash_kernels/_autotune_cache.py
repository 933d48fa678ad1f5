"""Launch autotuned kernels without Triton's per-launch autotuner bookkeeping once a config is chosen.

``triton.runtime.autotuner.Autotuner.run`` rebuilds its cache key at every launch: two dicts over all the
kernel's arguments (about 45 for our attention kernels), a list-membership test per argument and ``str()`` of
every tensor's dtype. That is 43 us per launch on the CI machine's CPU (and as much of a cProfile of an H200
host's attention call), against 2.5 us for the lookup here, and an eager attention forward + backward makes
three such launches. ``cached_autotune`` wraps an ``@triton.autotune`` kernel: the first launch per key goes
through the Autotuner (which benchmarks or finds its choice); later ones call the JIT function directly with
the chosen config's meta-parameters, through ``_launch.lean_launch``.

The key is the Autotuner's own (the values of its ``key`` arguments, then every tensor argument's dtype), built
from precomputed argument positions, so a cached choice is only reused where Triton would reuse it. A chosen
config's ``pre_hook`` (which sets up arguments for it, e.g. the boxes of TMA descriptors) runs before each
cached launch, with the named arguments and the config's meta-parameters, as the Autotuner calls it. Without
Triton (``_triton_compat``) the decorator returns the kernel unchanged.
"""

from __future__ import annotations

import torch

from ._launch import lean_launch
from ._triton_compat import triton


def cached_autotune(kernel):
    """Decorator over ``@triton.autotune``: ``kernel[grid](*args, **kwargs)`` as before, cheaper after the first
    launch of each key."""
    autotuner = getattr(getattr(triton, "runtime", None), "autotuner", None)
    if autotuner is None or not isinstance(kernel, autotuner.Autotuner):
        return kernel
    return CachedAutotune(kernel)


class CachedAutotune:
    def __init__(self, autotuner):
        self.autotuner = autotuner
        # The @triton.jit function (an InterpretedFunction under TRITON_INTERPRET=1), launched lean once tuned.
        self.jit = lean_launch(autotuner.fn)
        positions = {name: i for i, name in enumerate(autotuner.arg_names)}
        self.key_args = [(name, positions[name]) for name in autotuner.keys]
        self.arg_names = autotuner.arg_names
        self.chosen: dict[tuple, tuple] = {}  # key -> (the chosen config's meta-parameters, its pre_hook)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def key(self, args: tuple, kwargs: dict) -> tuple:
        n = len(args)
        values = [args[pos] if pos < n else kwargs.get(name) for name, pos in self.key_args]
        dtypes = [a.dtype for a in args if isinstance(a, torch.Tensor)]
        dtypes += [v.dtype for v in kwargs.values() if isinstance(v, torch.Tensor)]
        return (*values, *dtypes)

    def launch(self, grid, args: tuple, kwargs: dict):
        key = self.key(args, kwargs)
        chosen = self.chosen.get(key)
        if chosen is not None:
            meta, pre_hook = chosen
            if pre_hook is not None:
                pre_hook({**dict(zip(self.arg_names, args)), **kwargs, **meta})
            return self.jit[grid](*args, **kwargs, **meta)
        result = self.autotuner[grid](*args, **kwargs)
        config = self.autotuner.best_config
        self.chosen[key] = (config.all_kwargs(), config.pre_hook)
        return result

    def bind(self, grid, args: tuple, kwargs: dict, slots: tuple[int, ...]):
        """``LeanKernel.bind`` for the config chosen for these arguments; None before the choice, for a config
        with a pre_hook (which must run at every launch), or when launches do not go through ``lean_launch``."""
        chosen = self.chosen.get(self.key(args, kwargs))
        if chosen is None or chosen[1] is not None or not hasattr(self.jit, "bind"):
            return None
        return self.jit.bind(grid, args, {**kwargs, **chosen[0]}, slots)
