"""The wire format between client and server over a Unix socket: frames of a 4-byte big-endian length and a
msgpack map, many requests in flight on one connection (answers carry the request's `id`).

    request   {"id": int, "op": "create" | "exec" | "write_file" | "read_file" | "snapshot" | "restore" | "close"
               | "info", ...args}
    answer    {"id": int, "ok": true, "result": {...}}
              {"id": int, "ok": false, "error": {"kind": str, "message": str, "retryable": bool}}

A frame longer than `MAX_FRAME` or one that is not a msgpack map is a protocol error: the reader raises and
the connection ends.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgpack

MAX_FRAME = 256 << 20
"""Largest frame either side accepts: room for a file of `Limits.file_mib`'s default and two capped outputs."""
_HEADER = struct.Struct(">I")


class ProtocolError(ValueError):
    """Bytes on the socket that are not a valid frame."""


def encode(message: dict[str, Any]) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"a frame of {len(body)} bytes exceeds the limit of {MAX_FRAME}")
    return _HEADER.pack(len(body)) + body


def decode(body: bytes) -> dict[str, Any]:
    try:
        message = msgpack.unpackb(body, raw=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise ProtocolError(f"a frame that is not msgpack ({e})") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"a frame holding {type(message).__name__}, not a map")
    return message


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """The next message, or None at a clean end of stream (EOF between frames)."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise ProtocolError("the stream ended inside a frame header") from None
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME:
        raise ProtocolError(f"a frame of {size} bytes exceeds the limit of {MAX_FRAME}")
    try:
        return decode(await reader.readexactly(size))
    except asyncio.IncompleteReadError:
        raise ProtocolError("the stream ended inside a frame") from None
