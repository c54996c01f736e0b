"""The sandbox server with the strong backend (bubblewrap + cgroups), through the real client (issue #16):
the hostile-code suite of sandbox_client/hostile.py, case by case, and the client's everyday calls.

Without bubblewrap these tests skip locally and fail under CI=true (.ci/run installs it), as the PostgreSQL
tests do."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from sandbox_client import ExecSpec, Limits, SandboxClient, SandboxError
from sandbox_client.hostile import CASES, LIMITS, HostWorld, run_case
from sandbox_client.processes import uid_processes, zombie_children

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def world():
    if shutil.which("bwrap") is None:
        why = "bubblewrap is not installed (apt-get install bubblewrap; .ci/run does)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but the sandbox tests cannot run: {why}")
        pytest.skip(why)
    scratch = Path(tempfile.mkdtemp(prefix="asyncrl-sbx-"))  # not under pytest's 0700 tmp: sandbox uids traverse it
    with HostWorld(scratch) as w:
        yield w
    shutil.rmtree(scratch, ignore_errors=True)


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_code_is_contained(world, case):
    outcome = run_case(case, world)
    assert outcome.contained, f"{case}: {outcome.detail}"


def test_the_server_reaps_the_orphans_it_inherits(world):
    async def many_execs():
        async with await SandboxClient.connect(world.socket_path) as client:
            await client.run_batch([ExecSpec(command="sleep 0.01 &") for _ in range(8)], LIMITS)

    asyncio.run(many_execs())
    deadline = time.monotonic() + 3  # the sweep runs every second
    while (zombies := zombie_children(world.server.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert zombies == []


def test_files_stdin_and_state_persist_across_execs(world):
    async def session():
        async with await SandboxClient.connect(world.socket_path) as client:
            async with await client.create(LIMITS) as sb:
                await sb.write_file("pkg/data.txt", "3 4\n")
                r1 = await sb.exec(code="a, b = map(int, open('pkg/data.txt').read().split())\n"
                                        "open('out.txt', 'w').write(str(a * b))")
                r2 = await sb.exec(["python3", "-c", "import sys; print(sys.stdin.read().upper(), end='')"], stdin="shout")
                r3 = await sb.exec("exit 3")
                return r1, r2, r3, await sb.read_file("out.txt"), sb.id

    r1, r2, r3, out, sid = asyncio.run(session())
    assert r1.ok and out == b"12"
    assert r2.stdout == b"SHOUT" and r2.reason == "ok"
    assert (r3.exit_code, r3.signal, r3.reason, r3.ok) == (3, None, "ok", False)
    log = [json.loads(line) for line in (world.server.state_dir / "commands.jsonl").read_text().splitlines()]
    mine = [e for e in log if e.get("sandbox") == sid]
    assert [e["op"] for e in mine] == ["create", "write_file", "exec", "exec", "exec", "read_file", "close"]
    assert mine[3]["stdout"] == "SHOUT" and mine[4]["exit_code"] == 3


def test_a_batch_larger_than_the_node_waits_for_admission(world):
    server = world.start_server("batch", max_sandboxes=2)

    async def batch():
        async with await SandboxClient.connect(server.socket_path) as client:
            specs = [ExecSpec(code="import sys; print(int(sys.stdin.read()) ** 2)", stdin=str(i), files={"x": b"1"})
                     for i in range(6)]
            return await client.run_batch(specs, LIMITS), await client.info()

    try:
        results, info = asyncio.run(batch())
    finally:
        server.stop()
    assert [r.stdout_text for r in results] == [f"{i * i}\n" for i in range(6)]
    assert info["active"] == 0 and info["strong"] and info["cgroups"]


def test_bad_requests_fail_with_one_line(world):
    async def bad():
        async with await SandboxClient.connect(world.socket_path) as client:
            errors = []
            for op, args in [("create", {"limits": {"memory_mib": 1}}), ("create", {"limits": {"nope": 1}}),
                             ("exec", {"sandbox_id": "sb-missing", "argv": ["true"]}), ("frobnicate", {})]:
                with pytest.raises(SandboxError) as e:
                    await client.call(op, wait_s=10, **args)
                errors.append(str(e.value))
            async with await client.create(LIMITS) as sb:
                with pytest.raises(SandboxError) as e:
                    await sb.read_file("absent.txt")
                errors.append(str(e.value))
            return errors

    errors = asyncio.run(bad())
    assert all("\n" not in e for e in errors)
    assert errors[0].startswith("memory_mib: Input should be greater than or equal to 16")
    assert errors[1].startswith("nope: Extra inputs are not permitted")
    assert "no open sandbox 'sb-missing'" in errors[2] and "unknown op 'frobnicate'" in errors[3]
    assert errors[4].startswith("read_file absent.txt: cat: absent.txt: No such file")


def test_a_second_server_on_a_state_directory_refuses_with_one_line(world):
    state = world.server.state_dir
    proc = subprocess.run([sys.executable, "-m", "sandbox_client", "serve", "--socket", str(state.parent / "other.sock"),
                           "--state-dir", str(state)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and f"{state} is in use by pid {world.server.pid}" in proc.stderr


def test_limits_are_enforced_per_sandbox(world):
    """A sandbox's limits are its own: a generous sandbox next to a tight one allocates what the tight one may not."""
    hog = "x = b'x' * (200 << 20); print(len(x) >> 20)"

    async def two():
        async with await SandboxClient.connect(world.socket_path) as client:
            tight = await client.create(Limits(memory_mib=64, cpu_s=2, timeout_s=5))
            roomy = await client.create(Limits(memory_mib=512, cpu_s=2, timeout_s=5))
            results = await asyncio.gather(tight.exec(code=hog), roomy.exec(code=hog))
            await tight.close()
            await roomy.close()
            return results

    tight, roomy = asyncio.run(two())
    assert tight.reason == "memory" and tight.signal == 9
    assert roomy.ok and roomy.stdout == b"200\n"


def test_a_client_that_goes_away_leaves_nothing_behind(world):
    """Sandboxes belong to the connection that made them: when it ends, the server closes them, running execs
    and all."""
    async def vanish():
        client = await SandboxClient.connect(world.socket_path)
        sb = await client.create(LIMITS)
        running = asyncio.create_task(sb.exec("sleep 60", timeout=60))
        await asyncio.sleep(0.3)
        await client.close()  # no sb.close()
        with pytest.raises(SandboxError):
            await running
        return sb

    sb = asyncio.run(vanish())
    deadline = time.monotonic() + 5
    while Path(sb.host_work_dir).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(sb.host_work_dir).exists()
    assert uid_processes(sb.host_uid) == []
