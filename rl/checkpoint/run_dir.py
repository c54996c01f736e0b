"""Run-directory ownership (issue #13): one job per run directory, and no run started over by accident.

- A job holds an exclusive `fcntl.flock` on `RUN_DIR/.lock` from before it opens the store until it has
  closed everything. The kernel drops the lock when the process dies, kill -9 included, so the next start
  proceeds; a second `rl train`/`rl resume` on the directory meanwhile refuses at once, naming the
  holder's pid, host and start time (written into the lock file). `--break-lock` skips the lock, for
  filesystems where flock does not work (some network filesystems): then nothing stops two jobs.
- `rl train` into a directory that already holds a run (run.json, recipe.yaml or checkpoints) refuses:
  continue it with `rl resume`, or pass `--overwrite`, which removes the run's own artifacts (checkpoints,
  exports, metrics, its SQLite store, its identity) and nothing else, so the new run gets a new identity
  and a shared database keeps the old run's rows under the old one.
- `rl reconfigure` needs a running job: with the lock free it refuses at once (`running_job`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
import stat
import time
from pathlib import Path

from configbase.files import WriteRefused, open_regular
from rl.store.identity import RECIPE_FILE, RUN_FILE
from rl.store.db import DB_FILE

LOCK_FILE = ".lock"
RUN_ARTIFACTS = ("checkpoints", "export", "wandb", "metrics.jsonl", RECIPE_FILE, RUN_FILE, DB_FILE, f"{DB_FILE}-wal",
                 f"{DB_FILE}-shm", f"{DB_FILE}.lock", "control")
"""What a run writes into its directory (what --overwrite removes); any other file stays."""


class RunDirError(RuntimeError):
    """A run directory this command may not use now; the message is one line."""


RUN_FOLDERS = ("checkpoints", "export", "wandb", "control")
"""The RUN_ARTIFACTS that are folders; the others are regular files."""


def make_run_dir(run_dir: str | Path) -> None:
    """The run directory, made with its parents when absent; RunDirError (one line) when a file is in the way."""
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise RunDirError(f"{run_dir} exists and is not a directory") from None
    except OSError as e:  # EACCES, ENOTDIR (a file where a parent should be), a read-only filesystem
        raise RunDirError(f"cannot make the run directory {run_dir}: {e.strerror or e}") from None


def check_run_entries(run_dir: str | Path) -> None:
    """Under the run's lock, before the job writes anything (fresh or resumed): every name a run writes
    (RUN_ARTIFACTS) is absent or of its kind, and none is a symbolic link: a link planted at `checkpoints`,
    `metrics.jsonl` or `trajectories.db` would send the run's writes outside its directory (configbase/files.py:
    a write never follows a link). RunDirError (one line) naming the first that is not."""
    for name in RUN_ARTIFACTS:
        p = Path(run_dir) / name
        try:
            mode = os.lstat(p).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(mode):
            raise RunDirError(f"{p} is a symbolic link: a run writes its own {name} inside its directory "
                              "(remove the link)")
        if stat.S_ISDIR(mode) != (name in RUN_FOLDERS) or not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
            kind = "folder" if name in RUN_FOLDERS else "regular file"
            raise RunDirError(f"{p} is not a {kind}: a run writes its own {name} there")


class RunLock:
    """The exclusive lock of a run directory, held while the object is open (a context manager)."""

    def __init__(self, run_dir: str | Path, *, break_lock: bool = False):
        self.path = Path(run_dir) / LOCK_FILE
        self.break_lock = break_lock
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        if self.break_lock:
            return self
        try:  # the holder is written into it: never through a link planted at its name
            fd = open_regular(self.path, os.O_RDWR)
        except WriteRefused as e:
            raise RunDirError(str(e)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunDirError(f"{self.path.parent} is in use by {holder}: one job per run directory "
                                  "(pass --break-lock only where file locks do not work)") from None
            raise RunDirError(f"cannot lock {self.path} ({e.strerror}); on a filesystem without locks pass --break-lock") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def running_job(run_dir: str | Path) -> str | None:
    """Who holds the run directory's lock ("pid N on HOST since T"), or None when no job does."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
    finally:
        os.close(fd)  # drops the shared lock if it was taken
    return None


def holds_run(run_dir: str | Path) -> list[str]:
    """The run artifacts that say `run_dir` already holds a run (empty: a new or empty directory)."""
    d = Path(run_dir)
    found = [n for n in (RUN_FILE, RECIPE_FILE) if (d / n).is_file()]
    if (d / "checkpoints").is_dir() and any((d / "checkpoints").iterdir()):
        found.append("checkpoints/")
    return found


def claim_for_new_run(run_dir: str | Path, *, overwrite: bool, say=print) -> None:
    """Under the run's lock, before a fresh (not resumed) job opens anything: refuse a directory that holds
    a run, or with `overwrite` remove that run's artifacts (RUN_ARTIFACTS) first."""
    d = Path(run_dir)
    found = holds_run(d)
    if not found:
        return
    if not overwrite:
        raise RunDirError(f"{d} already holds a run ({', '.join(found)}): continue it with `rl resume {d}`, "
                          "or pass --overwrite to start over in it (its checkpoints, metrics and store go)")
    removed = []
    for name in RUN_ARTIFACTS:
        p = d / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
        else:
            continue
        removed.append(name)
    say(f"--overwrite: removed {', '.join(removed)} from {d}")
