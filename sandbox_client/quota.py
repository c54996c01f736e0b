"""Capped work directories: a sandbox's work directory is the mount point of a tmpfs of its own, sized
`Limits.disk_mib` with `Limits.disk_inodes` inodes, so a write past either fails inside the sandbox with
ENOSPC, and the host's disk never sees the sandbox's files at all.

Why a host tmpfs per work directory, mounted by the server (not bwrap's `--size` with `--tmpfs`, a loop
device or filesystem quotas): each exec is a fresh bwrap, so a tmpfs that bwrap mounts lives only as long as
one exec, while a work directory persists across execs; a loop device needs an image file, mkfs and root;
project or user quotas depend on the host filesystem and its mount options. A tmpfs mount holds under both
backends (bwrap binds the mount point like any directory; the process backend runs in it) and costs about a
millisecond per create. Its pages are RAM, charged to the memory cgroup of the process that writes them (the
sandbox's), so a sandbox's files count towards its `memory_mib`, as /tmp's do.

Mounting needs CAP_SYS_ADMIN over a mount namespace. A root server has it and mounts in its own namespace
(the host's, usually). A non-root server with the bwrap backend first makes itself the root of a user namespace
and a mount namespace of its own (`private_mounts`, as `unshare --map-root-user --mount` does; bwrap needs user
namespaces anyway): its mounts are seen by it and its children only, and vanish with the last of them, so even
a server killed with -9 leaves no mount behind. Its sandboxes' files are then visible from outside only through
the server's view, `/proc/<server pid>/root/<work dir>`. A server that can do neither (the process backend,
whose command would share that namespace with the powers of its root, without root; no user namespaces) says so
at start in one line and serves uncapped work directories (`info`'s `disk_quota` is False), as it serves
without cgroups where it cannot make them.
"""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 1 << 14, 1 << 18
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MNT_DETACH, UMOUNT_NOFOLLOW = 2, 8
_libc = ctypes.CDLL(None, use_errno=True)


def mount_capped(work: Path, size_bytes: int, inodes: int, uid: int | None) -> None:
    """Mount a tmpfs of `size_bytes` and `inodes` on the (empty) directory `work`, its root owned by `uid` (None:
    this process's) with mode 0700; OSError when it cannot."""
    owner = os.getuid() if uid is None else uid
    options = f"size={size_bytes},nr_inodes={inodes},mode=0700,uid={owner},gid={owner}"
    if _libc.mount(b"tmpfs", os.fsencode(work), b"tmpfs", MS_NOSUID | MS_NODEV, options.encode()) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount tmpfs on {work}: {os.strerror(e)}")


def unmount(work: Path) -> None:
    """Detach whatever is mounted on `work` (never following a symlink there); nothing when nothing is."""
    for _ in range(8):  # stacked mounts, one per round; a sandbox cannot mount, so one is all there ever is
        if _libc.umount2(os.fsencode(work), MNT_DETACH | UMOUNT_NOFOLLOW) != 0:
            e = ctypes.get_errno()
            if e in (errno.EINVAL, errno.ENOENT, errno.ENOTDIR, errno.EPERM):  # not a mount point, or not ours
                return
            raise OSError(e, f"umount {work}: {os.strerror(e)}")


def probe(directory: Path) -> str | None:
    """None when this process can mount capped work directories in `directory`, else why not (one line)."""
    if not hasattr(_libc, "mount"):
        return "no mount(2) here"
    target = directory / ".quota-probe"
    target.mkdir(mode=0o700, exist_ok=True)
    try:
        mount_capped(target, 1 << 20, 16, None)
    except OSError as e:
        return e.strerror
    finally:
        unmount(target)
        target.rmdir()
    return None


def private_mounts() -> str | None:
    """Make this process uid 0 of a user namespace of its own mapped to its own uid and gid, with a private mount
    namespace: None when done, else why not (one line). Only a single-threaded process may (unshare(2))."""
    uid, gid = os.getuid(), os.getgid()
    if _libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
        return f"cannot make a user and mount namespace ({os.strerror(ctypes.get_errno())})"
    try:
        for name, line in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(line)
    except OSError as e:
        return f"cannot map its uid in its user namespace ({e.strerror})"
    if _libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return f"cannot make its mounts private ({os.strerror(ctypes.get_errno())})"
    return None
