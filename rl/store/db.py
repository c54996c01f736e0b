"""Opening a trajectory store's database: URLs, engines for the writer and for readers, the schema
version, and upgrades (Alembic revisions in rl/store/migrations/versions/).

Rules:
- The writing job (`rl train`, `rl resume`) upgrades its store when it opens it, under a lock: a
  transaction-scoped PostgreSQL advisory lock (`MIGRATION_LOCK_KEY`), or for SQLite an exclusive
  `fcntl` lock on the sibling file `<database>.lock`; so two jobs starting on one new database
  create it once. `rl db upgrade` does the same by hand. An upgrade is one transaction: it applies
  completely or not at all.
- Readers (`rl traj`, benches, tests) never migrate and never create: SQLite opens read-only
  (`mode=ro`, no WAL switch, no file created), PostgreSQL in read-only transactions; a store older
  than the code is refused with one line naming `rl db upgrade`, a database without our tables with
  one line saying it is not a store.
- A store written before versioning (no `alembic_version` table) is recognised by its columns and
  adopted by the baseline revision 0001 (rl/store/migrations/versions/0001_baseline_d07e8ae.py).
- URLs are built with `URL.create`, never formatted from paths (a directory may contain `?`, `#`, `%`).
- Every connection has a timeout (`_connect_args`): PostgreSQL (libpq drivers) a `connect_timeout`, TCP
  keepalives and a `statement_timeout`, so that a server that accepts and never answers, or a dead peer, is an
  error rather than a hang; SQLite a busy timeout. Settings in the URL's query win over these defaults.
"""

from __future__ import annotations

import fcntl
import functools
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Connection, Engine, column, create_engine, event, func, inspect, select, table, union
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.pool import NullPool

from configbase.files import WriteRefused, check_replaceable, open_append

DB_FILE = "trajectories.db"
"""A run directory's default store file."""
MIGRATION_LOCK_KEY = 0x6173796E63726C00
"""pg_advisory_xact_lock key held while a store migrates ("asyncrl\\0" as a bigint)."""
CONNECT_TIMEOUT_S = 10
"""PostgreSQL `connect_timeout`: seconds to reach a server and finish the start-up handshake."""
STATEMENT_TIMEOUT_S = 600
"""PostgreSQL `statement_timeout`: the longest one statement (a rollback's deletes, a migration, the wait for
the migration lock) may run before the server cancels it."""
KEEPALIVE_S = 30
"""PostgreSQL TCP keepalives: idle seconds before the first probe (then 3 probes 10 s apart); a peer that
vanished mid-query is an error after about a minute, not a read that never returns."""
BUSY_TIMEOUT_S = 30
"""SQLite: how long a connection waits for another one's lock before "database is locked"."""


class StoreError(Exception):
    """A store that cannot be opened as asked (missing, not a store, too old or new, unreachable);
    the message is one line for the user (a driver's multi-line message is joined)."""

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))


def sqlite_url(path: str | Path) -> URL:
    """The SQLAlchemy URL of a SQLite file, whatever characters its path holds."""
    return URL.create("sqlite", database=str(Path(path).absolute()))


def redacted(url: URL) -> str:
    return url.render_as_string(hide_password=True)


def sqlite_file(url: URL) -> Path | None:
    """The database file of a SQLite URL; None for another backend or an in-memory database."""
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    return Path(url.database)


def parse_url(url: str | URL) -> URL:
    try:
        return make_url(url) if isinstance(url, str) else url
    except ArgumentError:
        raise StoreError(f"not a SQLAlchemy database URL: {url!r}") from None


def _connect_args(url: URL) -> dict:
    """The driver's connection timeouts for `url`, except those its query already sets (see the module docstring).
    PostgreSQL through a libpq driver (psycopg, psycopg2) only: other drivers name these settings differently."""
    if url.get_backend_name() == "sqlite":
        return {} if "timeout" in url.query else {"timeout": BUSY_TIMEOUT_S}
    if url.get_backend_name() != "postgresql" or url.get_driver_name() not in ("psycopg", "psycopg2"):
        return {}
    args = {"connect_timeout": CONNECT_TIMEOUT_S, "keepalives": 1, "keepalives_idle": KEEPALIVE_S,
            "keepalives_interval": 10, "keepalives_count": 3}
    args = {k: v for k, v in args.items() if k not in url.query}
    own = url.query.get("options")
    own = " ".join(own) if isinstance(own, tuple) else own  # connect_args replace the URL's: keep its options last
    args["options"] = " ".join(o for o in (f"-c statement_timeout={STATEMENT_TIMEOUT_S * 1000}", own) if o)
    return args


