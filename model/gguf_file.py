"""A GGUF file's header and tensor bytes, read without torch (and without the `gguf` package for the
header, so `rl validate` of a recipe whose `model.init` is a GGUF file stays instant).

Layout (GGUF v2/v3, little-endian; https://github.com/ggml-org/ggml/blob/master/docs/gguf.md):

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x  (key: string, value_type u32, value)
    tensor_count x  (name: string, n_dims u32, dims u64[n_dims], ggml_type u32, offset u64)
    padding to `general.alignment` (default 32) | tensor data (each tensor at data_start + offset)

A string is a u64 length and UTF-8 bytes; an array is an element type u32, a count u64 and the elements.
`dims` lists the fastest-varying dimension first (ne0 = columns), so a [out, in] weight has dims (in, out);
`GGUFTensorInfo.shape` gives the row-major (torch / numpy) order instead.

Dequantisation (`GGUFFile.dequantized`) uses `gguf.quants.dequantize`, one tensor at a time.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

MAX_ARRAY_DEPTH = 8
"""Most levels of arrays of arrays a GGUF metadata value may have (llama.cpp writes at most 2); deeper is refused
with one line (100,000 levels would otherwise end in RecursionError)."""

MAGIC = b"GGUF"

GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
              11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
              19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
              27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}
"""ggml type id -> name (ggml.h `enum ggml_type`)."""

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
"""Types asyncrl dequantises on load (through gguf.quants.dequantize); anything else is refused with one line."""

# value type id -> struct format of a scalar (8 = string, 9 = array are handled apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class GGUFError(ValueError):
    """A GGUF file asyncrl cannot read (one line, naming the file)."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    dims: tuple[int, ...]
    """As stored: fastest-varying first."""
    type_name: str
    offset: int
    """Byte offset from the start of the data section."""

    @property
    def shape(self) -> tuple[int, ...]:
        """Row-major shape (torch / numpy order): dims reversed."""
        return tuple(reversed(self.dims))


class _Cursor:
    def __init__(self, buf: memoryview, where: str):
        self.buf, self.pos, self.where = buf, 0, where

    def take(self, fmt: str):
        try:
            (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise GGUFError(f"{self.where}: truncated GGUF header") from None
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.where}: truncated GGUF header")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int, depth: int = 0):
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            if depth >= MAX_ARRAY_DEPTH:  # a file nesting arrays 100,000 deep: one line, not RecursionError
                raise GGUFError(f"{self.where}: GGUF metadata arrays nested deeper than {MAX_ARRAY_DEPTH} levels")
            etype, count = self.take("<I"), self.take("<Q")
            if etype in _SCALARS and etype != 7:  # numeric arrays: one unpack for all of them
                fmt = "<" + _SCALARS[etype][1] * count
                try:
                    items = list(struct.unpack_from(fmt, self.buf, self.pos))
                except struct.error:
                    raise GGUFError(f"{self.where}: truncated GGUF header") from None
                self.pos += struct.calcsize(fmt)
                return items
            return [self.value(etype, depth + 1) for _ in range(count)]
        raise GGUFError(f"{self.where}: unknown GGUF value type {vtype}")


class GGUFFile:
    """Header of a GGUF file (metadata and tensor infos), parsed on construction; tensor data on demand."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        where = str(self.path)
        try:
            with self.path.open("rb") as f:
                head = f.read(24)
                if head[:4] != MAGIC:
                    raise GGUFError(f"{where}: not a GGUF file (no GGUF magic)")
                # The header (metadata + tensor infos) sits at the front; read until it parses.
                size = 1 << 22
                while True:
                    f.seek(0)
                    buf = f.read(size)
                    try:
                        self._parse(memoryview(buf), where)
                        break
                    except GGUFError as e:
                        if "truncated" not in str(e) or len(buf) < size:
                            raise
                        size *= 4
        except OSError as e:
            raise GGUFError(f"{where}: cannot read ({e.strerror})") from None

    def _parse(self, buf: memoryview, where: str) -> None:
        c = _Cursor(buf, where)
        c.pos = 4
        self.version = c.take("<I")
        if self.version not in (2, 3):
            raise GGUFError(f"{where}: GGUF version {self.version} (big-endian or unknown); asyncrl reads versions 2 and 3")
        n_tensors, n_kv = c.take("<Q"), c.take("<Q")
        self.metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = c.string()
            self.metadata[key] = c.value(c.take("<I"))
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for _ in range(n_tensors):
            name = c.string()
            dims = tuple(c.take("<Q") for _ in range(c.take("<I")))
            tid = c.take("<I")
            self.tensors[name] = GGUFTensorInfo(name, dims, GGML_TYPES.get(tid, f"type {tid}"), c.take("<Q"))
        align = int(self.metadata.get("general.alignment", 32))
        self.data_start = -(-c.pos // align) * align

    def unsupported(self) -> GGUFTensorInfo | None:
        """The first tensor whose type asyncrl cannot dequantise, or None."""
        return next((t for t in self.tensors.values() if t.type_name not in SUPPORTED_TYPES), None)

    def dequantized(self, name: str):
        """Tensor `name` as a float32 numpy array of its row-major shape (a fresh array: the file is
        memory-mapped and only this tensor's bytes are read)."""
        import numpy as np
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        info = self.tensors[name]
        if info.type_name not in SUPPORTED_TYPES:
            raise GGUFError(f"{self.path}: tensor {name} has quantisation type {info.type_name}; "
                            f"asyncrl dequantises {', '.join(SUPPORTED_TYPES)}")
        qtype = GGMLQuantizationType[info.type_name]
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        rows = 1
        for d in info.dims[1:]:
            rows *= d
        row_bytes = info.dims[0] // block * block_bytes
        start = self.data_start + info.offset
        if start + rows * row_bytes > self.path.stat().st_size:
            raise GGUFError(f"{self.path}: tensor {name} runs past the end of the file (truncated download?)")
        raw = np.memmap(self.path, dtype=np.uint8, mode="r", offset=start, shape=(rows, row_bytes))
        out = dequantize(raw, qtype)  # [rows, dims[0]] float32 (F32 comes back as a view of the map)
        return np.array(out, dtype=np.float32, copy=True).reshape(info.shape)
