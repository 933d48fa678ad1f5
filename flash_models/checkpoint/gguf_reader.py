"""A lean GGUF reader: the metadata as plain Python values and each tensor as a memory-mapped numpy view.

``gguf.GGUFReader`` builds a numpy view for every part of every metadata value: for a tokenizer's ~50k
vocabulary and merges that is a million views and several seconds on a laptop CPU, paid on every load. This
reader walks the same layout (GGUF v2/v3: header, key/value pairs, tensor infos, aligned data) with ``struct``
over one memory map, decodes strings directly, and reads numeric arrays in one ``numpy.frombuffer``. Tensors
come out as ``gguf.GGUFReader`` gives them (raw bytes per row for quantized types), so ``gguf.quants``
dequantizes them unchanged.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value type -> struct format for scalars (STRING = 8 and ARRAY = 9 are handled apart).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
          10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
# Tensor types stored as plain elements; every other type is quantized blocks, read as bytes per row.
_PLAIN_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}


@dataclass
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: fastest-varying dim first
    data: np.ndarray  # memory-mapped: element dtype for plain types, uint8 bytes per row for quantized ones


class GGUFFile:
    """``fields``: metadata key -> value (str, number, bool or list); ``tensors``: in file order."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as err:  # an empty file cannot be mapped
                raise ValueError(f"cannot read {self.path}: not a valid GGUF file ({err})") from err
        try:
            self._parse()
        except struct.error as err:  # its own words are about buffers and offsets
            raise ValueError(f"cannot read {self.path}: not a valid GGUF file or truncated (its header ends early, "
                             f"at byte {len(self._map)})") from err
        except (ValueError, IndexError, UnicodeDecodeError) as err:
            raise ValueError(f"cannot read {self.path}: not a valid GGUF file or truncated ({err})") from err

    # -- low-level reads at self._pos ----------------------------------------------------------------------
    def _unpack(self, fmt: str):
        value = struct.unpack_from(fmt, self._map, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        if self._pos + n > len(self._map):
            raise ValueError("a string runs past the end of the file")
        s = self._map[self._pos:self._pos + n].decode("utf-8")
        self._pos += n
        return s

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            item_type, count = self._unpack("<I"), self._unpack("<Q")
            if item_type in _NUMPY:
                dtype = np.dtype(_NUMPY[item_type])
                end = self._pos + count * dtype.itemsize
                if end > len(self._map):
                    raise ValueError("an array runs past the end of the file")
                values = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos).tolist()
                self._pos = end
                return values
            return [self._value(item_type) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self._unpack(_SCALARS[vtype])

    # -- layout ----------------------------------------------------------------------------------------------
    def _parse(self) -> None:
        import gguf
        from gguf.quants import quant_shape_to_byte_shape

        self._pos = 0
        if self._map[:4] != MAGIC:
            raise ValueError(f"bad magic {self._map[:4]!r}, expected {MAGIC!r}")
        self._pos = 4
        version = self._unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_fields = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
            infos.append((name, dims, self._unpack("<I"), self._unpack("<Q")))
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0:
            raise ValueError(f"general.alignment must be a positive integer, got {alignment!r}")
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: list[GGUFTensor] = []
        for name, dims, raw_type, offset in infos:
            qtype = gguf.GGMLQuantizationType(raw_type)
            block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n_elements = math.prod(dims)  # exact: numpy's int64 product wraps around on crafted dims
            np_shape = tuple(reversed(dims))
            plain = _PLAIN_TYPES.get(qtype.name)
            if plain is not None:
                dtype, count = np.dtype(plain), n_elements
            else:
                dtype, count = np.dtype(np.uint8), n_elements * type_size // block_size
                np_shape = quant_shape_to_byte_shape(np_shape, qtype)
            start = data_start + offset
            if start + count * dtype.itemsize > len(self._map):
                raise ValueError(f"tensor {name!r} runs past the end of the file")
            data = np.frombuffer(self._map, dtype=dtype, count=count, offset=start).reshape(np_shape)
            self.tensors.append(GGUFTensor(name=name, tensor_type=qtype, shape=dims, data=data))