def _engine(url: URL, **kw) -> Engine:
    try:
        return create_engine(url, connect_args=_connect_args(url), **kw)
    except (ImportError, NoSuchModuleError) as e:  # e.g. postgresql+psycopg without psycopg installed
        raise StoreError(f"cannot use store URL {redacted(url)}: {e} (for PostgreSQL: pip install 'asyncrl[postgres]')") from None


def _sqlite_writer_pragmas(dbapi_connection, connection_record) -> None:
    # WAL (set by `upgrade_store`) lets readers read while the controller writes; NORMAL is durable
    # across process crashes (only an OS crash may lose the last commits), the right trade for a run
    # log. Foreign keys on, as PostgreSQL always checks them, so a bad delete order fails here too.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def writer_engine(url: URL) -> Engine:
    """The engine the store's one writer uses (call `upgrade_store` first)."""
    engine = _engine(url)
    if url.get_backend_name() == "sqlite":
        event.listen(engine, "connect", _sqlite_writer_pragmas)
    return engine


def reader_engine(url: URL) -> Engine:
    """An engine that cannot write: SQLite through a read-only URI connection (so reading neither
    creates the file nor switches its journal mode), PostgreSQL in read-only transactions."""
    path = sqlite_file(url)
    if path is not None:
        if not path.is_file():
            raise StoreError(f"no trajectory store at {path}")
        uri = path.absolute().as_uri() + "?mode=ro"  # as_uri percent-encodes the path
        wal = path.with_name(path.name + "-wal")

        def connect():
            # No -wal file: no job has the store open (its last connection checkpointed and removed it), and a WAL
            # reader would create -wal and -shm beside it: `immutable` reads the file alone and writes nothing
            # (`rl ui` and `rl traj` on a finished run leave its directory byte for byte). With one, a job may be
            # writing: the shared-memory index and locks of a normal read-only connection.
            live = wal.exists()
            return sqlite3.connect(uri if live else uri + "&immutable=1", uri=True, check_same_thread=False,
                                   timeout=BUSY_TIMEOUT_S)
        return create_engine(URL.create("sqlite"), poolclass=NullPool, creator=connect)
    engine = _engine(url)
    if url.get_backend_name() == "postgresql":
        engine = engine.execution_options(postgresql_readonly=True)
    return engine


# Alembic is imported where it is used: `rl validate` and `rl traj --help` never need it.
def alembic_config(connection: Connection | None = None):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", "rl.store:migrations")
    cfg.attributes["connection"] = connection
    return cfg


@functools.cache
def _script():
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config())


def head_revision() -> str:
    """The schema revision this code reads and writes."""
    return _script().get_current_head()


def schema_state(connection: Connection) -> str:
    """The database's revision, or `unversioned-d07e8ae` / `unversioned-pre-effort` for a store
    written before versioning, or `empty` when it holds no store."""
    from alembic.migration import MigrationContext

    rev = MigrationContext.configure(connection).get_current_revision()
    if rev is not None:
        return rev
    insp = inspect(connection)
    if not insp.has_table("samples"):
        return "empty"
    return "unversioned-d07e8ae" if "effort" in {c["name"] for c in insp.get_columns("samples")} else "unversioned-pre-effort"


