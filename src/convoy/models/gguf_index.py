"""A GGUF file's tensor table and scalar metadata, memory-mapped, without its metadata arrays.

gguf's `GGUFReader` parses every metadata value into numpy arrays, the tokenizer's vocabulary
too: while a reader lives that is +160 MB of RSS for SmolLM2's 49k tokens and +690 MB for Gemma
3's 262k (measured), and the freed objects fragment the heap after. Loading weights needs the
tensors and a few scalars only: `read_gguf_index` reads those and steps over the arrays.

Its tensors have GGUFReader's attributes (`name`, `tensor_type`, `shape` in GGML order,
`n_elements`, `n_bytes`, `data`: a read-only numpy view of the mapped file, (rows, row bytes)
uint8 for block types), and `fields` holds the scalar and string values under the same keys
(`gguf_convert.field(index, key)` works); array values are left out.
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from convoy.kernels.huge_pages import PAGE, drop_pages
from convoy.models.gguf_convert import ModelLoadError

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q"}
_SCALARS |= {11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32
# GGML types stored as plain numpy elements (the rest are viewed as bytes), as GGUFReader does.
_ELEMENT_TYPES = {
    0: np.float32,
    1: np.float16,
    24: np.int8,
    25: np.int16,
    26: np.int32,
    27: np.int64,
    28: np.float64,
}


@dataclass(slots=True)
class IndexField:
    value: Any

    def contents(self) -> Any:
        return self.value


@dataclass(slots=True)
class IndexTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGML order (fastest dimension first), as GGUFReader
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


@dataclass(slots=True)
class GGUFIndex:
    path: Path
    fields: dict[str, IndexField]
    tensors: list[IndexTensor]


def read_gguf_index(path: Path) -> GGUFIndex:
    """The tensors and scalar fields of the GGUF at `path`; ModelLoadError naming the file when
    it is not a readable GGUF (bad magic, truncated, unknown value or tensor type)."""
    try:
        return _read(path)
    except (ValueError, struct.error, IndexError, KeyError, OverflowError) as e:
        raise ModelLoadError(f"{path}: not a valid GGUF file ({type(e).__name__}: {e})") from e


def _read(path: Path) -> GGUFIndex:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    data = np.memmap(path, mode="r")
    if bytes(data[:4]) != _MAGIC:
        raise ValueError("bad magic")
    version, num_tensors, num_fields = struct.unpack_from("<IQQ", data, 4)
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version}")
    off = 24
    fields: dict[str, IndexField] = {}
    for _ in range(num_fields):
        key, off = _string(data, off)
        (kind,) = struct.unpack_from("<I", data, off)
        value, off = _value(data, off + 4, kind)
        if value is not _SKIPPED:
            fields[key] = IndexField(value)
    infos = []
    for _ in range(num_tensors):
        name, off = _string(data, off)
        (num_dims,) = struct.unpack_from("<I", data, off)
        dims = np.array(struct.unpack_from(f"<{num_dims}Q", data, off + 4), dtype=np.uint64)
        off += 4 + 8 * num_dims
        qtype, offset = struct.unpack_from("<IQ", data, off)
        off += 12
        infos.append((name, dims, qtype, offset))
    alignment = int(fields.get("general.alignment", IndexField(_DEFAULT_ALIGNMENT)).value)
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"invalid alignment {alignment}")
    start = -(-off // alignment) * alignment
    tensors = []
    for name, dims, qtype, offset in infos:
        ggml_type = GGMLQuantizationType(qtype)
        block, nbytes = GGML_QUANT_SIZES[ggml_type]
        n_elements = int(np.prod(dims))
        n_bytes = n_elements * nbytes // block
        begin = start + int(offset)
        if begin + n_bytes > data.shape[0]:
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        shape = tuple(int(d) for d in reversed(dims.tolist()))
        item = _ELEMENT_TYPES.get(qtype)
        if item is None:
            if shape[-1] % block:
                raise ValueError(f"tensor {name!r}: rows of {shape[-1]} in blocks of {block}")
            shape, item = (*shape[:-1], shape[-1] // block * nbytes), np.uint8
        view = data[begin : begin + n_bytes].view(item).reshape(shape)
        tensors.append(IndexTensor(name, ggml_type, dims, n_elements, n_bytes, begin, view))
    return GGUFIndex(path, fields, tensors)


_SKIPPED = object()


def drop_mapped_pages(path: Path) -> int:
    """Take this process's mapped pages of the file at `path` out of its resident set
    (`madvise(MADV_DONTNEED)` on every mapping of it in /proc/self/maps); returns the bytes of
    the mappings. The maps are read-only views of the file, so nothing is lost: a page touched
    again is mapped back from the page cache. A load calls this after each module it repacked,
    so the file's pages and their repacked copies are not resident together (Linux only; a no-op
    elsewhere)."""
    spans = MappedPages(path).spans
    for start, length in spans:
        drop_pages(start, length)
    return sum(length for _, length in spans)


class MappedPages:
    """This process's read-only mappings of one file (from /proc/self/maps, when made), whose
    pages can be dropped from the resident set as above: all of them, or the pages under one
    tensor (`release`: a module repacked piece by piece, an expert at a time, lets each piece's
    pages go at once). Memory outside these mappings is never touched. Linux only; elsewhere
    it knows no mapping and drops nothing."""

    def __init__(self, path: Path) -> None:
        self.spans: list[tuple[int, int]] = []
        if not sys.platform.startswith("linux"):
            return
        target = str(Path(path).resolve())
        try:
            with open("/proc/self/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    if (
                        len(fields) == 6
                        and fields[5].rstrip("\n") == target
                        and "w" not in fields[1]
                    ):
                        start, end = (int(x, 16) for x in fields[0].split("-"))
                        self.spans.append((start, end - start))
        except OSError:
            self.spans = []

    def release(self, tensor: Any) -> None:
        """Drop the whole pages under `tensor`'s bytes (a contiguous view of the file's mapping)
        that lie in one of the file's mappings; nothing where it is other memory."""
        lo = tensor.data_ptr()
        hi = lo + tensor.numel() * tensor.element_size()
        for start, length in self.spans:
            a = max(lo + PAGE - 1, start) // PAGE * PAGE
            b = min(hi, start + length) // PAGE * PAGE
            drop_pages(a, b - a)


def _string(data: np.ndarray, off: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", data, off)
    end = off + 8 + n
    if end > data.shape[0]:
        raise ValueError("string runs past the end of the file")
    return bytes(data[off + 8 : end]).decode("utf-8"), end


def _value(data: np.ndarray, off: int, kind: int) -> tuple[Any, int]:
    """A metadata value of `kind` at `off` -> (value, end); arrays are stepped over: _SKIPPED."""
    fmt = _SCALARS.get(kind)
    if fmt is not None:
        return struct.unpack_from(fmt, data, off)[0], off + struct.calcsize(fmt)
    if kind == _STRING:
        return _string(data, off)
    if kind != _ARRAY:
        raise ValueError(f"unknown metadata value type {kind}")
    item, count = struct.unpack_from("<IQ", data, off)
    off += 12
    item_fmt = _SCALARS.get(item)
    if item_fmt is not None:
        return _SKIPPED, off + count * struct.calcsize(item_fmt)
    for _ in range(count):  # strings (a vocabulary) or nested arrays: each has its own length
        if item == _STRING:
            (n,) = struct.unpack_from("<Q", data, off)
            off += 8 + n
        else:
            _, off = _value(data, off, item)
    if off > data.shape[0]:
        raise ValueError("metadata array runs past the end of the file")
    return _SKIPPED, off
