"""Shared benchmark plumbing: CUDA-event timing (warm-up, median of many), peak memory, environment record,
JSON and table output. Every bench area measures ours and its peers in the same process with these."""

from __future__ import annotations

import contextlib
import gc
import json
import platform
import shlex
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path
from typing import Callable, Hashable

import torch


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    repeats: int


def time_cuda(fn: Callable[[], object], *, warmup: int = 5, repeats: int = 20, back_to_back: bool = False) -> Timing:
    """Median time of ``fn`` on the current CUDA stream, by CUDA events around each call.

    By default each call starts on an idle GPU (a synchronize before it), so its time includes the host's work
    up to its first kernel: the latency of one isolated call. ``back_to_back`` queues the calls one after the
    other and synchronizes once at the end, as calls run inside a model or a training step: a call's time is
    its GPU time, plus host time only where the host cannot keep ahead of the GPU (as triton's do_bench
    times). Kernel benchmarks use it; a fixed launch latency (tens of us for an eager call, ~10 us for a graph
    replay) would otherwise count against whichever side's kernels are shortest."""
    if not torch.cuda.is_available():
        raise RuntimeError("benchmarks time CUDA kernels and need a CUDA GPU")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        if not back_to_back:
            end.synchronize()
        events.append((start, end))
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) for start, end in events]
    return Timing(median_ms=statistics.median(times), min_ms=min(times), repeats=repeats)


def graph_replay(fns: list[Callable[[], object]]) -> Callable[[], None]:
    """One CUDA graph that runs every fn once; returns its replay. Timing replays measures the GPU's work alone:
    no Python, no launch costs (which dominate a batch-1 decode step, or an eager norm's step on a slow host).
    Each fn first runs once as it would eagerly: a first call may autotune or compile, which cannot be captured
    and may wait for the GPU (inductor benchmarking a reduction's configs, torch.compile's first call under
    no_grad). The fns then run once more on a side stream, as a capture needs (torch's CUDA-graph notes: warm-up
    on a side stream), with host synchronizations refused: a fn that still synchronizes then fails there, before
    any capture starts (``_refusing_host_syncs``). Memory cached for other streams is released before the
    warm-up and before the capture: a capture cannot free it to make room (linear + CE's unfused peers take
    ~24 GB a step)."""
    for fn in dict.fromkeys(fns):  # a fn listed several times (decode cycles) needs one first call
        fn()
    torch.cuda.synchronize()
    gc.collect()  # a graph dropped in a reference cycle still holds its memory pool until collected
    torch.cuda.empty_cache()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), _refusing_host_syncs():
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # and what the warm-up cached for the side stream
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return graph.replay


class HostSyncError(RuntimeError):
    """A call that cannot be captured in a CUDA graph because it waits for the GPU (``.item()``, a blocking copy)."""


@contextlib.contextmanager
def _refusing_host_syncs():
    """Raise HostSyncError at a host synchronization instead of letting it happen (torch's sync debug mode).

    Why before the capture: a synchronization inside one invalidates it, and a failed capture keeps its memory
    pool reserved. liger's cross-entropy (its ``.item()`` on the count of valid labels) fails its capture that
    way, and in ``bench ops --graphs`` the next cases found 69 GiB reserved and unusable: every later side ran
    out of memory."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    except RuntimeError as err:
        if "synchronizing" not in str(err):
            raise
        raise HostSyncError(f"cannot be captured in a CUDA graph: it synchronizes with the host ({err})") from None
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def best_of_rounds(measures: dict[Hashable, Callable[[], float]], rounds: int, *,
                   keep_errors: bool = False) -> dict[Hashable, float | Exception]:
    """Run every measure (a callable returning one timing) once per round, the order reversed every other round,
    and return each one's lowest timing. With ``keep_errors`` a measure that raises gets its exception as its
    result and is not run again; otherwise the exception propagates.

    Why rounds: the benchmark machines' hosts stall for seconds at a time (one eager rms_norm step timed 264,
    323 and 551 us in three rounds on one H200; eager attention calls swung by up to 200 us at equal code).
    Timing each side once, one after the other, lets a stall land on one side's whole row; interleaved
    rounds give every side the same chances, and the best round is one a stall missed. Why the reversal: the
    GPU's clock drifts with its load (GEMM-heavy steps of ~80 ms ran 3-5% apart from one round to the next on
    an H100), and in a fixed order the same side always runs right after the same heavy one."""
    best: dict[Hashable, float | Exception] = {key: float("inf") for key in measures}
    for r in range(rounds):
        for key, measure in (list(measures.items()) if r % 2 == 0 else list(measures.items())[::-1]):
            if isinstance(best[key], Exception):
                continue
            try:
                best[key] = min(best[key], measure())
            except Exception as err:
                if not keep_errors:
                    raise
                best[key] = without_tracebacks(err)
    return best


def without_tracebacks(err: BaseException) -> BaseException:
    """err, its tracebacks dropped along its chain of causes and contexts. A kept error must not hold the frames
    of the measurement that raised it: they hold what it made (a CUDA graph and its memory pool, a step's
    tensors), which would stay allocated through the next measurements."""
    seen, link = set(), err
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return err


def add_rounds_argument(parser, per: str) -> None:
    """``--rounds``: how many interleaved rounds ``best_of_rounds`` times the sides of each ``per``."""
    parser.add_argument("--rounds", type=int, default=3,
                        help=f"interleaved timing rounds per {per}; each side reports its best (default 3)")


def add_timing_argument(parser) -> None:
    """``--timing``, for the kernel benchmarks: how ``time_cuda`` times each call (``back_to_back`` or not)."""
    parser.add_argument("--timing", choices=("back-to-back", "isolated"), default="back-to-back",
                        help="calls queued one after another as in a model (default), or each on an idle GPU, "
                             "its launch latency included (see harness.time_cuda)")


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
    t = time_cuda(lambda: dst.copy_(src), warmup=3, repeats=20, back_to_back=True)
    return 2 * src.numel() / (t.median_ms * 1e-3)


def command_line() -> str:
    """How this process was started, as a command to rerun: ``flash-models bench ...`` for the CLI (and
    ``python -m flash_models``), else the Python command."""
    args = sys.argv[1:]
    program = Path(sys.argv[0])
    if args[:1] == ["bench"] and (program.name == "flash-models" or program.parent.name == "flash_models"):
        return shlex.join(["flash-models", *args])
    return shlex.join(["python", sys.argv[0], *args])


def git_commit() -> str | None:
    """The checkout's commit (with "+dirty" when tracked files differ from it), or None outside a git checkout."""
    repo = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


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
        "commit": git_commit(),
        "command": command_line(),
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