def check_readable(engine: Engine, where: str) -> None:
    """Raise `StoreError` unless the database holds a store at this code's revision; `where` names
    the store (a run directory or URL), also as the argument of `rl db upgrade`."""
    try:
        with engine.connect() as conn:
            state = schema_state(conn)
    except SQLAlchemyError as e:
        raise StoreError(f"cannot read the trajectory store {where}: {getattr(e, 'orig', None) or e}") from None
    head = head_revision()
    if state == head:
        return
    if state == "empty":
        raise StoreError(f"{where} is not an asyncrl trajectory store (it has no samples table)")
    if state.startswith("unversioned") or _is_known(state):
        raise StoreError(f"the trajectory store {where} has schema {state}, older than this code's {head}; "
                         f"upgrade it with: rl db upgrade {where}")
    raise StoreError(f"the trajectory store {where} has schema {state}, newer than this code's {head}; update asyncrl")


def _is_known(rev: str) -> bool:
    return any(s.revision == rev for s in _script().walk_revisions())


@contextmanager
def _file_lock(path: Path | None) -> Iterator[None]:
    if path is None:
        yield
        return
    try:  # neither the store nor its lock through a link planted at their names (configbase/files.py)
        check_replaceable(path)
        lock = open_append(path.with_name(path.name + ".lock"))  # left in place: removing it would race
    except WriteRefused as e:
        raise StoreError(str(e)) from None
    with lock as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _migration_engine(url: URL) -> Engine:
    engine = _engine(url)
    if url.get_backend_name() == "sqlite":
        # pysqlite would autocommit each DDL statement; take the transaction over so that an upgrade
        # killed half way leaves the file as it was (SQLAlchemy's documented pysqlite recipe).
        @event.listens_for(engine, "connect")
        def _no_implicit_transactions(dbapi_connection, connection_record) -> None:
            dbapi_connection.isolation_level = None

        @event.listens_for(engine, "begin")
        def _begin(conn) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
    return engine


def _use_wal(engine: Engine) -> None:
    # WAL is a property of the file, and switching to it needs the file to itself: done here, under
    # the migration lock, not in the first connection of every writer (which would race).
    raw = engine.raw_connection()
    try:
        if raw.driver_connection.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
            raw.driver_connection.execute("PRAGMA journal_mode=WAL")
    finally:
        raw.close()


def upgrade_store(url: str | URL) -> tuple[str, str]:
    """Bring the database at `url` to this code's revision (creating the store in an empty database),
    under the migration lock, in one transaction; returns (state before, state after)."""
    from alembic import command
    from alembic.migration import MigrationContext

    url = parse_url(url)
    path = sqlite_file(url)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    engine = _migration_engine(url)
    head = head_revision()
    try:
        with _file_lock(path):
            with engine.begin() as conn:
                if conn.dialect.name == "postgresql":
                    conn.execute(select(func.pg_advisory_xact_lock(MIGRATION_LOCK_KEY)))
                before = schema_state(conn)
                if not (before in ("empty", head) or before.startswith("unversioned") or _is_known(before)):
                    raise StoreError(f"the trajectory store {redacted(url)} has schema {before}, newer than this "
                                     f"code's {head}; update asyncrl")
                if before == "empty":  # a new store: the current tables at once, recorded as the head revision
                    from rl.store.schema import Base

                    Base.metadata.create_all(conn)
                    MigrationContext.configure(conn).stamp(_script(), head)
                elif before != head:
                    command.upgrade(alembic_config(conn), head)
            if path is not None:
                _use_wal(engine)
        return before, head
    except SQLAlchemyError as e:
        raise StoreError(f"cannot open or upgrade the trajectory store {redacted(url)}: {getattr(e, 'orig', None) or e}") from None
    finally:
        engine.dispose()


def peek_run_ids(url: URL) -> list[str]:
    """Run ids recorded in the database at `url`, read-only and at any schema revision (every one
    has `runs.run_id` and `samples.run_id`); [] where there is no store (yet)."""
    try:
        engine = reader_engine(url)
    except StoreError:
        return []
    try:
        with engine.connect() as conn:
            insp = inspect(conn)
            if not (insp.has_table("runs") and insp.has_table("samples")):
                return []
            runs, samples = (table(name, column("run_id")) for name in ("runs", "samples"))
            return sorted(conn.scalars(union(select(runs.c.run_id), select(samples.c.run_id))))
    except SQLAlchemyError:
        return []
    finally:
        engine.dispose()
