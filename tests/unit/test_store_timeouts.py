"""Every connection to a store's database has a timeout (issue #40, class 7): a PostgreSQL server that accepts
and never answers (here a local TCP socket that listens and never speaks) is one line and exit 2, not a hang;
PostgreSQL sessions carry a statement timeout, SQLite connections a busy timeout."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL

from rl.store import db
from rl.store.db import StoreError, reader_engine, sqlite_url, writer_engine
from rl.store.trajectories import TrajectoryStore

CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]


@pytest.fixture
def silent_server():
    """A TCP port on 127.0.0.1 that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield URL.create("postgresql+psycopg", username="asyncrl", host="127.0.0.1", port=s.getsockname()[1],
                         database="asyncrl")


def _within(seconds: float, fn) -> BaseException | None:
    """Run `fn` in a thread; its exception, or a failure when it has not returned within `seconds` (a hang)."""
    out: list[BaseException | None] = []

    def run():
        try:
            fn()
            out.append(None)
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"still waiting after {seconds} s: no connection timeout"
    return out[0]


@pytest.mark.parametrize("opener", ["reader", "writer"])
def test_a_server_that_never_answers_is_an_error_within_the_connect_timeout(silent_server, monkeypatch, opener):
    monkeypatch.setattr(db, "CONNECT_TIMEOUT_S", 1, raising=False)
    t0 = time.monotonic()
    error = _within(15, lambda: TrajectoryStore(silent_server, "r", readonly=opener == "reader"))
    assert isinstance(error, StoreError) and "timeout" in str(error).lower(), error
    assert time.monotonic() - t0 < 10


@pytest.mark.slow  # the default connect timeout, 10 s, through a fresh process
def test_rl_traj_against_a_server_that_never_answers_is_one_line_exit_2(silent_server, tmp_path):
    (tmp_path / "run").mkdir()
    url = silent_server.render_as_string(hide_password=False)
    t0 = time.monotonic()
    proc = subprocess.run([*CLI, "traj", "ls", str(tmp_path / "run"), "--url", url], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rl traj: cannot read the trajectory store") and "timeout" in lines[0]
    assert time.monotonic() - t0 < db.CONNECT_TIMEOUT_S + 30


def test_the_urls_own_connect_timeout_wins(silent_server):
    url = silent_server.update_query_dict({"connect_timeout": "1"})
    error = _within(15, lambda: TrajectoryStore(url, "r", readonly=True))
    assert isinstance(error, StoreError) and "timeout" in str(error).lower(), error


def test_sqlite_connections_wait_a_bounded_busy_timeout(tmp_path):
    TrajectoryStore(sqlite_url(tmp_path / "t.db"), "r").close()
    for engine in (writer_engine(sqlite_url(tmp_path / "t.db")), reader_engine(sqlite_url(tmp_path / "t.db"))):
        with engine.connect() as conn:
            assert conn.execute(text("PRAGMA busy_timeout")).scalar() == db.BUSY_TIMEOUT_S * 1000
        engine.dispose()


def test_postgres_sessions_carry_a_statement_timeout_that_the_url_may_change(postgres_url):
    for url, expected in ((postgres_url, f"{db.STATEMENT_TIMEOUT_S // 60}min"),
                          (postgres_url.update_query_dict({"options": "-c statement_timeout=1500"}), "1500ms")):
        for engine in (writer_engine(url), reader_engine(url)):
            with engine.connect() as conn:
                assert conn.execute(text("SHOW statement_timeout")).scalar() == expected
            engine.dispose()
    plain = create_engine(postgres_url)  # what the store's engines add: not a server default
    with plain.connect() as conn:
        assert conn.execute(text("SHOW statement_timeout")).scalar() == "0"
    plain.dispose()
