"""The sandbox server with the strong backend (bubblewrap + cgroups), through the real client (issue #16):
the hostile-code suite of sandbox_client/hostile.py, case by case, and the client's everyday calls.

Without bubblewrap these tests skip locally and fail under CI=true (.ci/run installs it), as the PostgreSQL
tests do."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from pathlib import Path

import pytest

from sandbox_client import ExecResult, ExecSpec, Limits, SandboxClient, SandboxError
from sandbox_client.hostile import CASES, CHECKOUT, DISK_FILL, LIMITS, HostWorld, run_case
from sandbox_client.launch import server_pid
from sandbox_client.processes import uid_processes, zombie_children

pytestmark = [pytest.mark.integration, pytest.mark.slow]


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
    deadline = time.monotonic() + 30  # the sweep runs every second (a loaded machine slows the server)
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


def test_a_work_directory_moves_to_another_sandbox_by_snapshot_and_restore(world):
    """What a checkpoint keeps of a multi-turn sample (rl/runtime/tool_turns.py): the whole work directory (nested and hidden
    files, symlinks as links) goes into another sandbox, whose own files it replaces; an archive over the cap, or
    bytes that are no archive, fail with one line; an archive (from a checkpoint: untrusted) whose members climb
    out of the work directory writes nothing outside it."""
    async def session():
        async with await SandboxClient.connect(world.socket_path) as client:
            limits = Limits(timeout_s=5, snapshot_mib=1)
            async with await client.create(limits) as a:
                await a.exec("mkdir -p d/e && echo deep > d/e/f && echo h > .hidden && ln -s /etc/passwd link")
                archive = await a.snapshot()
            async with await client.create(limits) as b:
                await b.write_file("stale", "gone after the restore")
                await b.restore(archive)
                listing = await b.exec("find . -mindepth 1 | sort; cat d/e/f .hidden; readlink link")
                await b.exec("head -c 3000000 /dev/urandom > big")
                errors = []
                for op in (b.snapshot(), b.restore(b"not a tar")):
                    with pytest.raises(SandboxError) as e:
                        await op
                    errors.append(str(e.value))
                with contextlib.suppress(SandboxError):  # tar may refuse the members, or only skip them
                    await b.restore(_climbing_archive())
                escaped = [p for p in (Path(b.host_work_dir).parent / "escaped", Path("/tmp/asyncrl-escaped"))
                           if p.exists()]
            return listing, errors, escaped

    listing, errors, escaped = asyncio.run(session())
    assert escaped == []
    assert listing.stdout_text.split() == ["./.hidden", "./d", "./d/e", "./d/e/f", "./link", "deep", "h", "/etc/passwd"]
    assert all("\n" not in e for e in errors)
    assert errors[0] == "snapshot: the work directory's archive passes the sandbox's cap of 1 MiB (Limits.snapshot_mib)"
    assert errors[1].startswith("restore: ")


def test_snapshots_of_an_empty_or_unchanged_work_directory_run_no_exec(world):
    """A multi-turn sample snapshots its work directory before every call after its first (rl/runtime/tool_turns.py),
    and a process spawn is what a call costs: an empty directory's snapshot is b"" and an unchanged one's is the last
    archive, with no exec; any write (a touch moves ctime, which no call can set back) takes a new one."""
    async def session():
        async with await SandboxClient.connect(world.socket_path) as client:
            async with await client.create(LIMITS) as sb:
                async def snap():
                    r = await client.call("snapshot", wait_s=30, sandbox_id=sb.id)
                    return r["data"], r["exec"]

                steps = [await snap()]  # empty
                await sb.exec(code="print(6 * 7)")  # a call that writes nothing
                steps.append(await snap())
                await sb.exec("mkdir d && echo x > d/f")
                steps += [await snap(), await snap()]  # new, then unchanged
                await sb.exec("touch -d 2000-01-01 d/f")  # same size; mtime set back, ctime moved
                steps.append(await snap())
                await sb.restore(b"")  # the empty snapshot's restore: an empty directory
                listing = await sb.exec("find . -mindepth 1")
                steps.append(await snap())
                return steps, listing.stdout

    steps, listing = asyncio.run(session())
    assert [e for _, e in steps] == [False, False, True, False, True, False]
    assert steps[0][0] == steps[1][0] == steps[5][0] == b""
    assert steps[3][0] == steps[2][0] and steps[2][0][:2] == b"\x1f\x8b"  # the same gzip'd tar, reused
    assert listing == b""


def _climbing_archive() -> bytes:
    """A gzip'd tar whose members climb out: `../escaped`, `/tmp/asyncrl-escaped`, and a link to /tmp then a file
    through it."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name in ("../escaped", "/tmp/asyncrl-escaped"):
            tar.addfile(tarfile.TarInfo(name), io.BytesIO())
        link = tarfile.TarInfo("link")
        link.type, link.linkname = tarfile.SYMTYPE, "/tmp"
        tar.addfile(link)
        tar.addfile(tarfile.TarInfo("link/asyncrl-escaped"), io.BytesIO())
    return buf.getvalue()


