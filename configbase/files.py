"""The one helper for every file asyncrl writes outside a temporary name: what a write may replace.

Run directories, `--out` directories and model directories are untrusted data (DESIGN "Wave 2 shape"): a
user, an earlier command or anyone who shares the directory may have left a symbolic link, a directory or a
FIFO at the name a command is about to write. The rules, for every writer of the project:
- a symbolic link at the name written is never followed (O_NOFOLLOW); temporary names are created with O_EXCL
  and a random suffix (`tempfile`), so a link planted at a predictable `.name.part` is never opened, and only
  the temporary file or directory this process made is ever removed;
- a file never replaces a symbolic link, a directory or any other non-regular file (`check_replaceable`), and a
  directory the command did not create is never replaced or emptied: an output directory (`--out`) must be
  absent or an empty directory (`output_dir`), and `publish_dir` renames over nothing else (rename(2) itself
  refuses a non-empty directory, a file or a link there);
- whole files are written atomically: a temporary name in the same directory, fsync, `os.replace`, fsync of the
  directory (`atomic_write`, `atomic_open`), so a reader sees the old file or the whole new one; files kept open
  and written in place (metrics.jsonl, lock files) are opened by `open_append` / `open_regular`, which refuse
  anything but a regular file.

A refusal is a `WriteRefused` (a ValueError) whose text is one line naming the path, for the command to print.
This module imports nothing of ours and neither torch nor ray: every package may use it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["WriteRefused", "atomic_open", "atomic_write", "check_replaceable", "fsync_dir", "open_append",
           "open_regular", "output_dir", "publish_dir", "temp_dir_for"]

FILE_MODE = 0o644
DIR_MODE = 0o755


class WriteRefused(ValueError):
    """A write that would follow a link or replace what the command does not own; the text is one line."""


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:  # ENOTDIR (a file where a folder should be), EACCES, ELOOP, ENAMETOOLONG
        raise WriteRefused(f"{path}: {e.strerror or e}") from None


def check_replaceable(path: str | Path) -> None:
    """Refuse (WriteRefused) unless `path` is absent or a regular file: never a link, a directory or a device."""
    st = _lstat(Path(path))
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise WriteRefused(f"{path} is {_kind(st.st_mode)}, not a regular file: refusing to write over it")


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- whole files ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w") -> Iterator[IO]:
    """A file object ("w": text, UTF-8; "wb": bytes) for the new content of `path`: written under a fresh
    temporary name beside it, fsynced and renamed over `path` when the block ends without an exception (the
    temporary file is removed otherwise, and `path` is untouched). `path` must be absent or a regular file,
    checked before the block and again just before the rename."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open: mode {mode!r} (give 'w' or 'wb')")
    path = Path(path)
    check_replaceable(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # O_EXCL | O_NOFOLLOW
    try:
        os.fchmod(fd, FILE_MODE & ~_umask())
        with os.fdopen(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        check_replaceable(path)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write(path: str | Path, data: str | bytes) -> Path:
    """`data` as the whole content of `path`, atomically (`atomic_open`); returns `path`."""
    with atomic_open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    return Path(path)


def open_regular(path: str | Path, flags: int) -> int:
    """A file descriptor of `path` opened with `flags` (os.O_WRONLY | os.O_APPEND, os.O_RDWR, ...; created when
    absent, mode 0o644), refusing a symbolic link there (O_NOFOLLOW) and anything that is not a regular file once
    open (a FIFO is opened without blocking, then refused). For files kept open and written in place: logs, locks."""
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, FILE_MODE)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise WriteRefused(f"{path} is a symbolic link: refusing to write through it") from None
        if e.errno in (errno.ENXIO, errno.EISDIR):  # ENXIO: a FIFO nobody reads
            raise WriteRefused(f"{path} is {'a FIFO' if e.errno == errno.ENXIO else 'a directory'}, not a regular "
                               "file: refusing to write to it") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise WriteRefused(f"{path} is {_kind(mode)}, not a regular file: refusing to write to it")
    os.set_blocking(fd, True)
    return fd


def open_append(path: str | Path) -> IO[str]:
    """`path` opened for appending UTF-8 text (`open_regular`: never through a link, never to a FIFO)."""
    return os.fdopen(open_regular(path, os.O_WRONLY | os.O_APPEND), "a", encoding="utf-8")


# -- whole directories -----------------------------------------------------------------------------------------
def output_dir(path: str | Path, what: str = "--out") -> Path:
    """The absolute output directory `path` names, after checking it is absent or an empty directory (not a
    link to one, not the current directory: a command never replaces or empties a directory it did not
    create). WriteRefused (one line, naming `what`) otherwise."""
    given = str(path)
    p = Path(os.path.abspath(path))
    if p.parent == p:
        raise WriteRefused(f"{what} {given} is the file system's root")
    if p == Path(os.getcwd()):
        raise WriteRefused(f"{what} {given} is the current directory: name a new (or empty) directory")
    st = _lstat(p)
    if st is None:
        return p
    if stat.S_ISLNK(st.st_mode):
        raise WriteRefused(f"{what} {given} is a symbolic link: name a new (or empty) directory")
    if not stat.S_ISDIR(st.st_mode):
        raise WriteRefused(f"{what} {given} exists and is not a directory")
    try:
        with os.scandir(p) as entries:
            empty = next(entries, None) is None
    except OSError as e:
        raise WriteRefused(f"{what} {given}: {e.strerror or e}") from None
    if not empty:
        raise WriteRefused(f"{what} {given} exists and is not an empty directory: nothing in it is replaced; "
                           "name a new (or empty) directory")
    return p


def temp_dir_for(final: str | Path) -> Path:
    """A new empty directory beside `final` (its parents made as needed) under a fresh name, to fill and then
    `publish_dir`; only its creator ever removes it."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    os.chmod(tmp, DIR_MODE & ~_umask())
    return tmp


def publish_dir(tmp: str | Path, final: str | Path) -> Path:
    """Rename the filled directory `tmp` to `final`, which must be absent or an empty directory, and fsync the
    parent. rename(2) itself refuses a non-empty directory (ENOTEMPTY), a file or a link (ENOTDIR) at `final`:
    WriteRefused then, `tmp` left for its creator to remove."""
    tmp, final = Path(tmp), Path(final)
    try:
        os.replace(tmp, final)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise WriteRefused(f"{final} appeared while it was written and is not an empty directory: "
                               "refusing to replace it") from None
        raise
    fsync_dir(final.parent)
    return final


def _umask() -> int:
    """The process's umask, read from /proc (os.umask would set it: not thread-safe); 0o022 where unreadable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022
