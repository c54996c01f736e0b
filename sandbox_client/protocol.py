"""The wire format between client and server over a Unix socket: frames of a 4-byte big-endian length and a
msgpack map, many requests in flight on one connection (answers carry the request's `id`).

    request   {"id": int, "op": "create" | "exec" | "write_file" | "read_file" | "snapshot" | "restore" | "close"
               | "info", ...args}
    answer    {"id": int, "ok": true, "result": {...}}
              {"id": int, "ok": false, "error": {"kind": str, "message": str, "retryable": bool}}

A frame longer than `MAX_FRAME` or one that is not a msgpack map is a protocol error: the reader raises and
the connection ends. The server also bounds frames in total: every connection's partly received frame holds
its announced size of one `FrameBudget` until it is whole (or the connection ends), so connections that each
announce a large frame and send it slowly (or never) hold at most the budget, not `MAX_FRAME` each; a frame
that does not fit is a protocol error too (the server answers it with an error frame, id None, and closes).
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgpack

MAX_FRAME = 256 << 20
"""Largest frame either side accepts: room for a file of `Limits.file_mib`'s default and two capped outputs."""
FRAME_BUDGET = 2 * MAX_FRAME
"""The server's default budget for partly received frames, all connections together: two of the largest."""
FRAME_BODY_S = 60.0
"""How long the server waits for the rest of a frame whose header came: a frame held half-sent keeps its
share of the budget no longer than this (a whole frame takes well under a second on a Unix socket)."""
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


class FrameBudget:
    """Bytes that the partly received frames of all connections may hold together (see the module's docstring)."""

    def __init__(self, total: int):
        self.total = total
        self.used = 0

    def take(self, size: int) -> None:
        if self.used + size > self.total:
            raise ProtocolError(f"a frame of {size} bytes does not fit the server's budget for frames being "
                                f"received ({self.total - self.used} of {self.total} bytes free); retry later")
        self.used += size

    def give(self, size: int) -> None:
        self.used -= size


async def read_frame(reader: asyncio.StreamReader, budget: FrameBudget | None = None,
                     body_s: float | None = None) -> dict[str, Any] | None:
    """The next message, or None at a clean end of stream (EOF between frames). With a `budget`, the frame's
    announced size is taken from it while its body arrives, which must be within `body_s` (None: no limit)."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise ProtocolError("the stream ended inside a frame header") from None
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME:
        raise ProtocolError(f"a frame of {size} bytes exceeds the limit of {MAX_FRAME}")
    if budget is not None:
        budget.take(size)
    try:
        body = await asyncio.wait_for(reader.readexactly(size), body_s)
    except asyncio.IncompleteReadError:
        raise ProtocolError("the stream ended inside a frame") from None
    except asyncio.TimeoutError:
        raise ProtocolError(f"the rest of a frame of {size} bytes did not come within {body_s:.0f} s") from None
    finally:
        if budget is not None:
            budget.give(size)
    return decode(body)