def test_bad_requests_fail_with_one_line(world):
    async def bad():
        async with await SandboxClient.connect(world.socket_path) as client:
            errors = []
            for op, args in [("create", {"limits": {"memory_mib": 1}}), ("create", {"limits": {"nope": 1}}),
                             ("exec", {"sandbox_id": "sb-missing", "argv": ["true"]}), ("frobnicate", {}),
                             ("exec", {"sandbox_id": b"\xff", "argv": ["true"]})]:  # not loggable as JSON
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
    assert errors[2] == "no such sandbox 'sb-missing'" and "unknown op 'frobnicate'" in errors[3]
    assert errors[4] == "TypeError: sandbox_id must be a string"
    assert errors[5].startswith("read_file absent.txt: cat: absent.txt: No such file")


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
    deadline = time.monotonic() + 30
    while Path(sb.host_work_dir).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(sb.host_work_dir).exists()
    assert uid_processes(sb.host_uid) == []


def test_a_create_cancelled_while_the_server_answers_leaves_no_sandbox_open(world):
    """A caller cancelled during `create` (a dropped sample's call waiting for admission) must not leave the
    sandbox the server then creates holding an admission slot until the connection ends: with a limit of one,
    the next create succeeds at once."""
    server = world.start_server("cancelled-create", max_sandboxes=1)

    async def session():
        async with await SandboxClient.connect(server.socket_path) as client:
            pending = asyncio.create_task(client.create(LIMITS))
            await asyncio.sleep(0)  # the request is written; the server is still setting the sandbox up
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pending
            deadline = time.monotonic() + 30
            while (await client.info())["active"] and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            async with await client.create(LIMITS) as sb:
                return (await sb.exec("echo fine")).stdout

    try:
        assert asyncio.run(session()) == b"fine\n"
    finally:
        server.stop()



NON_ROOT_UID = 3_999_000
"""A uid no account uses, for a server that is not root (it must still cap its work directories)."""


def _python_for(uid: int) -> list[str] | None:
    """A command line that runs this checkout's Python code as `uid`, or None where no interpreter it may run has
    our dependencies (this venv's interpreter under /root, say)."""
    site = ":".join(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    for python in (sys.executable, "/usr/bin/python3"):
        argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", "env",
                f"PYTHONPATH={CHECKOUT}:{site}", python]
        probe = subprocess.run([*argv, "-c", "import msgpack, pydantic, sandbox_client"], capture_output=True,
                               timeout=60, cwd="/")
        if probe.returncode == 0:
            return argv
    return None


def test_a_non_root_server_caps_work_directories_too(world):
    """Without root, the bwrap backend's server mounts capped work directories in a user and mount namespace of
    its own (quota.py): a write past the cap fails with ENOSPC inside the sandbox, and nothing stays mounted."""
    if os.geteuid() != 0:
        pytest.skip("starts a server as another uid: needs root")
    python = _python_for(NON_ROOT_UID)
    if python is None:
        pytest.skip(f"no Python that uid {NON_ROOT_UID} may run has this checkout's dependencies")
    home = world.scratch / "non-root"
    home.mkdir(mode=0o700)
    os.chown(home, NON_ROOT_UID, NON_ROOT_UID)
    sock = home / "s.sock"
    server = subprocess.Popen([*python, "-m", "sandbox_client", "serve", "--socket", str(sock), "--state-dir",
                               str(home / "state")], cwd="/", stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)

    async def fill() -> tuple[dict, ExecResult]:
        deadline = time.monotonic() + 30
        while server_pid(sock) != server.pid and time.monotonic() < deadline and server.poll() is None:
            await asyncio.sleep(0.05)
        async with await SandboxClient.connect(sock) as client:
            async with await client.create(Limits(timeout_s=10, disk_mib=4)) as sb:
                return await client.info(), await sb.exec(["python3", "-c", DISK_FILL, "bytes"])

    try:
        info, r = asyncio.run(fill())
    finally:
        server.terminate()
        log = server.communicate(timeout=30)[0]
    assert info["disk_quota"] and r.stdout == b"ENOSPC 4\n", log
    assert str(home) not in Path("/proc/self/mounts").read_text()
