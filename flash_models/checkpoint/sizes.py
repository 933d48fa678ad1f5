"""Byte sizes written as HF writes them (``max_shard_size="5GB"``). Torch-free: the command line checks a
``--max-shard-size`` before anything loads."""

from __future__ import annotations

import math
import re

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as "5GB", "500MB", "1.5GiB" or "10000"; a size that is not a
    positive number of bytes is a ValueError naming the accepted forms."""
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise ValueError(f"max_shard_size must be an int (bytes) or a string like '5GB', got {size!r}")
    if isinstance(size, int):
        value = size
    else:
        match = _SIZE.fullmatch(size)
        unit = match.group(2).upper() if match else None
        if unit not in _UNITS:
            raise ValueError(f"max_shard_size {size!r} is not a size: write a number of bytes or a number with a "
                             "unit (KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '5GB'")
        value = math.floor(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"max_shard_size must be at least 1 byte, got {size!r}")
    return value
