"""Shared benchmark plumbing: CUDA-event timing (warm-up, median of many), peak memory, environment record,
JSON and table output. Every bench area measures ours and its peers in the same process with these."""

from __future__ import annotations

import json
import platform
import statistics
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path
from typing import Callable

import torch


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    repeats: int


def time_cuda(fn: Callable[[], object], *, warmup: int = 5, repeats: int = 20, sync_fn: Callable | None = None) -> Timing:
    """Median wall time of ``fn`` on the current CUDA stream, by CUDA events around each call."""
    if not torch.cuda.is_available():
        raise RuntimeError("benchmarks time CUDA kernels and need a CUDA GPU")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return Timing(median_ms=statistics.median(times), min_ms=min(times), repeats=repeats)


def peak_memory_bytes(fn: Callable[[], object]) -> int:
    """Peak CUDA memory allocated while ``fn`` runs, above what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def measure_copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    t = time_cuda(lambda: dst.copy_(src), warmup=3, repeats=20)
    return 2 * src.numel() / (t.median_ms * 1e-3)


def environment() -> dict:
    import transformers
    from flash_kernels._triton_compat import triton

    return {
        "date": date.today().isoformat(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


@dataclass
class BenchResult:
    area: str
    rows: list[dict] = field(default_factory=list)
    env: dict = field(default_factory=environment)

    def add(self, **row) -> dict:
        """Append a row; returns it, for columns filled in once its peers are measured."""
        self.rows.append(row)
        return row

    def write_json(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(asdict(self), indent=2))

    def markdown(self, columns: list[str] | None = None) -> str:
        if not self.rows:
            return "(no rows)"
        columns = columns or list(self.rows[0])
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        for row in self.rows:
            lines.append("| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |")
        return "\n".join(lines)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)
