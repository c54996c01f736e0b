"""The server's host processes: spawning, killing by process group or by uid, and reaping the orphans it
inherits as a child subreaper.

Why a subreaper: the outer bwrap exits as soon as its pid-namespace init has reported the command's status,
before anyone reaped that init, and the process backend's daemons outlive their exec. Orphans go to the
nearest subreaper, else to pid 1, which in some containers never reaps, so zombies would pile up there.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
from pathlib import Path

from sandbox_client.records import SandboxError

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """prctl(PR_SET_CHILD_SUBREAPER): orphans of this process's descendants become its children."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def kill_group(pgid: int) -> None:
    """SIGKILL an exec's process group: the launcher chain and the outer bwrap, whose death (--die-with-parent)
    takes the sandbox's pid namespace with it; with the process backend, its children that stayed in the group."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def uid_processes(uid: int | None) -> list[int]:
    """Live (not zombie) processes on the host whose real uid is `uid` (none for None: a sandbox without a uid
    of its own). Zombies are dead already; whether the server reaps its own is `zombie_children`'s question."""
    if uid is None:
        return []
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = dict(line.split(":", 1) for line in (entry / "status").read_text().splitlines() if ":" in line)
                if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
                    found.append(int(entry.name))
    return found


def zombie_children(pid: int) -> list[int]:
    """Children of `pid` that exited and were not reaped."""
    found = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        with contextlib.suppress(OSError):
            if Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                found.append(int(child))
    return found


class Children:
    """The processes this server spawns (asyncio waits for those) and the orphans it reaps (all others)."""

    def __init__(self) -> None:
        self._spawned: set[int] = set()
        self._spawning = 0

    async def spawn(self, argv: list[str], **kwargs) -> asyncio.subprocess.Process:
        self._spawning += 1
        try:
            proc = await asyncio.create_subprocess_exec(*argv, **kwargs)
        finally:
            self._spawning -= 1
        self._spawned.add(proc.pid)
        return proc

    def done(self, proc: asyncio.subprocess.Process) -> None:
        """`proc` is finished with (waited for, or given up on)."""
        self._spawned.discard(proc.pid)

    def reap_orphans(self) -> None:
        """Reap exited children that asyncio did not spawn (never while a spawn is under way: its pid is not
        known yet)."""
        if self._spawning:
            return
        for pid in map(int, Path(f"/proc/self/task/{os.getpid()}/children").read_text().split()):
            if pid not in self._spawned:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)

    async def sweep(self, every_s: float) -> None:
        """Reap orphans every `every_s` seconds, until cancelled."""
        while True:
            await asyncio.sleep(every_s)
            self.reap_orphans()

    async def kill_uid(self, uid: int, wait_s: float = 2.0) -> None:
        """SIGKILL every process of a sandbox's host uid (kill(-1) as that uid: all it may signal, its own), again
        until none is alive."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while pids := uid_processes(uid):
            if loop.time() > deadline:
                raise SandboxError(f"processes {pids[:8]} of uid {uid} survive SIGKILL")
            proc = await self.spawn(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", "kill",
                                     "-KILL", "-1"], stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
            await proc.wait()
            self.done(proc)
            await asyncio.sleep(0.005)
