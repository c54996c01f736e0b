"""Per-sandbox cgroups: memory (no swap), process count and CPU-time accounting for all of a sandbox's processes,
and a kill that reaches every one of them.

Both cgroup versions: v2 where `/sys/fs/cgroup/cgroup.controllers` exists, else v1 with the `memory`, `pids`
and `cpuacct` controllers mounted under `/sys/fs/cgroup/<controller>`. Sandbox groups are children of a
parent group inside the server's own cgroup (so a job's own memory limit still covers its sandboxes), one
per server (`asyncrl-sandboxes-<state-dir digest>`, so that servers sharing a cgroup never remove each
other's). A process joins by writing its pid into each `procs_files` entry before it runs anything (the
launcher does, backends.py); its children inherit the groups and cannot leave them (nothing in the sandbox
sees /sys/fs/cgroup).

v2 needs the controllers enabled in the server's cgroup's `cgroup.subtree_control`, which the kernel refuses
while that cgroup holds processes ("no internal processes"): the server then moves itself into a leaf
`asyncrl-server` first, and where that is refused too (other processes share its cgroup) it says so in one
line: run it in a delegated cgroup (`systemd-run --scope -p Delegate=yes ...`).
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "cpuacct")


class CgroupError(RuntimeError):
    """Cgroups that cannot be set up here; the message is one line."""


@dataclass(frozen=True)
class Counters:
    """Cumulative counters of one group; an exec compares them before and after."""

    oom_kills: int
    pids_refused: int
    """Forks refused because the group was at its process maximum."""
    cpu_ns: int


def _own_path(controller: str | None) -> str:
    """This process's cgroup path in the v1 `controller`'s hierarchy, or in the v2 one (None)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if (controller is None and names == "") or (controller is not None and controller in names.split(",")):
            return path.lstrip("/")
    raise CgroupError(f"this process is in no {controller or 'v2'} cgroup (see /proc/self/cgroup)")


def _keyed(path: Path, key: str) -> int:
    """The value of `key` in a flat-keyed cgroup file ("key value" lines); 0 when absent."""
    for line in path.read_text().splitlines():
        k, _, v = line.partition(" ")
        if k == key:
            return int(v)
    return 0


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class Cgroup:
    """One sandbox's group (a directory per v1 controller, or one v2 directory)."""

    def __init__(self, dirs: list[Path], version: int):
        self.dirs = dirs
        self.version = version

    @property
    def procs_files(self) -> list[Path]:
        return [d / "cgroup.procs" for d in self.dirs]

    def _dir(self, controller: str) -> Path:
        return self.dirs[0] if self.version == 2 else self.dirs[V1_CONTROLLERS.index(controller)]

    def set_limits(self, memory_bytes: int, max_processes: int) -> None:
        mem = self._dir("memory")
        if self.version == 2:
            _write(mem / "memory.max", str(memory_bytes))
            if (mem / "memory.swap.max").exists():  # absent without swap accounting
                _write(mem / "memory.swap.max", "0")
        else:
            _write(mem / "memory.limit_in_bytes", str(memory_bytes))
            if (mem / "memory.memsw.limit_in_bytes").exists():  # memory + swap: no swapping past the limit
                _write(mem / "memory.memsw.limit_in_bytes", str(memory_bytes))
        _write(self._dir("pids") / "pids.max", str(max_processes))

    def counters(self) -> Counters:
        oom = self._dir("memory") / ("memory.events" if self.version == 2 else "memory.oom_control")
        return Counters(_keyed(oom, "oom_kill"), _keyed(self._dir("pids") / "pids.events", "max"), self.cpu_ns())

    def cpu_ns(self) -> int:
        if self.version == 2:
            return _keyed(self.dirs[0] / "cpu.stat", "usage_usec") * 1000
        return int((self._dir("cpuacct") / "cpuacct.usage").read_text())

    async def kill_all(self, wait_s: float = 2.0) -> None:
        """SIGKILL every process of the group (again until none is left: a fork racing the first round is bounded
        by pids.max), then wait for the group to be empty."""
        await kill_group_dirs(self.dirs, wait_s)

    def remove(self) -> None:
        remove_dirs(self.dirs)


async def kill_group_dirs(dirs: list[Path], wait_s: float = 2.0) -> None:
    """Kill every process listed in the groups `dirs` and wait (up to `wait_s`) until they are gone."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    for d in dirs:
        kill_file = d / "cgroup.kill"  # v2 (5.14+): the kernel kills the whole group at once
        if kill_file.exists():
            _write(kill_file, "1")
    while True:
        pids = set()
        for d in dirs:
            try:
                pids.update(int(p) for p in (d / "cgroup.procs").read_text().split())
            except FileNotFoundError:
                continue
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if loop.time() > deadline:
            raise CgroupError(f"processes {sorted(pids)[:8]} survive SIGKILL in {dirs[0]}")
        await asyncio.sleep(0.005)


def remove_dirs(dirs: list[Path]) -> None:
    """Remove empty groups (rmdir; a group that still holds processes raises EBUSY)."""
    for d in dirs:
        try:
            d.rmdir()
        except FileNotFoundError:
            pass


class CgroupTree:
    """Where this server makes its sandboxes' groups; `make(name)` creates one."""

    def __init__(self, parent: str) -> None:
        self.version = 2 if (ROOT / "cgroup.controllers").exists() else 1
        if self.version == 1:
            missing = [c for c in V1_CONTROLLERS if not (ROOT / c / "cgroup.procs").exists()]
            if missing:
                raise CgroupError(f"cgroup v1 controllers {missing} are not mounted under {ROOT}")
            self.parents = [ROOT / c / _own_path(c) / parent for c in V1_CONTROLLERS]
        else:
            self.parents = [self._v2_parent() / parent]
        for p in self.parents:
            try:
                p.mkdir(exist_ok=True)
            except OSError as e:
                raise CgroupError(f"cannot create the cgroup {p} ({e.strerror})") from None
        if self.version == 2:
            self._enable(self.parents[0])

    def _v2_parent(self) -> Path:
        own = ROOT / _own_path(None)
        try:
            self._enable(own)
        except CgroupError:  # our cgroup holds processes: move this server into a leaf, then retry
            leaf = own / "asyncrl-server"
            leaf.mkdir(exist_ok=True)
            try:
                _write(leaf / "cgroup.procs", str(os.getpid()))
                self._enable(own)
            except (OSError, CgroupError):
                raise CgroupError(f"cgroup v2: cannot enable memory, pids and cpu below {own} (it holds other "
                                  "processes, or is not delegated to this user); run the server in a delegated "
                                  "cgroup, e.g. systemd-run --scope -p Delegate=yes") from None
        return own

    @staticmethod
    def _enable(group: Path) -> None:
        try:
            _write(group / "cgroup.subtree_control", "+memory +pids +cpu")
        except OSError as e:
            raise CgroupError(f"cannot enable controllers in {group} ({e.strerror})") from None

    def make(self, name: str) -> Cgroup:
        dirs = [p / name for p in self.parents]
        for d in dirs:
            d.mkdir()
        return Cgroup(dirs, self.version)
