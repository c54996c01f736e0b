"""One exec: spawn the backend's command, feed its stdin, keep the first bytes of its output, and end it (the
whole process tree) at its wall-clock timeout, its CPU seconds (polled from the sandbox's cgroup; RLIMIT_CPU
behind it) or its output cap; then name how it ended (`exec_reason`).

The exit status of the bwrap backend is bwrap's: a command killed by signal N exits 128 + N, so an exit code
in 129..192 is reported as that signal (as a shell would).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sandbox_client.backends import Backend
from sandbox_client.cgroups import Cgroup, Counters
from sandbox_client.processes import Children, kill_group
from sandbox_client.records import ExecResult, Limits

POLL_S = 0.05
"""How often a running exec's CPU time (from its cgroup) and the end of its main process are checked."""
KILL_GRACE_S = 2.0
"""After the server ends an exec, how long its output may take to close before the server stops reading it."""


@dataclass(eq=False)
class SandboxState:
    """What the server holds for one sandbox."""

    id: str
    slot: int
    uid: int | None
    work: Path
    limits: Limits
    cgroup: Cgroup | None
    procs: set[asyncio.subprocess.Process] = field(default_factory=set)
    """Its execs' launcher processes while they run (close kills their groups)."""
    closed: bool = False
    snapshot_cache: tuple | None = None
    """(the work directory's fingerprint, its archive) of the last snapshot (server.py `_op_snapshot`), small ones."""


async def run_exec(sb: SandboxState, backend: Backend, children: Children, argv: list[str], stdin: bytes,
                   timeout_s: float, output_bytes: int | None = None) -> ExecResult:
    """`output_bytes`: the cap of each output stream (None: the sandbox's `limits.output_bytes`)."""
    loop = asyncio.get_running_loop()
    host, cwd, env = backend.command(argv, work=sb.work, uid=sb.uid, limits=sb.limits,
                                     procs_files=sb.cgroup.procs_files if sb.cgroup else [])
    before = sb.cgroup.counters() if sb.cgroup else None
    started, t0 = time.time(), loop.time()
    proc = await children.spawn(host, stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=cwd, env=env,
                                start_new_session=True)
    sb.procs.add(proc)
    killed: list[str] = []  # why the server ended it, first cause first

    def kill(why: str) -> None:
        killed.append(why)
        kill_group(proc.pid)

    cap = sb.limits.output_bytes if output_bytes is None else output_bytes
    out, err = _Capture(cap, kill), _Capture(cap, kill)
    tasks = [asyncio.create_task(proc.wait()), asyncio.create_task(out.pump(proc.stdout)),
             asyncio.create_task(err.pump(proc.stderr))]
    if stdin:
        tasks.append(asyncio.create_task(_feed(proc.stdin, stdin)))
    deadline, grace_end = t0 + timeout_s, None
    try:
        while pending := [t for t in tasks if not t.done()]:
            if grace_end is not None:
                if loop.time() >= grace_end:  # ended, yet something holds its output open: stop reading
                    for t in pending:
                        t.cancel()
                    break
                wait = grace_end - loop.time()
            else:
                wait = min(deadline - loop.time(), POLL_S)
            await asyncio.wait(pending, timeout=max(0.0, wait))
            if grace_end is None:
                if not killed:
                    if loop.time() >= deadline:
                        kill("timeout")
                    elif sb.cgroup and (sb.cgroup.cpu_ns() - before.cpu_ns) / 1e9 > sb.limits.cpu_s:
                        kill("cpu")
                    elif proc.returncode is not None and not all(t.done() for t in tasks):
                        # the main process ended (proc.wait() also waits for the pipes): what still holds its
                        # output is left over (the process backend's escaped daemons)
                        kill("leftover")
                if killed:
                    grace_end = loop.time() + KILL_GRACE_S
    finally:
        sb.procs.discard(proc)
        children.done(proc)
    children.reap_orphans()
    rc = proc.returncode if proc.returncode is not None else -signal.SIGKILL
    after = sb.cgroup.counters() if sb.cgroup else None
    sig = -rc if rc < 0 else (rc - 128 if backend.strong and 128 < rc <= 192 else None)
    return ExecResult(
        sandbox_id=sb.id, command=tuple(argv), stdout=bytes(out.data), stderr=bytes(err.data),
        exit_code=None if sig else rc, signal=sig, reason=exec_reason(killed, sig, rc, before, after),
        duration_s=round(loop.time() - t0, 6), stdout_truncated=out.over, stderr_truncated=err.over,
        started_at=started, cpu_s=None if after is None else round((after.cpu_ns - before.cpu_ns) / 1e9, 6))


def exec_reason(killed: list[str], sig: int | None, rc: int, before: Counters | None, after: Counters | None) -> str:
    """How an exec ended (records.Reason): the server's first cause to end it, else the cgroup's counters
    (an OOM kill; a refused fork, when the command then failed), else its signal."""
    first = killed[0] if killed else None
    if first == "output_truncated":
        return "output_truncated"
    if after is not None and after.oom_kills > before.oom_kills:
        return "memory"
    if after is not None and after.pids_refused > before.pids_refused and (rc != 0 or first):
        return "processes"
    if first == "cpu" or sig == signal.SIGXCPU:
        return "cpu"
    if first == "timeout":
        return "timeout"
    if sig is not None and first != "leftover":
        return "crashed"
    return "ok"


class _Capture:
    """One output stream of an exec: its first `cap` bytes; past the cap the exec is ended (once)."""

    def __init__(self, cap: int, kill: Callable[[str], None]):
        self.cap, self.kill = cap, kill
        self.data = bytearray()
        self.over = False

    async def pump(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(1 << 16):
            if self.over:
                continue
            room = self.cap - len(self.data)
            self.data += chunk[:room]
            if len(chunk) > room:
                self.over = True
                self.kill("output_truncated")


async def _feed(pipe: asyncio.StreamWriter, data: bytes) -> None:
    try:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a command need not read its stdin
            pipe.write(data)
            await pipe.drain()
    finally:
        pipe.close()
