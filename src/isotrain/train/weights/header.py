"""A `.safetensors` file's header, read and checked by isotrain before the library sees it.

The format: 8 bytes (little-endian length N), N bytes of JSON naming each tensor's dtype,
shape and byte range, then the tensors' bytes. A file from outside is untrusted input, so
every way it can be wrong (a length past the end or absurdly large, JSON that is not an
object, ranges out of the file or overlapping, sizes that do not match dtype x shape) is one
`WeightsFileError` naming the file and what is wrong, and nothing is read beyond the header
until its model config has been checked against these shapes.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isotrain.train.data.sources import DataError

__all__ = [
    "DTYPE_BYTES",
    "SafetensorsHeader",
    "TensorEntry",
    "WeightsFileError",
    "json_kind",
    "library_errors",
    "read_header",
]

MAX_HEADER = 100_000_000  # the safetensors library's own limit on the JSON header
# Bytes per element of each dtype the format names (sub-byte floats are not supported here).
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
_FIX = "try a file written by isotrain export or save_pretrained(..., safe_serialization=True)"


class WeightsFileError(DataError):
    """A weights file (or folder) from outside cannot be used; the message names it and why."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the header describes it: dtype, shape, byte range in the data section."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """The checked header of a `.safetensors` file: its tensors and its string metadata."""

    path: Path
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


def json_kind(value: Any) -> str:
    """What JSON calls `value`'s type, for messages: object, list, string, number, null."""
    names = {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def _bad(path: Path, what: str) -> WeightsFileError:
    return WeightsFileError(f"{path}: not a readable safetensors file: {what}; {_FIX}")


def _json_header(path: Path) -> tuple[Any, int]:
    """The parsed JSON header and the size of the data section after it."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _bad(path, f"{size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, MAX_HEADER):
            where = "past the end of the file" if n > size - 8 else f"over {MAX_HEADER:,} bytes"
            raise _bad(path, f"header length {n:,} is {where} ({size:,} bytes)")
        raw = f.read(n)
    try:
        return json.loads(raw.decode("utf-8")), size - 8 - n
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        reason = "nested too deep" if isinstance(e, RecursionError) else str(e)
        raise _bad(path, f"its header is not JSON ({reason})") from None


def _entry(path: Path, name: str, value: Any, data_size: int) -> TensorEntry:
    """One checked tensor entry: known dtype, non-negative shape, in-range matching size."""
    if not isinstance(value, Mapping) or set(value) != {"dtype", "shape", "data_offsets"}:
        raise _bad(path, f"tensor {name!r} is not {{dtype, shape, data_offsets}}")
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise _bad(path, f"tensor {name!r} has dtype {dtype!r}, which isotrain does not read")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise _bad(path, f"tensor {name!r} has shape {shape!r}, not a list of sizes")
    if not (
        isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
    ):
        raise _bad(path, f"tensor {name!r} has data_offsets {offsets!r}, not [start, end]")
    start, end = offsets
    if not 0 <= start <= end <= data_size:
        raise _bad(
            path,
            f"tensor {name!r} lies at bytes {start:,}..{end:,}, outside the data "
            f"({data_size:,} bytes)",
        )
    need = math.prod(shape) * DTYPE_BYTES[dtype]
    if end - start != need:
        raise _bad(
            path, f"tensor {name!r} ({dtype} {shape}) needs {need:,} bytes, not {end - start:,}"
        )
    return TensorEntry(dtype, tuple(shape), start, end)


def _check_layout(path: Path, tensors: dict[str, TensorEntry], data_size: int) -> None:
    """The tensors tile the data section: no overlap, no gap, nothing after the last."""
    at, before = 0, "the header"
    for name, t in sorted(tensors.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if t.start < at:
            raise _bad(path, f"tensor {name!r} overlaps {before}")
        if t.start > at:
            raise _bad(path, f"{t.start - at:,} unused bytes before tensor {name!r}")
        at, before = t.end, repr(name)
    if at != data_size:
        raise _bad(path, f"{data_size - at:,} bytes after the last tensor")


def read_header(path: str | Path) -> SafetensorsHeader:
    """Read and check `path`'s header (at most its own length, bounded by the file's size)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        raw, data_size = _json_header(p)
    except OSError as e:
        raise _bad(p, f"cannot read it ({e.strerror or e})") from None
    if not isinstance(raw, dict):
        raise _bad(p, f"its header is a JSON {json_kind(raw)}, not an object")
    meta = raw.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _bad(p, "its __metadata__ is not an object of strings")
    tensors = {name: _entry(p, name, value, data_size) for name, value in raw.items()}
    _check_layout(p, tensors, data_size)
    return SafetensorsHeader(p, tensors, meta)


@contextlib.contextmanager
def library_errors(path: str | Path) -> Iterator[None]:
    """What the safetensors library still finds when it reads `path` after these checks (the
    file changed since, an I/O error) as one line too."""
    from safetensors import SafetensorError

    try:
        yield
    except (SafetensorError, OSError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise _bad(Path(path), f"{reason} (did it change while it was read?)") from None
