"""One exec: spawn the backend's command, feed its stdin, keep the first bytes of its output, and end it (the
whole process tree) at its wall-clock timeout, its CPU seconds (polled from the sandbox's cgroup; RLIMIT_CPU
behind it) or its output cap; then name how it ended (`exec_reason`).

A `python3 -c` call may instead run in the sandbox's warm interpreter (warm.py): a child it forks, supervised the
same way, whose kill takes the interpreter's whole tree.

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
from sandbox_client.warm import WarmCall, WarmInterpreter, WarmUnavailable, pids_of, warm_argv

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
    closing: asyncio.Event | None = None
    """Set when its close has finished (a close awaits it while killing its warm interpreter: a second close, the
    server's stop say, waits for the first instead of going on past a sandbox half removed)."""
    snapshot_cache: tuple | None = None
    """(the work directory's fingerprint, its archive) of the last snapshot (server.py `_op_snapshot`), small ones."""
    warm_wanted: bool = True
    """Whether its creator wants its Python calls forked from a warm interpreter (client `create(warm=...)`)."""
    warm: WarmInterpreter | None = None
    """Its warm interpreter (warm.py), once a Python call started one."""
    warm_starting: bool = False
    warm_off: str | None = None
    """Why its Python calls run cold (its interpreter did not start), or None."""
    warm_off_logged: bool = False
    warm_starts: int = 0
    warm_calls: int = 0
    warm_retired: int = 0


async def run_exec(sb: SandboxState, backend: Backend, children: Children, argv: list[str], stdin: bytes,
                   timeout_s: float, output_bytes: int | None = None, warm: bool = False) -> ExecResult:
    """`output_bytes`: the cap of each output stream (None: the sandbox's `limits.output_bytes`). `warm`: a
    `python3 -c` call may run in the sandbox's warm interpreter (warm.py), started at its first such call."""
    loop = asyncio.get_running_loop()
    before = sb.cgroup.counters() if sb.cgroup else None
    started, t0 = time.time(), loop.time()
    call = await _warm_call(sb, backend, children, argv, stdin) if warm and warm_argv(argv) else None
    if call is None:
        call = await _ColdCall.spawn(sb, backend, children, argv, stdin)
    killed: list[str] = []  # why the server ended it, first cause first

    def kill(why: str) -> None:
        killed.append(why)
        call.kill()

    cap = sb.limits.output_bytes if output_bytes is None else output_bytes
    out, err = _Capture(cap, kill), _Capture(cap, kill)
    tasks = [asyncio.create_task(call.wait()), asyncio.create_task(out.pump(call.stdout)),
             asyncio.create_task(err.pump(call.stderr)), *call.feeders]
    deadline, grace_end, ended_at = t0 + timeout_s, None, None
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
                if ended_at is None and call.returncode is not None:
                    ended_at = loop.time()
                if not killed:
                    if loop.time() >= deadline:
                        kill("timeout")
                    elif sb.cgroup and (sb.cgroup.cpu_ns() - before.cpu_ns) / 1e9 > sb.limits.cpu_s:
                        kill("cpu")
                    elif ended_at is not None and loop.time() - ended_at > POLL_S and not all(t.done() for t in tasks):
                        # the main process ended a poll ago (its wait also waits for the pipes): what still holds
                        # its output is left over (the process backend's escaped daemons)
                        kill("leftover")
                if killed:
                    grace_end = loop.time() + KILL_GRACE_S
    finally:
        await call.finish(sb, bool(killed))
    children.reap_orphans()
    rc = call.returncode if call.returncode is not None else -signal.SIGKILL
    after = sb.cgroup.counters() if sb.cgroup else None
    sig = -rc if rc < 0 else (rc - 128 if backend.strong and 128 < rc <= 192 else None)
    return ExecResult(
        sandbox_id=sb.id, command=tuple(argv), stdout=bytes(out.data), stderr=bytes(err.data),
        exit_code=None if sig else rc, signal=sig, reason=exec_reason(killed, sig, rc, before, after),
        duration_s=round(loop.time() - t0, 6), stdout_truncated=out.over, stderr_truncated=err.over,
        started_at=started, cpu_s=None if after is None else round((after.cpu_ns - before.cpu_ns) / 1e9, 6))


class _ColdCall:
    """A spawned exec (the launcher chain and the backend's command), with the face run_exec supervises."""

    def __init__(self, proc: asyncio.subprocess.Process, children: Children, stdin: bytes):
        self.proc, self.children = proc, children
        self.stdout, self.stderr = proc.stdout, proc.stderr
        self.feeders = [asyncio.create_task(_feed(proc.stdin, stdin))] if stdin else []

    @classmethod
    async def spawn(cls, sb: SandboxState, backend: Backend, children: Children, argv: list[str],
                    stdin: bytes) -> "_ColdCall":
        host, cwd, env = backend.command(argv, work=sb.work, uid=sb.uid, limits=sb.limits,
                                         procs_files=sb.cgroup.procs_files if sb.cgroup else [])
        proc = await children.spawn(host, stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=cwd, env=env,
                                    start_new_session=True)
        sb.procs.add(proc)
        return cls(proc, children, stdin)

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def wait(self) -> int:
        return await self.proc.wait()

    def kill(self) -> None:
        kill_group(self.proc.pid)

    async def finish(self, sb: SandboxState, killed: bool) -> None:
        sb.procs.discard(self.proc)
        self.children.done(self.proc)


async def _warm_call(sb: SandboxState, backend: Backend, children: Children, argv: list[str],
                     stdin: bytes) -> "_WarmRun | None":
    """The call handed to the sandbox's warm interpreter (started first if it has none), or None: the call runs
    cold (the warm path is off for this sandbox, its interpreter is busy or starting, or it just died)."""
    if sb.warm_off or sb.warm_starting or (sb.warm is not None and sb.warm.busy):
        return None
    if sb.warm is None:
        sb.warm_starting = True
        try:
            warm = await WarmInterpreter.start(
                lambda a: backend.command(a, work=sb.work, uid=sb.uid, limits=sb.limits, as_init=True,
                                          procs_files=sb.cgroup.procs_files if sb.cgroup else []),
                backend, children, sb.cgroup.procs_files[0] if sb.cgroup else None)
        except WarmUnavailable as e:
            sb.warm_off = str(e)
            return None
        finally:
            sb.warm_starting = False
        if sb.closed:
            await warm.retire()
            return None
        sb.warm, sb.warm_starts = warm, sb.warm_starts + 1
    warm = sb.warm
    warm.busy = True
    try:
        call = await warm.call(argv, stdin, backend.strong)
    except OSError:  # it died since its last call: this one runs cold, the next starts a fresh interpreter
        warm.busy = False
        await _retire(sb, warm)
        return None
    sb.warm_calls += 1
    return _WarmRun(call)


class _WarmRun:
    """A call in the warm interpreter, with the face run_exec supervises; `finish` retires the interpreter after
    any kill, when it died, when strays remain in the cgroup, or when its own CPU time passes half the limit."""

    def __init__(self, call: WarmCall):
        self.call = call
        self.stdout, self.stderr, self.feeders = call.stdout, call.stderr, call.feeders

    @property
    def returncode(self) -> int | None:
        return self.call.returncode

    async def wait(self) -> int:
        return await self.call.wait()

    def kill(self) -> None:
        self.call.kill()

    async def finish(self, sb: SandboxState, killed: bool) -> None:
        self.call.close()
        warm = self.call.warm
        warm.busy = False
        strays = warm.baseline is not None and sb.cgroup is not None and pids_of(sb.cgroup.procs_files[0]) != warm.baseline
        if killed or warm.dead or strays or warm.cpu_ms > sb.limits.cpu_s * 500:
            await _retire(sb, warm)


async def _retire(sb: SandboxState, warm: WarmInterpreter) -> None:
    if sb.warm is warm:
        sb.warm = None
        sb.warm_retired += 1
    await warm.retire()


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
