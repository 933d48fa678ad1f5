"""Running the real ``flash-models`` entry point in a subprocess, as a user does."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 600,
            stdin: str = "") -> Run:
    """``python -m flash_models ARGS`` with PYTHONPATH inherited; the hub is offline unless ``env`` says else;
    ``stdin`` is what the user types (interactive chat)."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1", **(env or {})}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "flash_models", *args], input=stdin, capture_output=True, text=True,
                          env=full_env, cwd=cwd or REPO, timeout=timeout)
    return Run(done.returncode, done.stdout, done.stderr, time.perf_counter() - start)


def assert_short_error(run: Run, *needles: str) -> None:
    """A user mistake: non-zero exit, one or two lines on stderr naming it, no traceback."""
    lines = run.stderr.strip().splitlines()
    assert run.returncode != 0, (run.stdout, run.stderr)
    assert 1 <= len(lines) <= 2, run.stderr
    assert "Traceback" not in run.stderr
    for needle in needles:
        assert needle in run.stderr, run.stderr
