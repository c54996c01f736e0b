"""A throwaway PostgreSQL server for tests: Debian's `postgresql` binaries, a data directory in a
temporary folder, a free TCP port on 127.0.0.1, trust authentication, fsync off. `initdb` refuses to
run as root, so under root the server runs as an unprivileged user (`postgres`, which the Debian
package creates, else `nobody`). `.ci/run` installs the package and sets CI=true, where a missing
server is a failure rather than a skip (tests/conftest.py)."""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from sqlalchemy.engine import URL

SUPERUSER = "asyncrl"


def find_bindir() -> Path | None:
    """The directory of `initdb` and `postgres`: on PATH, else Debian's /usr/lib/postgresql/<v>/bin."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    candidates = glob.glob("/usr/lib/postgresql/*/bin/initdb")
    if not candidates:
        return None
    newest = max(candidates, key=lambda p: [int(x) for x in re.findall(r"\d+", p)])
    return Path(newest).parent


def unavailable() -> str | None:
    """Why no test server can start here, or None."""
    if find_bindir() is None:
        return "PostgreSQL is not installed (apt-get install postgresql; .ci/run does)"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "the psycopg driver is not installed (pip install -e '.[dev]')"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    def __init__(self) -> None:
        bindir = find_bindir()
        assert bindir is not None
        self.root = Path(tempfile.mkdtemp(prefix="asyncrl-pg-"))
        self.port = _free_port()
        self._names = itertools.count()
        run_as = {}
        if os.geteuid() == 0:  # initdb and postgres refuse root
            try:
                user = pwd.getpwnam("postgres")
            except KeyError:
                user = pwd.getpwnam("nobody")
            os.chown(self.root, user.pw_uid, user.pw_gid)
            run_as = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
        data = self.root / "data"
        init = subprocess.run([bindir / "initdb", "-D", data, "-U", SUPERUSER, "-A", "trust", "-E", "UTF8",
                               "--locale=C", "--no-sync"], cwd=self.root, capture_output=True, text=True, **run_as)
        assert init.returncode == 0, f"initdb failed: {init.stderr[-2000:]}"
        self._log = open(self.root / "server.log", "wb")  # noqa: SIM115 (open for the server's lifetime)
        settings = {"listen_addresses": "127.0.0.1", "unix_socket_directories": str(self.root), "fsync": "off",
                    "synchronous_commit": "off", "full_page_writes": "off", "max_connections": "60"}
        self.proc = subprocess.Popen(
            [bindir / "postgres", "-D", data, "-p", str(self.port), *(f"-c{k}={v}" for k, v in settings.items())],
            cwd=self.root, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, **run_as)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 60) -> None:
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited: {(self.root / 'server.log').read_text()[-2000:]}")
            try:
                psycopg.connect(host="127.0.0.1", port=self.port, user=SUPERUSER, dbname="postgres").close()
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def url(self, database: str = "postgres") -> URL:
        return URL.create("postgresql+psycopg", username=SUPERUSER, host="127.0.0.1", port=self.port, database=database)

    def create_database(self) -> URL:
        """A new, empty database on this server (one per test keeps tests apart)."""
        import psycopg
        from psycopg import sql

        name = f"t{next(self._names)}"
        with psycopg.connect(host="127.0.0.1", port=self.port, user=SUPERUSER, dbname="postgres", autocommit=True) as c:
            c.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url(name)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)  # fast shutdown: disconnect clients, then exit
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        shutil.rmtree(self.root, ignore_errors=True)
