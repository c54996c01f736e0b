"""The server's own files in its state directory: written atomically and never through a symlink, read back
with suspicion.

- `write_atomic`: a fresh temp name in the same directory (O_EXCL | O_NOFOLLOW: a planted symlink or file
  there is an error, never followed), written, fsync'd, renamed over the final name (rename replaces a
  symlink planted at that name, it never writes through it), then the directory fsync'd. A crash leaves the
  old file or the new one whole, never a truncated one.
- `read_live_record`: a live record (`live/<id>.json`) as the reaper needs it, or `DamagedRecord` naming what
  is wrong. The reaper kills by uid and by cgroup and removes directories on what a record says, so a record
  is checked field by field: its id is its file's name, its work directory is exactly `work/<id>`, its uid
  is no account's (never root's), its cgroups are `<this server's parent group>/<id>` under /sys/fs/cgroup.
  A record damaged by a crash or a full disk (the server before this one wrote in place) is skipped by the
  caller with a log line; it never stops a server's start.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

SANDBOX_ID = re.compile(r"sb-[0-9a-f]{12}")
"""The shape of a sandbox id (`sb-` and 6 random bytes in hex, server.py)."""
RECORD_MAX = 64 << 10
"""Largest live record read back; a record holds an id, a uid and a few paths."""
CGROUP_ROOT = Path("/sys/fs/cgroup")
FIRST_SANDBOX_UID = 1000
"""Below it are the system's accounts; no sandbox ever has such a uid."""


class DamagedRecord(ValueError):
    """A live record the reaper must not act on; the message is one line."""


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Make `path` hold `data` whole (see the module's docstring), with permissions `mode`."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, mode)  # O_CREAT's mode passes through the umask
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_private(path: Path, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes, opened without following a symlink and without
    blocking on a FIFO; `DamagedRecord` otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise DamagedRecord("a symlink" if e.errno == 40 else f"unreadable ({e.strerror})") from None  # 40: ELOOP
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DamagedRecord("not a regular file")
        if st.st_size > limit:
            raise DamagedRecord(f"{st.st_size} bytes, more than a record's {limit}")
        return os.read(fd, limit + 1)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class LiveRecord:
    """What a server wrote down before creating a sandbox: what to kill and remove should it die."""

    id: str
    uid: int | None
    work: Path
    cgroups: tuple[Path, ...]


def read_live_record(path: Path, *, work_area: Path, cgroup_parent: str) -> LiveRecord:
    """The record at `path` checked against this server's layout: work directories are `work_area/<id>`,
    sandbox cgroups `.../<cgroup_parent>/<id>` under /sys/fs/cgroup."""
    raw = read_private(path, RECORD_MAX)
    try:
        rec = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise DamagedRecord(f"not JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(rec, dict):
        raise DamagedRecord(f"not a record (a JSON {type(rec).__name__})")
    missing = [k for k in ("id", "uid", "work", "cgroups") if k not in rec]
    if missing:
        raise DamagedRecord(f"missing {', '.join(missing)}")
    sid = rec["id"]
    if not (isinstance(sid, str) and SANDBOX_ID.fullmatch(sid) and path.name == f"{sid}.json"):
        raise DamagedRecord(f"id {sid!r} is not a sandbox id matching its file's name")
    uid = rec["uid"]
    if uid is not None and not (type(uid) is int and FIRST_SANDBOX_UID <= uid < 2**32 - 1 and not _account(uid)):
        raise DamagedRecord(f"uid {uid!r} is not a sandbox's (an account's, a system uid, or no uid)")
    if rec["work"] != str(work_area / sid):
        raise DamagedRecord(f"work {rec['work']!r} is not {work_area / sid}")
    cgroups = rec["cgroups"]
    if not (isinstance(cgroups, list) and all(isinstance(d, str) for d in cgroups)):
        raise DamagedRecord("cgroups is not a list of paths")
    for d in map(Path, cgroups):
        if not (d.is_absolute() and ".." not in d.parts and d.is_relative_to(CGROUP_ROOT) and d.name == sid
                and d.parent.name == cgroup_parent):
            raise DamagedRecord(f"cgroup {str(d)!r} is not this server's group of {sid}")
    return LiveRecord(sid, uid, work_area / sid, tuple(map(Path, cgroups)))


def _account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True
