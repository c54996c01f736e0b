"""The sandbox server of one node: an asyncio process on a Unix socket that owns sandboxes and runs commands in
them through one isolation backend (backends.py).

- Admission: at most `max_sandboxes` at once; a `create` beyond that is refused at once with a retryable
  error (kind `admission`), never queued. Each sandbox holds a slot, and the slot fixes its host uid
  (`uid_base + slot`: no two live sandboxes share a uid, so RLIMIT_NPROC and a kill by uid are per sandbox).
- A sandbox is a private work directory (`STATE/work/<id>`, owned by its uid: a tmpfs capped at
  `Limits.disk_mib` and `disk_inodes` where the server may mount, quota.py) and, with the strong backend, a
  cgroup; each exec is a fresh bwrap over them, so nothing an exec starts outlives it, while files persist
  between execs. Python calls (`python3 -c`) are the exception where `warm_interpreter` is on (default) and the
  creator did not say `warm: false`: they fork from one warm interpreter per sandbox, inside one bwrap whose init it
  is and which kills whatever a call leaves (warm.py). `write_file`/`read_file` run `cat` inside the sandbox, so a symlink the sandbox planted
  resolves in the sandbox's view of the filesystem, never the server's.
- `snapshot` / `restore` move a work directory's whole content as a gzip'd tar (`tar` inside the sandbox, like
  the file operations): a multi-turn rollout keeps its sample's files across a preemption this way (seed
  §5.1.3). The archive is capped (`Limits.snapshot_mib`); a larger one is a one-line error. An empty directory's
  snapshot is b"" and an unchanged one's the archive before, with no exec (`work_fingerprint`: metadata by lstat).
- An exec ends at its own end, or is killed (the whole process tree) when it passes its wall-clock timeout,
  its CPU seconds (polled from the cgroup, RLIMIT_CPU behind it) or its output cap; OOM kills and refused
  forks are read from the cgroup's counters. The result says which (`ExecResult.reason`).
- Every request and its result go to `STATE/commands.jsonl` (outputs cut to their first 4 KiB there; the
  caller gets them whole, up to the cap, in the result to store with the sample).
- Crash safety: a record per live sandbox (`STATE/live/<id>.json`: work directory, cgroups, uid) is written
  (atomically, never through a symlink: statefiles.py) before anything is created. A server starting on the
  state directory first reaps what a server killed with -9 left: kills the recorded cgroups' processes and the
  recorded uids' processes, unmounts and removes the work directories, removes the groups. A record that is
  damaged, or names anything but this server's own uids, groups and directories, is set aside
  (`<id>.json.damaged`) with a log line; it never stops a start. The state directory and its live/, work/ and
  etc/ must be real directories of the server's uid (a link there is refused in one line). One server per state
  directory (an flock on `STATE/server.lock`). A server removes only the socket file it bound (its inode),
  never another server's at the same path.
- A sandbox belongs to the connection that created it: a request from any other connection naming its id
  gets "no such sandbox", exactly as for an id that never existed. A connection's sandboxes are closed when it
  ends, so a client that dies leaks nothing either (and no client can reuse an id after reconnecting: its
  sandboxes are gone by then).
- Frames: each at most `MAX_FRAME`, and all connections' partly received frames together at most the server's
  frame budget (protocol.FrameBudget); a connection whose frame passes either, or whose frame stalls half-sent,
  gets an error frame (id None) and is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sandbox_client.backends import BACKENDS, INSIDE_UID, Backend, BackendUnavailable
from sandbox_client.cgroups import CgroupError, CgroupTree, kill_group_dirs, remove_dirs
from sandbox_client.processes import Children, become_subreaper, kill_group
from sandbox_client.protocol import FRAME_BODY_S, FRAME_BUDGET, FrameBudget, ProtocolError, encode, read_frame
from sandbox_client.quota import mount_capped, private_mounts, probe, unmount
from sandbox_client.records import MIB, AdmissionRefused, ExecResult, Limits, SandboxError
from sandbox_client.runner import SandboxState, run_exec
from sandbox_client.statefiles import DamagedRecord, read_live_record, write_atomic

LOG_HEAD = 4096
"""Bytes of each output stream the command log keeps."""
ORPHAN_SWEEP_S = 1.0
SNAPSHOT_ARGV = ("tar", "-czf", "-", "--numeric-owner", ".")
"""Run in the work directory: its whole content (hidden files included) as a gzip'd tar on stdout."""
RESTORE_ARGV = ("/bin/sh", "-c", "find . -mindepth 1 -delete && tar -xzf - --no-same-owner")
"""Run in the work directory: empty it, then unpack the archive on stdin into it."""
EMPTY_ARGV = ("find", ".", "-mindepth", "1", "-delete")
"""Run in the work directory: empty it (the restore of an empty directory's snapshot, b"")."""
FINGERPRINT_ENTRIES = 4096
"""A work directory with more entries than this is archived at every snapshot (`work_fingerprint`)."""
WARM_GIVE_UP = 3
"""Warm interpreters that fail to start, with none started yet, before the server turns the warm path off."""
CACHED_SNAPSHOT_BYTES = 256 << 10
"""Archives up to this size are kept for the next snapshot of an unchanged work directory (at most 64 MiB over a
server of 256 sandboxes)."""


