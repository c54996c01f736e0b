"""`rl db upgrade RUN_DIR | DB_FILE | URL`: bring a trajectory store to this code's schema by hand.

The writing job does the same when it starts; readers (`rl traj`) never do, and name this command
when they find an older store. RUN_DIR means the run's store (its recipe's `store.url`, else
RUN_DIR/trajectories.db). Prints one line, `<store>: <before> -> <after>`; errors are one line and
exit code 2. Upgrading is one transaction under the migration lock (rl/store/db.py), so it is safe
while other jobs use the same database, and a failed upgrade changes nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXIT_BAD_INPUT = 2


def add_db_parser(subparsers) -> None:
    db = subparsers.add_parser("db", help="trajectory store maintenance")
    sub = db.add_subparsers(dest="db_command", metavar="{upgrade}", required=True)
    p = sub.add_parser("upgrade", help="migrate a store to this code's schema (the writing job does it on start)")
    p.add_argument("target", help="run directory, SQLite file, or SQLAlchemy URL of a shared database")
    p.set_defaults(func=cmd_upgrade)


def cmd_upgrade(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import SQLAlchemyError  # past argument parsing: `rl --help` stays light

    from rl.store.identity import run_store_url
    from rl.store.db import StoreError, parse_url, reader_engine, redacted, schema_state, sqlite_url, upgrade_store

    try:
        target = Path(args.target)
        if target.is_dir():
            url, _ = run_store_url(target)
        elif target.is_file():
            url = sqlite_url(target)
        elif "://" in args.target:
            url = parse_url(args.target)
        else:
            raise StoreError(f"not a run directory, database file or SQLAlchemy URL: {args.target}")
        name = redacted(url)
        engine = reader_engine(url)  # a missing SQLite file is refused here, never created
        try:
            with engine.connect() as conn:
                state = schema_state(conn)
        except SQLAlchemyError as e:
            raise StoreError(f"cannot read {name}: {getattr(e, 'orig', None) or e}") from None
        finally:
            engine.dispose()
        if state == "empty":  # jobs create their own store when they start; this only upgrades one
            raise StoreError(f"{name} holds no trajectory store; nothing to upgrade")
        before, after = upgrade_store(url)
    except StoreError as e:
        print(f"rl db: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"{name}: {before} -> {after}" if before != after else f"{name}: already at {after}")
    return 0
