"""The key/value metadata of a GGUF file, read without touching its tensors (no torch).

`gguf.GGUFReader` maps every tensor as well and takes seconds on a 100 MB file; the tokenizer and
`rl validate` need only the header's key/value section, which this reads in tens of milliseconds. The
file is untrusted data: every length is checked against the file's size and a malformed file is refused
with one line (ValueError). Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor
count, u64 key/value count, then per key a string (u64 length + UTF-8), a u32 value type and the value;
an array is a u32 element type, a u64 count and the elements; arrays of arrays nest at most
`MAX_ARRAY_DEPTH` deep (a file nesting them 100,000 deep would otherwise end in RecursionError).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from gguf import GGUF_MAGIC, GGUFValueType

from model.gguf_file import MAX_ARRAY_DEPTH

_SCALAR = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
           GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
           GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}
_VERSIONS = (2, 3)


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise ValueError(f"{self.path}: truncated or malformed GGUF metadata (a length runs past the end of the file)")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.scalar("<Q"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{self.path}: a GGUF metadata string is not UTF-8") from None

    def value(self, vtype: int, depth: int = 0):
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise ValueError(f"{self.path}: GGUF metadata arrays nested deeper than {MAX_ARRAY_DEPTH} levels")
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if count > len(self.buf) - self.pos:  # every element takes at least one byte
                raise ValueError(f"{self.path}: GGUF metadata array of {count} elements is longer than the file")
            if etype in _SCALAR:
                fmt = _SCALAR[etype]
                return list(struct.unpack(f"<{count}{fmt[1]}", self.take(count * struct.calcsize(fmt))))
            return [self.value(etype, depth + 1) for _ in range(count)]
        if vtype in _SCALAR:
            return self.scalar(_SCALAR[vtype])
        raise ValueError(f"{self.path}: unknown GGUF metadata value type {vtype}")


def read_gguf_metadata(path: str | Path) -> dict[str, object]:
    """Every key/value of the file's header: scalars as Python numbers/bools, strings as str, arrays as lists."""
    path = Path(path)
    try:
        if path.stat().st_size < 24:
            raise ValueError(f"{path}: not a GGUF file (too short)")
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            cur = _Cursor(buf, path)
            if struct.unpack("<I", buf[:4])[0] != GGUF_MAGIC:
                raise ValueError(f"{path}: not a GGUF file (no GGUF magic)")
            cur.take(4)
            version = cur.scalar("<I")
            if version not in _VERSIONS:
                raise ValueError(f"{path}: GGUF version {version} is not supported (versions {_VERSIONS}, little-endian)")
            cur.scalar("<Q")  # tensor count: the tensors are not read here
            out: dict[str, object] = {}
            for _ in range(cur.scalar("<Q")):
                key = cur.string()
                out[key] = cur.value(cur.scalar("<I"))
            return out
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or e})") from None