def work_fingerprint(work: Path) -> tuple | None:
    """The work directory's metadata: every entry by lstat (path, mode, inode, size, mtime and ctime in ns; ctime moves
    at every write, and no call can set it back) and the directory's own, taken by the server without following a
    link or reading a file; None when it cannot be taken cheaply (more than FINGERPRINT_ENTRIES entries, or one the
    server cannot read): the snapshot then runs `tar` as always. `len(...) == 4`: the directory is empty."""
    entries, stack = [], [""]
    try:
        while stack:
            rel = stack.pop()
            with os.scandir(work / rel if rel else work) as it:
                for e in it:
                    st = e.stat(follow_symlinks=False)
                    path = f"{rel}/{e.name}" if rel else e.name
                    entries.append((path, st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(path)
                    if len(entries) > FINGERPRINT_ENTRIES:
                        return None
        root = os.lstat(work)
    except OSError:
        return None
    return (root.st_mode, root.st_ino, root.st_mtime_ns, root.st_ctime_ns, *sorted(entries))


class ServerError(RuntimeError):
    """A server that cannot start as asked; the message is one line."""


def _digest(state_dir: Path) -> int:
    return int.from_bytes(hashlib.blake2b(str(state_dir.resolve()).encode(), digest_size=4).digest(), "big")


def default_uid_base(state_dir: Path) -> int:
    """A uid range of 65536 derived from the state directory, so two servers on one node (two state
    directories) rarely share uids; above 2,000,000, where Debian's accounts and subordinate ranges are not."""
    return 2_000_000 + (_digest(state_dir) % 4096) * 65536


class SandboxServer:
    def __init__(self, state_dir: str | Path, socket_path: str | Path, *, backend: str = "bwrap",
                 max_sandboxes: int = 32, uid_base: int | None = None, say: Callable[[str], None] | None = None,
                 frame_budget: int = FRAME_BUDGET, warm_interpreter: bool = True):
        """`frame_budget`: bytes all connections' partly received frames may hold together. `warm_interpreter`: a
        sandbox's `python3 -c` execs fork from a warm interpreter of its own (warm.py) instead of spawning each."""
        if backend not in BACKENDS:
            raise ServerError(f"unknown backend {backend!r}: one of {', '.join(BACKENDS)}")
        if not 1 <= max_sandboxes <= 65536:
            raise ServerError(f"max_sandboxes must be in 1..65536, not {max_sandboxes}")
        self.state = Path(state_dir).resolve()
        self.socket_path = Path(socket_path)
        self.max_sandboxes = max_sandboxes
        self.warm_interpreter = warm_interpreter
        self.warm_totals = {"starts": 0, "calls": 0, "retired": 0}
        self._warm_failures = 0
        """Warm interpreters started, calls they ran and interpreters retired, over the sandboxes closed so far."""
        self.say = say or (lambda m: print(f"sandbox server: {m}", file=sys.stderr, flush=True))
        self.root = os.geteuid() == 0
        self.uid_base = (uid_base if uid_base is not None else default_uid_base(self.state)) if self.root else None
        self.backend: Backend = BACKENDS[backend](self.state / "etc")
        self.sandboxes: dict[str, SandboxState] = {}
        self.free_slots = list(range(max_sandboxes - 1, -1, -1))
        self.cgroups: CgroupTree | None = None
        self.frames = FrameBudget(frame_budget)
        self.disk_quota = False
        """Whether work directories are capped tmpfs mounts (quota.py): this server may mount."""
        self._lock_fd: int | None = None
        self._log = None
        self._server: asyncio.AbstractServer | None = None
        self.children = Children()
        self._sweeper: asyncio.Task | None = None
        self._socket_inode: tuple[int, int] | None = None
        """(st_dev, st_ino) of the socket file this server bound: `stop` removes that file only, never one
        another server put at the same path since."""

    # ---- start, reap, stop -------------------------------------------------------------------------------

    async def start(self) -> None:
        if len(os.fsencode(self.socket_path)) > 107:
            raise ServerError(f"the socket path {self.socket_path} is longer than the 107 bytes a Unix socket allows")
        try:
            self._make_state_dirs()
            self._lock_state()
            # held while serving; private: it holds every sandbox's commands and outputs
            self._log = open(os.open(self.state / "commands.jsonl",
                                     os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600), "a", buffering=1)
        except OSError as e:
            raise ServerError(f"cannot use the state directory {self.state}: {e.strerror}"
                              f"{f' ({e.filename})' if e.filename else ''}") from None
        # while this process is single-threaded still (unshare(2) refuses otherwise): a non-root server caps its
        # work directories in a user and mount namespace of its own (quota.py)
        cannot_mount = None if self.root or not self.backend.strong else private_mounts()
        self._check_uids()
        become_subreaper()  # before the first bwrap (the backend's probe) runs
        await self._reap()
        cannot_mount = cannot_mount or probe(self.state / "work")
        self.disk_quota = cannot_mount is None
        if cannot_mount:
            self.say(f"work directories are not capped ({cannot_mount}): a sandbox can fill the disk of "
                     f"{self.state / 'work'} (Limits.disk_mib needs a root server, or the bwrap backend)")
        try:
            self.backend.check(self._uid(0))
        except BackendUnavailable as e:
            raise ServerError(str(e)) from None
        if self.backend.strong:
            try:
                self.cgroups = CgroupTree(self._cgroup_parent)
            except (CgroupError, OSError) as e:
                self.say(f"no cgroups ({e}): memory, processes and CPU time are bounded by rlimits only")
        if not self.backend.strong:
            self.say("backend 'process' is WEAK: rlimits and an unprivileged uid only; sandboxed code sees the "
                     "host's files and network")
        self._sweeper = asyncio.create_task(self.children.sweep(ORPHAN_SWEEP_S))
        await self._listen()
        self.say(f"listening on {self.socket_path} (backend {self.backend.name}, at most {self.max_sandboxes} "
                 f"sandboxes, state {self.state}, pid {os.getpid()})")
        self._record({"op": "start", "backend": self.backend.name, "max_sandboxes": self.max_sandboxes,
                      "pid": os.getpid(), "warm_interpreter": self.warm_interpreter})

    def _make_state_dirs(self) -> None:
        """The state directory and its live/, work/ and etc/: real directories of this server's uid, never a link
        (a link would aim the chmods, the records and the reaper's removals at whatever it names)."""
        self.state.mkdir(parents=True, exist_ok=True)
        for d in ("live", "work", "etc"):
            with contextlib.suppress(FileExistsError):  # a directory, or something planted there: checked below
                (self.state / d).mkdir(mode=0o700)
        for d in (self.state, self.state / "live", self.state / "work", self.state / "etc"):
            st = d.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                raise ServerError(f"{d} is not a directory of uid {os.geteuid()} (a link, a file or another user's): "
                                  "remove it, or pick another state directory")
        if self.root:  # sandbox uids must traverse to their work directories (bwrap binds them as that uid)
            for d in (self.state, self.state / "work", self.state / "etc"):
                d.chmod(0o711)
            for parent in self.state.parents:
                if not parent.stat().st_mode & stat.S_IXOTH:
                    raise ServerError(f"sandbox uids cannot reach {self.state}: {parent} is not o+x "
                                      "(pick a state directory under /tmp or /var/lib)")
        passwd = f"sandbox:x:{INSIDE_UID}:{INSIDE_UID}:sandbox:/work:/bin/sh\n"
        write_atomic(self.state / "etc" / "passwd", passwd.encode(), 0o644)
        write_atomic(self.state / "etc" / "group", f"sandbox:x:{INSIDE_UID}:\n".encode(), 0o644)

    def _lock_state(self) -> None:
        fd = os.open(self.state / "server.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another server"
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ServerError(f"{self.state} is in use by {holder}: one server per state directory") from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}".encode(), 0)
        self._lock_fd = fd

    def _uid(self, slot: int) -> int | None:
        return None if self.uid_base is None else self.uid_base + slot

    def _check_uids(self) -> None:
        if self.uid_base is None:
            self.say("not root: sandboxes run as this server's uid (inside bwrap: uid 65534)")
            return
        if self.uid_base < 1000 or self.uid_base + self.max_sandboxes > 2**32 - 2:
            raise ServerError(f"uid_base {self.uid_base} must leave {self.max_sandboxes} uids between 1000 and 2^32-2")
        for slot in range(self.max_sandboxes):
            uid = self.uid_base + slot
            with contextlib.suppress(KeyError):
                raise ServerError(f"uid {uid} (uid_base + slot {slot}) belongs to the account "
                                  f"{pwd.getpwuid(uid).pw_name!r}: pick another --uid-base")

    async def _reap(self) -> None:
        """Kill and remove what a previous server on this state directory left behind."""
        for path in sorted((self.state / "live").glob("*.json")):
            try:
                rec = read_live_record(path, work_area=self.state / "work", cgroup_parent=self._cgroup_parent)
            except DamagedRecord as e:
                aside = path.with_name(f"{path.name}.damaged")
                path.rename(aside)  # kept for a look, never read again; its work directory goes as a stray, below
                self.say(f"skipped the damaged record {path.name} ({e}); moved to {aside.name}")
                self._record({"op": "reap", "record": path.name, "damaged": str(e)})
                continue
            cgroup_dirs = list(rec.cgroups)
            await kill_group_dirs(cgroup_dirs)
            remove_dirs(cgroup_dirs)
            if rec.uid is not None:
                await self.children.kill_uid(rec.uid)
            self._remove_work(rec.work)
            path.unlink()
            self.say(f"reaped sandbox {rec.id} left by a previous server")
            self._record({"op": "reap", "sandbox": rec.id})
        for stray in (self.state / "work").iterdir():  # created before a crash but after its record went
            self._remove_work(stray)

    def _remove_work(self, work: Path) -> None:
        if work.parent == self.state / "work" and work.name not in ("", ".", ".."):  # never outside our work area
            unmount(work)  # its capped tmpfs first: rmtree then removes the empty mount point
            shutil.rmtree(work, ignore_errors=True)

    @property
    def _cgroup_parent(self) -> str:
        """The name of this server's parent group of sandbox cgroups (one per state directory)."""
        return f"asyncrl-sandboxes-{_digest(self.state):08x}"

    async def _listen(self) -> None:
        if self.socket_path.exists() or self.socket_path.is_symlink():
            with socket.socket(socket.AF_UNIX) as probe:
                try:
                    probe.connect(str(self.socket_path))
                except OSError:
                    self.socket_path.unlink()  # stale: its server is gone
                else:
                    raise ServerError(f"another server already listens on {self.socket_path}")
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        # bound here, not by asyncio: given a path, asyncio first unlinks whatever socket is there, which could be
        # the socket of a server that started since the probe above
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(self.socket_path))
        except OSError as e:
            sock.close()
            raise ServerError(f"cannot listen on {self.socket_path} ({e.strerror}): another server took it") from None
        st = self.socket_path.stat()
        self._socket_inode = (st.st_dev, st.st_ino)
        self.socket_path.chmod(0o600)  # before listen(): no one connects to it before that
        self._server = await asyncio.start_unix_server(self._connection, sock=sock, limit=1 << 20)

    async def serve_forever(self) -> None:
        """Serve until SIGTERM or SIGINT, then close every sandbox."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await self.stop()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
            if owns_socket_file(self.socket_path, self._socket_inode):
                self.socket_path.unlink()
        for sb in list(self.sandboxes.values()):
            await self._close(sb)
        if self._sweeper is not None:
            self._sweeper.cancel()
            self.children.reap_orphans()
        if self.cgroups is not None:
            remove_dirs(self.cgroups.parents)
        self._record({"op": "stop"})
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # ---- connections -------------------------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        owned: set[str] = set()
        tasks: set[asyncio.Task] = set()
        write_lock = asyncio.Lock()

        async def answer(message: dict[str, Any]) -> None:
            async with write_lock:
                writer.write(encode(message))
                await writer.drain()

        try:
            while (msg := await read_frame(reader, self.frames, FRAME_BODY_S)) is not None:
                task = asyncio.create_task(self._request(msg, owned, answer))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        except (ProtocolError, ConnectionError) as e:
            self._record({"op": "disconnect", "error": str(e)})
            if isinstance(e, ProtocolError):  # the client's last word from us: why its connection ends
                with contextlib.suppress(ConnectionError):
                    await answer({"id": None, "ok": False, "error": {"kind": "protocol", "message": str(e),
                                                                     "retryable": False}})
        finally:
            for sid in list(owned):
                if sid in self.sandboxes:
                    await self._close(self.sandboxes[sid])
            if tasks:
                await asyncio.wait(tasks)
            writer.close()

    async def _request(self, msg: dict[str, Any], owned: set[str], answer) -> None:
        rid, op = msg.get("id"), msg.get("op")
        try:
            handler = self._ops().get(op)
            if handler is None:
                raise ValueError(f"unknown op {op!r}")
            result = await handler(msg, owned)
            reply = {"id": rid, "ok": True, "result": result}
        except SandboxError as e:
            reply = {"id": rid, "ok": False, "error": {"kind": "admission" if isinstance(e, AdmissionRefused) else "sandbox",
                                                       "message": str(e), "retryable": e.retryable}}
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            reply = {"id": rid, "ok": False, "error": {"kind": "bad_request", "message": f"{where}: {first['msg']}",
                                                       "retryable": False}}
        except (ValueError, TypeError, KeyError) as e:
            reply = {"id": rid, "ok": False, "error": {"kind": "bad_request", "message": f"{type(e).__name__}: {e}",
                                                       "retryable": False}}
        if not reply["ok"]:
            self._record({"op": op, "sandbox": msg.get("sandbox_id"), "error": reply["error"]})
        with contextlib.suppress(ConnectionError):
            await answer(reply)

    def _ops(self) -> dict[str, Callable]:
        return {"create": self._op_create, "exec": self._op_exec, "write_file": self._op_write_file,
                "read_file": self._op_read_file, "snapshot": self._op_snapshot, "restore": self._op_restore,
                "close": self._op_close, "info": self._op_info}

    def _get(self, msg: dict[str, Any], owned: set[str]) -> SandboxState:
        """The sandbox `msg` names, if this connection created it and it is open; another connection's sandbox
        is answered exactly as one that never existed (its existence is nobody else's business)."""
        sid = msg["sandbox_id"]
        if not isinstance(sid, str):
            raise TypeError("sandbox_id must be a string")
        sb = self.sandboxes.get(sid) if sid in owned else None
        if sb is None or sb.closed:
            raise SandboxError(f"no such sandbox {sid[:64]!r}")
        return sb

    # ---- operations --------------------------------------------------------------------------------------

    async def _op_info(self, msg, owned) -> dict[str, Any]:
        return {"backend": self.backend.name, "strong": self.backend.strong, "max_sandboxes": self.max_sandboxes,
                "active": len(self.sandboxes), "pid": os.getpid(), "cgroups": self.cgroups is not None,
                "disk_quota": self.disk_quota, "warm_interpreter": self.warm_interpreter, "warm": self._warm_stats()}

    def _warm_stats(self) -> dict[str, int]:
        """Warm interpreters started, calls run in them and interpreters retired (killed, dead, stray, spent), all
        sandboxes so far."""
        stats = dict(self.warm_totals)
        for sb in self.sandboxes.values():
            stats["starts"] += sb.warm_starts
            stats["calls"] += sb.warm_calls
            stats["retired"] += sb.warm_retired
        return stats

    async def _op_create(self, msg, owned) -> dict[str, Any]:
        limits = Limits.model_validate(msg.get("limits") or {})
        warm = msg.get("warm", True)
        if not isinstance(warm, bool):
            raise TypeError("warm must be a boolean")
        if not self.free_slots:
            raise AdmissionRefused(f"this node already runs its maximum of {self.max_sandboxes} sandboxes; retry later")
        slot = self.free_slots.pop()
        sid = f"sb-{secrets.token_hex(6)}"
        uid = self._uid(slot)
        work = self.state / "work" / sid
        cgroup_dirs = [p / sid for p in self.cgroups.parents] if self.cgroups is not None else []
        sb = SandboxState(sid, slot, uid, work, limits, None, warm_wanted=warm)
        self.sandboxes[sid] = sb
        try:
            write_atomic(self.state / "live" / f"{sid}.json", json.dumps(
                {"id": sid, "uid": uid, "work": str(work), "cgroups": [str(d) for d in cgroup_dirs]}).encode())
            work.mkdir(mode=0o700)
            if uid is not None:
                os.chown(work, uid, uid)
            if self.disk_quota:
                mount_capped(work, limits.disk_mib * MIB, limits.disk_inodes, uid)
            if self.cgroups is not None:
                sb.cgroup = self.cgroups.make(sid)
                sb.cgroup.set_limits(limits.memory_mib << 20, limits.max_processes)
        except OSError as e:
            await self._close(sb)
            raise SandboxError(f"cannot set up a sandbox ({e})") from None
        owned.add(sid)
        self._record({"op": "create", "sandbox": sid, "uid": uid, "limits": limits.model_dump(), "warm": warm})
        return {"sandbox_id": sid, "backend": self.backend.name, "strong": self.backend.strong, "host_uid": uid,
                "work_dir": str(work), "workdir_inside": self.backend.workdir_inside(work), "limits": limits.model_dump()}

    async def _op_close(self, msg, owned) -> dict[str, Any]:
        sb = self._get(msg, owned)
        owned.discard(sb.id)
        await self._close(sb)
        return {}

    async def _op_exec(self, msg, owned) -> dict[str, Any]:
        sb = self._get(msg, owned)
        argv = msg["argv"]
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) and "\0" not in a for a in argv):
            raise ValueError("argv must be a non-empty list of strings without NUL")
        stdin = msg.get("stdin") or b""
        if not isinstance(stdin, bytes):
            raise TypeError("stdin must be bytes")
        timeout = msg.get("timeout_s")
        if timeout is not None and not (isinstance(timeout, (int, float)) and 0 < timeout <= 24 * 3600):
            raise ValueError(f"timeout_s must be in (0, 86400], not {timeout!r}")
        warm_before = sb.warm_calls
        result = await run_exec(sb, self.backend, self.children, argv, stdin, float(timeout or sb.limits.timeout_s),
                                warm=self.warm_interpreter and sb.warm_wanted)
        if sb.warm_off and not sb.warm_off_logged:
            sb.warm_off_logged = True
            self._record({"op": "warm_off", "sandbox": sb.id, "why": sb.warm_off})
            self._warm_failures += 1
            if self.warm_interpreter and self._warm_failures >= WARM_GIVE_UP and not self._warm_stats()["starts"]:
                self.warm_interpreter = False  # a host where it cannot start (an old bwrap, no ctypes): stop paying
                self.say(f"warm interpreters do not start here ({sb.warm_off}): every call spawns")
                self._record({"op": "warm_off", "why": sb.warm_off})
        self._record_exec("exec", result, warm=sb.warm_calls > warm_before)
        return result.to_wire()

    async def _op_write_file(self, msg, owned) -> dict[str, Any]:
        sb, path, data = self._get(msg, owned), _path(msg), msg["data"]
        if not isinstance(data, bytes):
            raise TypeError("data must be bytes")
        result = await run_exec(sb, self.backend, self.children, ["/bin/sh", "-c", 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"', "sh", path],
                                  data, sb.limits.timeout_s)
        self._record_exec("write_file", result)
        if not result.ok:
            raise SandboxError(f"write_file {path}: {_why(result)}")
        return {"bytes": len(data)}

    async def _op_read_file(self, msg, owned) -> dict[str, Any]:
        sb, path = self._get(msg, owned), _path(msg)
        result = await run_exec(sb, self.backend, self.children, ["cat", "--", path], b"", sb.limits.timeout_s)
        self._record_exec("read_file", result)
        if result.stdout_truncated:
            raise SandboxError(f"read_file {path}: larger than the sandbox's output cap of {sb.limits.output_bytes} bytes")
        if not result.ok:
            raise SandboxError(f"read_file {path}: {_why(result)}")
        return {"data": result.stdout}

    async def _op_snapshot(self, msg, owned) -> dict[str, Any]:
        """The work directory as a gzip'd tar from `tar` inside the sandbox; without an exec, b"" for an empty one and
        the last archive for one whose fingerprint has not changed since (`work_fingerprint`): a multi-turn sample
        snapshots before every call after its first (rl/runtime/tool_turns.py), and a process spawn is what a call
        costs. `exec` in the answer: whether `tar` ran."""
        sb = self._get(msg, owned)
        before = work_fingerprint(sb.work)
        if before is not None and (len(before) == 4 or (sb.snapshot_cache or (None,))[0] == before):
            data = b"" if len(before) == 4 else sb.snapshot_cache[1]
            self._record({"op": "snapshot", "sandbox": sb.id, "reason": "empty" if not data else "unchanged",
                          "stdout_bytes": len(data)})
            return {"data": data, "exec": False}
        cap = sb.limits.snapshot_mib * MIB
        result = await run_exec(sb, self.backend, self.children, list(SNAPSHOT_ARGV), b"", sb.limits.timeout_s,
                                output_bytes=cap)
        self._record_exec("snapshot", result, keep_stdout=False)
        if result.stdout_truncated:
            raise SandboxError(f"snapshot: the work directory's archive passes the sandbox's cap of "
                               f"{sb.limits.snapshot_mib} MiB (Limits.snapshot_mib)")
        if not result.ok:
            raise SandboxError(f"snapshot: {_why(result)}")
        # kept only if nothing moved while tar ran (an exec beside it, against the rule) and it is small
        keep = before is not None and len(result.stdout) <= CACHED_SNAPSHOT_BYTES and work_fingerprint(sb.work) == before
        sb.snapshot_cache = (before, result.stdout) if keep else None
        return {"data": result.stdout, "exec": True}

    async def _op_restore(self, msg, owned) -> dict[str, Any]:
        sb, data = self._get(msg, owned), msg["data"]
        if not isinstance(data, bytes):
            raise TypeError("data must be bytes")
        if len(data) > sb.limits.snapshot_mib * MIB:
            raise SandboxError(f"restore: an archive of {len(data)} bytes passes the sandbox's cap of "
                               f"{sb.limits.snapshot_mib} MiB (Limits.snapshot_mib)")
        sb.snapshot_cache = None
        argv = RESTORE_ARGV if data else EMPTY_ARGV  # b"": an empty directory's snapshot
        result = await run_exec(sb, self.backend, self.children, list(argv), data, sb.limits.timeout_s)
        self._record_exec("restore", result)
        if not result.ok:
            raise SandboxError(f"restore: {_why(result)}")
        return {"bytes": len(data)}

    # ---- running one command -----------------------------------------------------------------------------

    async def _close(self, sb: SandboxState) -> None:
        if sb.closed:
            if sb.closing is not None:
                await sb.closing.wait()
            return
        sb.closed, sb.closing = True, asyncio.Event()
        try:
            await self._teardown(sb)
        finally:
            sb.closing.set()

    async def _teardown(self, sb: SandboxState) -> None:
        for proc in list(sb.procs):
            kill_group(proc.pid)
        if sb.warm is not None:
            await sb.warm.retire()
            sb.warm = None
        if sb.cgroup is not None:
            await sb.cgroup.kill_all()
        elif sb.uid is not None:
            await self.children.kill_uid(sb.uid)
        self._remove_work(sb.work)  # before the cgroup goes: its tmpfs pages are charged to it
        if sb.cgroup is not None:
            sb.cgroup.remove()
        (self.state / "live" / f"{sb.id}.json").unlink(missing_ok=True)
        for key, n in (("starts", sb.warm_starts), ("calls", sb.warm_calls), ("retired", sb.warm_retired)):
            self.warm_totals[key] += n
        del self.sandboxes[sb.id]
        self.free_slots.append(sb.slot)
        self._record({"op": "close", "sandbox": sb.id})

    # ---- the command log ---------------------------------------------------------------------------------

    def _record(self, entry: dict[str, Any]) -> None:
        if self._log is not None:
            # default: a request's fields are the client's, of any msgpack type (bytes, say); the log is never
            # why a request goes unanswered
            self._log.write(json.dumps({"ts": round(time.time(), 6), **entry}, default=lambda v: repr(v)[:200]) + "\n")

    def _record_exec(self, op: str, r: ExecResult, keep_stdout: bool = True, warm: bool = False) -> None:
        self._record({"op": op, "sandbox": r.sandbox_id, **({"warm": True} if warm else {}), "command": list(r.command), "reason": r.reason,
                      "exit_code": r.exit_code, "signal": r.signal, "duration_s": r.duration_s, "cpu_s": r.cpu_s,
                      "stdout_bytes": len(r.stdout), "stderr_bytes": len(r.stderr), "stdout_truncated": r.stdout_truncated,
                      "stderr_truncated": r.stderr_truncated, "stdout": r.stdout[:LOG_HEAD].decode(errors="replace") if keep_stdout else "",
                      "stderr": r.stderr[:LOG_HEAD].decode(errors="replace")})


def owns_socket_file(path: Path, inode: tuple[int, int] | None) -> bool:
    """Whether `path` is still the socket file whose (st_dev, st_ino) is `inode` (the one its server bound)."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    return inode is not None and (st.st_dev, st.st_ino) == inode


def _path(msg: dict[str, Any]) -> str:
    path = msg["path"]
    if not isinstance(path, str) or not path or "\0" in path:
        raise ValueError("path must be a non-empty string without NUL")
    return path


def _why(r: ExecResult) -> str:
    last = r.stderr_text.strip().splitlines()
    return last[-1] if last else f"{r.reason}, exit {r.exit_code}"


