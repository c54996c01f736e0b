"""sandbox_client's pure parts: the wire framing, the records and their validation, and how an exec's end is
named (no server, no isolation: tests/integration/test_sandbox_hostile.py runs those)."""

from __future__ import annotations

import asyncio
import signal
import struct

import msgpack
import pytest
from pydantic import ValidationError

from sandbox_client.cgroups import Counters
from sandbox_client.protocol import MAX_FRAME, ProtocolError, encode, read_frame
from sandbox_client.records import ExecResult, Limits, command_argv
from sandbox_client.runner import exec_reason


def _read(data: bytes) -> list:
    async def run():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        out = []
        while (msg := await read_frame(reader)) is not None:
            out.append(msg)
        return out

    return asyncio.run(run())


def test_frames_round_trip_bytes_and_text():
    messages = [{"id": 1, "op": "exec", "argv": ["python3", "-c", "print(1)"], "stdin": b"\x00\xff"}, {"id": 2, "ok": True}]
    assert _read(b"".join(encode(m) for m in messages)) == messages


@pytest.mark.parametrize("data, why", [
    (struct.pack(">I", MAX_FRAME + 1), "exceeds the limit"),
    (struct.pack(">I", 4) + b"ab", "ended inside a frame"),
    (b"\x00\x00", "inside a frame header"),
    (struct.pack(">I", 1) + msgpack.packb(7), "not a map"),
    (struct.pack(">I", 1) + b"\xc1", "not msgpack"),
])
def test_bad_frames_are_protocol_errors(data, why):
    with pytest.raises(ProtocolError, match=why):
        _read(data)


def test_limits_validate_and_refuse_unknown_keys():
    assert Limits().memory_mib == 256 and Limits(cpu_s=0.5).cpu_s == 0.5
    for bad in [{"memory_mib": 8}, {"cpu_s": 0}, {"max_processes": 2}, {"timeout_s": -1}, {"output_bytes": 10},
                {"swap": 1}]:
        with pytest.raises(ValidationError):
            Limits(**bad)
    with pytest.raises(ValidationError):
        Limits().memory_mib = 512  # frozen: a sandbox's limits never change under it


def test_command_argv_takes_exactly_one_of_command_and_code():
    assert command_argv("echo hi | wc -c", None) == ["/bin/sh", "-c", "echo hi | wc -c"]
    assert command_argv(["ls", "-l"], None) == ["ls", "-l"]
    assert command_argv(None, "print(1)") == ["python3", "-c", "print(1)"]
    for command, code in [(None, None), ("ls", "print(1)"), ([], None), (["ls", 3], None)]:
        with pytest.raises(ValueError):
            command_argv(command, code)


def test_exec_results_survive_the_wire():
    r = ExecResult(sandbox_id="sb-1", command=("python3", "-c", "x"), stdout=b"\xff out", stderr=b"", exit_code=None,
                   signal=9, reason="memory", duration_s=0.5, stdout_truncated=True, cpu_s=0.1, started_at=1.0)
    assert ExecResult.from_wire(msgpack.unpackb(msgpack.packb(r.to_wire()))) == r
    assert not r.ok and r.stdout_text == "\ufffd out"


C0 = Counters(oom_kills=0, pids_refused=0, cpu_ns=0)


@pytest.mark.parametrize("killed, sig, rc, after, want", [
    ([], None, 0, C0, "ok"),
    ([], None, 1, C0, "ok"),  # a command that fails on its own is no sandbox failure
    (["output_truncated", "timeout"], 9, -9, Counters(1, 0, 0), "output_truncated"),  # the first cause wins
    ([], 9, 137, Counters(1, 0, 0), "memory"),
    (["timeout"], 9, -9, Counters(0, 3, 0), "processes"),  # a fork bomb that ran into its timeout
    ([], None, 0, Counters(0, 3, 0), "ok"),  # a refused fork the program handled
    (["cpu"], 9, -9, C0, "cpu"),
    ([], signal.SIGXCPU, 128 + signal.SIGXCPU, C0, "cpu"),  # RLIMIT_CPU, the second line
    (["timeout"], 9, -9, C0, "timeout"),
    ([], signal.SIGSEGV, 128 + signal.SIGSEGV, C0, "crashed"),
    (["leftover"], None, 0, C0, "ok"),
])
def test_an_exec_is_named_by_the_limit_that_ended_it(killed, sig, rc, after, want):
    assert exec_reason(killed, sig, rc, C0, after) == want


def test_without_cgroups_only_signals_and_kills_name_the_end():
    assert exec_reason(["timeout"], 9, -9, None, None) == "timeout"
    assert exec_reason([], 9, -9, None, None) == "crashed"
