"""A sandbox's limits bind each exec (sandbox_client/: server, runner, backends) on a real server (bubblewrap): an
exec's own timeout beats the sandbox's, output past `output_bytes` is cut and named, a file past `file_mib` fails
while a smaller one is written, and the reason names the limit that ended the command. Each case costs about a
second; tests/integration/test_sandbox_hostile.py has the hostile programs."""

import asyncio
import time

import pytest

from tests.sandbox_server import bwrap_server
from sandbox_client import Limits, SandboxClient


@pytest.fixture(scope="module")
def socket_path():
    with bwrap_server("asyncrl-exec-limits-") as (_, path):
        yield path


def _exec(socket_path, limits: Limits, *, command: str | None = None, code: str | None = None,
          timeout: float | None = None):
    async def go():
        async with await SandboxClient.connect(socket_path) as client:
            async with await client.create(limits) as sb:
                t0 = time.monotonic()
                r = await sb.exec(command, code=code, timeout=timeout)
                return r, time.monotonic() - t0

    return asyncio.run(go())


def test_an_execs_own_timeout_beats_the_sandboxs(socket_path):
    r, seconds = _exec(socket_path, Limits(timeout_s=30), command="sleep 10; echo late", timeout=0.5)
    assert r.reason == "timeout" and seconds < 8 and b"late" not in r.stdout
    r, _ = _exec(socket_path, Limits(timeout_s=0.5), command="sleep 10; echo late")  # none given: the sandbox's
    assert r.reason == "timeout"


def test_output_past_the_cap_is_cut_and_named(socket_path):
    r, _ = _exec(socket_path, Limits(output_bytes=1024), code="import sys; sys.stdout.write('x' * 5000)")
    assert r.reason == "output_truncated" and r.stdout_truncated and len(r.stdout) == 1024
    r, _ = _exec(socket_path, Limits(output_bytes=1024), code="import sys; sys.stdout.write('x' * 1024)")
    assert r.reason == "ok" and r.stdout == b"x" * 1024 and not r.stdout_truncated  # exactly the cap: all kept


def test_a_file_past_file_mib_fails_and_a_smaller_one_is_written(socket_path):
    write = "open('f', 'wb').write(b'x' * ({} << 20)); print('wrote')"
    r, _ = _exec(socket_path, Limits(file_mib=1, disk_mib=8, memory_mib=128), code=write.format(2))
    assert r.reason != "ok" or r.exit_code != 0, r
    assert b"wrote" not in r.stdout
    r, _ = _exec(socket_path, Limits(file_mib=2, disk_mib=8, memory_mib=128), code=write.format(1))
    assert r.reason == "ok" and r.stdout == b"wrote\n", r


def test_the_work_directory_is_capped_at_disk_mib(socket_path):
    async def go():
        async with await SandboxClient.connect(socket_path) as client:
            if not (await client.info()).get("disk_quota"):
                pytest.skip("this server cannot mount capped work directories (not root, no user namespaces)")
            async with await client.create(Limits(file_mib=8, disk_mib=4, memory_mib=256)) as sb:
                many = "for i in range(3): open(f'f{i}', 'wb').write(b'x' * (2 << 20))\nprint('wrote')"
                full = await sb.exec(code=many)
                one = await sb.exec(code="print(len(open('f0', 'rb').read()))")
                return full, one

    full, one = asyncio.run(go())
    assert b"wrote" not in full.stdout and b"No space left" in full.stderr, full
    assert one.stdout == b"2097152\n"  # the first file, within the cap, is there
