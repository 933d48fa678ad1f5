"""Launch plans: a kernel launch kept per call signature, so that a repeated call skips recomputing arguments.

A call like an attention forward derives 40-odd kernel arguments (strides, bounds, flags, the autotuned
config) from a handful of values (shapes, strides, dtypes, options), and the launch layers then key them again
(``_autotune_cache``, ``_launch``): tens of microseconds of host work per call, as much as the kernel takes at
short sequences. An op keys a call by those few values instead and, the second time it sees a key, keeps the
launch as a ``_launch.Relaunch`` that takes the call's new tensors. A key seen once makes no plan, so ever-new
shapes (a varlen batch's token count) pay nothing extra; the table empties when it reaches ``limit`` keys.
Plans need ``_launch.lean_launch``'s compiled kernels: under the interpreter no plan is made and every call
launches through Triton.
"""

from __future__ import annotations

from typing import Callable, Hashable


class LaunchPlans:
    def __init__(self, limit: int = 512):
        self.limit = limit
        self.plans: dict[Hashable, Callable] = {}
        self.seen: set[Hashable] = set()

    def get(self, key: Hashable | None) -> Callable | None:
        return None if key is None else self.plans.get(key)

    def consider(self, key: Hashable | None, make_plan: Callable[[], Callable | None]) -> None:
        """After a call without a plan: keep ``make_plan()`` (when not None) if ``key`` was seen before."""
        if key is None:
            return
        if key not in self.seen:
            if len(self.seen) >= self.limit:
                self.seen.clear()
                self.plans.clear()
            self.seen.add(key)
            return
        plan = make_plan()
        if plan is not None:
            self.plans[key] = plan

    def clear(self) -> None:
        self.plans.clear()
        self.seen.clear()


def bind_launch(kernel, grid, args: tuple, kwargs: dict, slots: tuple[int, ...]):
    """The ``_launch.Relaunch`` of a launch just made with these arguments, taking new tensors at ``slots``; None
    where the kernel keeps no compiled launch (Triton's own launch path: no ``bind``)."""
    bind = getattr(kernel, "bind", None)
    return None if bind is None else bind(grid, args, kwargs, slots)


def present_slots(positions: tuple[int, ...], tensors: tuple) -> tuple[int, ...]:
    """The argument positions of those ``tensors`` that are not None (an absent optional input is a dummy
    pointer or None in the launch, the same at every call, so a plan keeps it)."""
    return tuple(pos for pos, t in zip(positions, tensors) if t is not None)


def all_aligned(*tensors) -> bool:
    """Whether every given tensor's address is 16-byte aligned (None skipped). Triton specializes a kernel on
    it, so a plan made for aligned inputs must never take a misaligned one: callers make no plan then."""
    ptrs = 0
    for t in tensors:
        if t is not None:
            ptrs |= t.data_ptr()
    return ptrs % 16 == 0
