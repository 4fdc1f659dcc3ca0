"""The safetensors format read and written in bounded memory, for the LoRA merge.

safetensors' Python API writes a file from a dict of tensors held in memory and reads through a memory map (whose
touched pages count as resident memory). Streaming in bounded memory needs the format itself, which is small: 8 bytes
little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then the raw little-endian tensor
bytes. The header is parsed and checked by lorakit.core.model_files.safetensors_header, the one reader of the
package; this module turns its entries into tensors read on demand, and writes files tensor by tensor."""

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from lorakit.core.model_files import safetensors_header
from lorakit.merge.common import InputError

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous tensor (any dtype, bfloat16 included), through numpy."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data


@dataclass
class FileTensor:
    """A tensor inside a safetensors file, read on demand (rows start:stop)."""

    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute position of its first byte

    def read(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows start:stop (the whole tensor by default) in a new tensor."""
        if len(self.shape) == 0:
            out = torch.empty((), dtype=self.dtype)
        else:
            stop = self.shape[0] if stop is None else stop
            out = torch.empty((stop - start, *self.shape[1:]), dtype=self.dtype)
        return self.read_into(out, start)

    def read_into(self, out: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Fill out (contiguous, this dtype) with the rows from start on; plain reads, no mmap."""
        row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize
        buffer = _byte_view(out)
        with open(self.path, "rb", buffering=0) as handle:
            handle.seek(self.offset + start * row_bytes)
            done = 0
            while done < len(buffer):
                got = handle.readinto(buffer[done:])
                if not got:
                    raise InputError(f"{self.path}: file is truncated (a tensor's data ends early)")
                done += got
        return out


@dataclass
class MemoryTensor:
    """A tensor already in memory (a legacy adapter_model.bin), with FileTensor's interface."""

    tensor: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def read(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        if self.tensor.dim() == 0:
            return self.tensor.clone()
        return self.tensor[start:stop].clone()

    def read_into(self, out: torch.Tensor, start: int = 0) -> torch.Tensor:
        return out.copy_(self.tensor if self.tensor.dim() == 0 else self.tensor[start:start + len(out)])



# A saved tensor, read on demand: from a safetensors file, or already in memory.
SavedTensor = FileTensor | MemoryTensor


def data_start(path: str) -> int:
    """Where a safetensors file's tensor data begins: after the 8-byte header length and the header (which
    safetensors_header has already checked)."""
    with open(path, "rb") as handle:
        return 8 + int.from_bytes(handle.read(8), "little")


def file_tensors(path: str) -> dict[str, FileTensor]:
    """{name: FileTensor} for every tensor in a safetensors file, in the file's data order. A damaged header is
    safetensors_header's InputError; a dtype the merge does not handle, or data offsets that do not hold the shape's
    bytes, are refused here, naming the file."""
    header, start, size = safetensors_header(path), data_start(path), os.path.getsize(path)
    entries = []
    for name, info in header.items():
        dtype_name = info.get("dtype")
        dtype = SAFETENSORS_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise InputError(f"{path}: tensor {name} has dtype {info.get('dtype')}, which the merge does not handle")
        begin, end = info["data_offsets"]
        shape = info["shape"]
        if not all(_is_count(value) for value in (begin, end, *shape)):
            raise InputError(f"{path}: tensor {name}: shape or data offsets are not counts (damaged file?)")
        if end - begin != math.prod(shape) * dtype.itemsize or start + end > size:
            raise InputError(f"{path}: tensor {name}: data offsets do not match its shape (damaged file?)")
        entries.append((begin, name, FileTensor(path, dtype, tuple(shape), start + begin)))
    return {name: entry for _, name, entry in sorted(entries)}


def _is_count(value: Any) -> bool:
    """A non-negative int, as a header's shapes and offsets must be (JSON true is an int to Python, not here)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class SafetensorsWriter:
    """Writes a safetensors file whose tensors (names, dtypes, shapes) are known in advance:
    the header first, then each tensor's bytes as they are computed, chunk by chunk."""

    def __init__(self, path: str, layout: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        self.path = path
        header: dict[str, dict[str, Any]] = {"__metadata__": {"format": "pt"}}
        position = 0
        for name, dtype, shape in layout:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": SAFETENSORS_NAMES[dtype], "shape": list(shape),
                            "data_offsets": [position, position + nbytes]}
            position += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
        encoded += b" " * (-len(encoded) % 8)  # tensor data starts 8-byte aligned
        self.expected_end = 8 + len(encoded) + position
        self.handle = open(path, "wb")
        self.handle.write(len(encoded).to_bytes(8, "little"))
        self.handle.write(encoded)

    def write(self, chunk: torch.Tensor) -> None:
        self.handle.write(_byte_view(chunk.contiguous()))

    def close(self) -> None:
        end = self.handle.tell()
        self.handle.close()
        if end != self.expected_end:  # a bug, not bad input: never leave a wrong file unnoticed
            raise RuntimeError(f"{self.path}: wrote {end} bytes, expected {self.expected_end}")
