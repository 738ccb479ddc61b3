"""An add-on's size before it is loaded, read from its weight files on the CPU: a safetensors file's header (its
first 8 bytes give the length of a JSON table of every tensor's dtype and shape) is all that is read, so a store
knows whether an add-on fits its memory before reading gigabytes of it. Floating tensors are counted at the width of
the dtype in force (a 16-bit file served in float32 takes twice its size), others as stored."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from pathlib import Path

# bytes per element of safetensors' dtypes; the floating ones are cast to the dtype in force when loaded
WIDTHS = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
          "I8": 1, "U8": 1, "BOOL": 1, "U16": 2, "U32": 4, "U64": 8}
FLOATING = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
MAX_HEADER = 100 * 2**20  # safetensors' own bound on the header


def header(file: Path) -> dict:
    """A safetensors file's table of tensors (name -> {"dtype", "shape", ...}); ValueError where it has none."""
    with open(file, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{file.name} is too short for a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER:
            raise ValueError(f"{file.name} has a safetensors header of {n} bytes, more than {MAX_HEADER}")
        table = json.loads(f.read(n))
    if not isinstance(table, dict):
        raise ValueError(f"{file.name} has no safetensors table of tensors")
    table.pop("__metadata__", None)
    return table


def file_bytes(file: Path, width: int, keep=lambda name: True) -> int:
    """The bytes of `file`'s tensors (those whose name `keep` takes) loaded with floating tensors `width` bytes
    wide. A file that is not safetensors (a pickle, .bin) counts its size as float32 weights would."""
    if file.suffix != ".safetensors":
        return math.ceil(file.stat().st_size * width / 4)
    total = 0
    for name, t in header(file).items():
        if keep(name):
            dtype = t.get("dtype")
            total += math.prod(t.get("shape") or ()) * (width if dtype in FLOATING else WIDTHS.get(dtype, 4))
    return total


def files_bytes(files: Iterable[Path], width: int) -> int:
    return sum(file_bytes(f, width) for f in files)


def stamp(files: Iterable[Path]) -> tuple:
    """Changes when any of `files` is replaced: what a remembered "too large" is valid for."""
    out = []
    for f in files:
        try:
            s = f.stat()
            out.append((str(f), s.st_size, s.st_mtime_ns))
        except OSError:
            out.append((str(f), None, None))
    return tuple(out)
