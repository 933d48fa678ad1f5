"""Launching the distributed tests' workers under torchrun, stopped whole if a rank hangs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


def torchrun(args: list[str], *, ranks: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node RANKS ARGS`` with this checkout first on the path. A run past
    ``timeout`` fails the test: SIGTERM lets torchrun stop its workers, which run in sessions of their own and
    would outlive a SIGKILL of torchrun alone."""
    root = Path(__file__).parents[2]
    path = [str(root), str(root / "kernels"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(path)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *args]
    proc = subprocess.Popen(command, env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # a rank left waiting for the others
        proc.terminate()
        _, stderr = proc.communicate(timeout=60)
        pytest.fail(f"the workers did not finish in {timeout} s (a rank waiting for others?): {stderr[-4000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)
