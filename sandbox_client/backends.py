"""Isolation backends: how the server turns "run this argv in sandbox S" into a host command line.

- `bwrap` (strong): bubblewrap with new user, pid, network, ipc, uts and cgroup namespaces. The sandbox sees a
  read-only /usr (and the /bin, /lib* links into it), a few /etc files, its own /proc, a minimal /dev, a
  private tmpfs /tmp and its work directory at /work; nothing else of the host (no /root, /home, /work, host
  /tmp), no network at all (not even loopback to the host), no capabilities. Under a root server bwrap runs
  as the sandbox's own host uid (`uid_base + slot`, a uid no account uses), so the sandbox's uid 65534 maps to
  that unprivileged uid outside and RLIMIT_NPROC binds. Memory, process count and CPU time are per-sandbox
  cgroups (cgroups.py), with rlimits as a second line. `--die-with-parent`: killing the outer bwrap (the
  server does on timeout) kills the pid namespace and every process in it.
- `process` (WEAK, labelled so): the command runs as a plain child process with rlimits only (CPU, memory as
  address space, processes per uid, file size), in its work directory, as the slot's unprivileged uid under
  a root server. It sees the host's files and network like any user of that uid would: use it only where
  user namespaces are unavailable, for code you would run anyway.

The launcher is `sh` (joins the cgroups by writing its own pid, then execs) → `prlimit` → `setpriv` (drops
to the sandbox's uid) → `bwrap` or the command: small C programs, about a millisecond each, and no
Python `preexec_fn` (unsafe in a threaded server).
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from pathlib import Path
from typing import ClassVar

from sandbox_client.records import MIB, Limits

INSIDE_UID = 65534
"""The uid (and gid) the sandboxed code has inside the bwrap namespace ("nobody")."""
WORK_INSIDE = "/work"
PATH = "/usr/local/bin:/usr/bin:/bin"
_JOIN_CGROUPS = ('for f in "$@"; do [ "$f" = -- ] && break; echo $$ > "$f" || exit 125; shift; done; shift; '
                 'exec "$@"')
"""sh script: write our pid into each file before `--`, then exec the rest (exit 125 if a join fails)."""
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime")
"""Host /etc entries the sandbox gets read-only (the dynamic loader's, alternatives' links, the time zone)."""


class BackendUnavailable(RuntimeError):
    """A backend that cannot run on this machine; the message is one line."""


class Backend:
    """Builds the host command for one exec. `strong` says whether it isolates the host's files, network and
    processes (True) or only bounds resources (False)."""

    name: ClassVar[str]
    strong: ClassVar[bool]

    def __init__(self, etc_dir: Path):
        self.etc_dir = etc_dir
        """The server's synthetic /etc/passwd and /etc/group (one account: the sandbox's)."""

    def check(self, uid: int | None) -> None:
        """Raise BackendUnavailable when this backend cannot run here as `uid` (None: as the server)."""

    def workdir_inside(self, work: Path) -> str:
        """Where the sandboxed command sees its work directory."""
        raise NotImplementedError

    def command(self, argv: list[str], *, work: Path, uid: int | None, limits: Limits, procs_files: list[Path],
                as_init: bool = False) -> tuple[list[str], str, dict[str, str]]:
        """(host argv, host cwd, environment) that run `argv` in the sandbox whose work directory is `work`.
        `as_init`: `argv` is the sandbox's warm interpreter (warm.py), the init of its pid namespace where the
        backend makes one (bwrap `--as-pid-1`)."""
        raise NotImplementedError

    @staticmethod
    def _launcher(*, uid: int | None, limits: Limits, procs_files: list[Path]) -> list[str]:
        # With cgroups bounding memory and processes, the rlimits are a backstop behind them, set loose enough
        # that the cgroup acts first (and reports its reason): runtimes reserve far more address space than
        # they touch, and RLIMIT_NPROC counts bwrap's own processes too. CPU likewise: the server reads the
        # cgroup's CPU time every runner.POLL_S and ends the exec past `cpu_s`; RLIMIT_CPU comes a second after
        # (at the same second, the kernel's SIGXCPU and the server's SIGKILL raced: a warm interpreter's child,
        # whose CPU time the cgroup sees without a launcher's before it, lost that race about half the time).
        slack = 4 if procs_files else 1
        cpu = math.ceil(limits.cpu_s) + (1 if procs_files else 0)
        out = ["/bin/sh", "-c", _JOIN_CGROUPS, "sh", *map(str, procs_files), "--"] if procs_files else []
        out += ["prlimit", f"--cpu={cpu}:{cpu + 1}", f"--as={limits.memory_mib * MIB * slack}",
                f"--nproc={limits.max_processes * slack}",
                f"--fsize={limits.file_mib * MIB}", "--core=0", "--"]
        if uid is not None:
            out += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
        return out


class BwrapBackend(Backend):
    name = "bwrap"
    strong = True

    def __init__(self, etc_dir: Path):
        super().__init__(etc_dir)
        self.bwrap = shutil.which("bwrap")
        self._static = self._static_args()

    def _static_args(self) -> list[str]:
        args = ["--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                "--unshare-cgroup-try", "--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID), "--hostname", "sandbox",
                "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--ro-bind", "/usr", "/usr"]
        for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):  # merged-/usr links, or the directories
            host = Path("/") / name
            if host.is_symlink():
                args += ["--symlink", os.readlink(host), f"/{name}"]
            elif host.is_dir():
                args += ["--ro-bind", str(host), f"/{name}"]
        for name in _ETC:
            if (Path("/etc") / name).exists():
                args += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
        args += ["--ro-bind", str(self.etc_dir / "passwd"), "/etc/passwd", "--ro-bind", str(self.etc_dir / "group"),
                 "/etc/group", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--clearenv",
                 "--setenv", "PATH", PATH, "--setenv", "HOME", WORK_INSIDE, "--setenv", "TMPDIR", "/tmp",
                 "--setenv", "LANG", "C.UTF-8"]
        return args

    def check(self, uid):
        if self.bwrap is None:
            raise BackendUnavailable("bubblewrap is not installed (apt-get install bubblewrap), or use --backend process")
        drop = [] if uid is None else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
        probe = subprocess.run([*drop, self.bwrap, *self._static, "--", "/bin/true"], capture_output=True, text=True,
                               cwd="/")
        if probe.returncode != 0:
            why = probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else f"exit {probe.returncode}"
            raise BackendUnavailable(f"bubblewrap cannot make its namespaces here ({why}); "
                                     "enable user namespaces or use --backend process")

    def workdir_inside(self, work: Path) -> str:
        return WORK_INSIDE

    def command(self, argv, *, work, uid, limits, procs_files, as_init=False):
        host = [*self._launcher(uid=uid, limits=limits, procs_files=procs_files), self.bwrap,
                *self._static, *(["--as-pid-1"] if as_init else []), "--bind", str(work), WORK_INSIDE,
                "--chdir", WORK_INSIDE, "--", *argv]
        return host, "/", {"PATH": PATH}


class ProcessBackend(Backend):
    """WEAK: rlimits and an unprivileged uid only; the sandbox shares the host's files and network."""

    name = "process"
    strong = False

    def workdir_inside(self, work: Path) -> str:
        return str(work)

    def command(self, argv, *, work, uid, limits, procs_files, as_init=False):
        host = [*self._launcher(uid=uid, limits=limits, procs_files=procs_files), *argv]
        return host, str(work), {"PATH": PATH, "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8"}


BACKENDS: dict[str, type[Backend]] = {"bwrap": BwrapBackend, "process": ProcessBackend}
