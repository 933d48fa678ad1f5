"""Deprecated name of ``flash_models.bench.measure`` (the user-facing ``benchmark_*`` helpers); it warns once and
gives the same functions. Import from ``flash_models.bench.measure``."""

import warnings

from .measure import (backward_and_drop_grads, benchmark_all, benchmark_backward, benchmark_forward,  # noqa: F401
                      benchmark_fwd_bwd, benchmark_memory, time_fn)

warnings.warn("flash_models.bench.utils is renamed flash_models.bench.measure; import from there",
              DeprecationWarning, stacklevel=2)
