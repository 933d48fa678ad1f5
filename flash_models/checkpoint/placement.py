"""Where and in which dtype a loaded model's weights go: the ``dtype`` and ``device`` arguments every loader takes
(``from_pretrained``, ``from_timm``, ``create_model``), checked before anything loads."""

from __future__ import annotations

import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """A floating torch dtype from a dtype or its name; None is float32. Anything else is a ValueError."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str):
        value = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(value, torch.dtype):
            auto = " ('auto', the checkpoint's own dtype, is for from_pretrained)" if dtype == "auto" else ""
            raise ValueError(f"dtype {dtype!r} is not a torch dtype{auto}; use one of {DTYPE_NAMES} or a torch.dtype")
        dtype = value
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype or its name {DTYPE_NAMES}, got {dtype!r}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype {dtype} is not a floating-point dtype: model weights need one of {DTYPE_NAMES}")
    return dtype


def resolve_device(device: torch.device | str | int | None) -> torch.device:
    """A torch device from what ``torch.device`` takes (None is the CPU, an int a CUDA index, as in torch); a
    CUDA device this machine does not have is a ValueError before anything loads."""
    if device is None:
        return torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device {device!r} is not a torch device ({err})") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: no CUDA GPU is available here (torch {torch.__version__}); use 'cpu'")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if resolved.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r}: Apple's MPS is not available here; use 'cpu'")
    return resolved
