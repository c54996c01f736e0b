"""A run's identity, and where a run directory's store lives.

`RUN_DIR/run.json` = {"run_id": "<uuid4>", "name": ..., "created_at": <unix time>} is written
atomically the first time `rl train` opens its store in a directory and only read after that, so a
copied or renamed run directory keeps its identity (its rows in a shared database stay its own),
and two runs never share one by accident of naming.

A run directory from before run.json: its id is the one its store already holds, the directory's
name (what the old code used), or, for its own SQLite file holding exactly one run, that run (the
directory was renamed). The writer records that id in a new run.json; readers only look.

A run's store is `store.url` of its recipe.yaml when set, else `RUN_DIR/trajectories.db`.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import yaml
from sqlalchemy.engine import URL

from rl.store.db import DB_FILE, StoreError, parse_url, peek_run_ids, sqlite_url

RUN_FILE = "run.json"
RECIPE_FILE = "recipe.yaml"
_MAX_ID = 255
"""The store's id columns are VARCHAR(255)."""


def run_identity(run_dir: str | Path, name: str | None = None, store: URL | None = None) -> str:
    """The run's id for the job that writes it (`rl train`, `rl resume`): read from run.json, or, the
    first time, adopted from an older run's store or a new UUID, and written to run.json. `store` is
    the run's store when it is not the directory's own file."""
    run_dir = Path(run_dir)
    found = read_run_file(run_dir)
    if found is not None:
        return found
    run_id = None
    if (run_dir / RECIPE_FILE).is_file():  # an older job ran here: keep the id that its store used
        run_id = legacy_run_id(run_dir, peek_run_ids(store or own_store_url(run_dir)), own_store=store is None)
    run_id = run_id or str(uuid.uuid4())
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"run_id": run_id, "name": name or run_dir.name, "created_at": time.time()}
    path = run_dir / RUN_FILE
    tmp = run_dir / f".{RUN_FILE}.{os.getpid()}.tmp"
    with tmp.open("w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic: a reader sees no run.json or a whole one
    return run_id


def read_run_identity(run_dir: str | Path, run_ids: Sequence[str], own_store: bool) -> str:
    """The run's id for a reader (never writes): run.json's, or for an older run directory the id its
    store holds (`run_ids`: the store's runs; `own_store`: the store is the directory's own file)."""
    run_dir = Path(run_dir)
    found = read_run_file(run_dir)
    if found is not None:
        return found
    legacy = legacy_run_id(run_dir, run_ids, own_store)
    if legacy is not None:
        return legacy
    if run_ids:
        raise StoreError(f"{run_dir} has no {RUN_FILE} and its store holds {len(run_ids)} other runs "
                         f"({', '.join(run_ids[:3])}{', ...' if len(run_ids) > 3 else ''})")
    return run_dir.resolve().name  # an empty store: nothing to show under any id


def legacy_run_id(run_dir: Path, run_ids: Sequence[str], own_store: bool) -> str | None:
    name = run_dir.resolve().name
    if name in run_ids:
        return name
    if own_store and len(run_ids) == 1:
        return run_ids[0]
    return None


def read_run_file(run_dir: Path) -> str | None:
    """run.json's run id; None when there is no run.json; `StoreError` when it is damaged."""
    path = run_dir / RUN_FILE
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bytes that are not UTF-8
        raise StoreError(f"{path} is not a readable run identity ({e})") from None
    run_id = record.get("run_id") if isinstance(record, dict) else None
    if not isinstance(run_id, str) or not run_id.strip() or len(run_id) > _MAX_ID:
        raise StoreError(f"{path} holds no valid run_id (a non-empty string of at most {_MAX_ID} characters)")
    return run_id


def own_store_url(run_dir: str | Path) -> URL:
    return sqlite_url(Path(run_dir) / DB_FILE)


def run_store_url(run_dir: str | Path) -> tuple[URL, bool]:
    """The run's store URL and whether it is the directory's own SQLite file."""
    run_dir = Path(run_dir)
    path = run_dir / RECIPE_FILE
    try:
        recipe = yaml.safe_load(path.read_text()) if path.is_file() else None
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise StoreError(f"cannot read {path} for its store.url ({e})") from None
    store = recipe.get("store") if isinstance(recipe, dict) else None
    url = store.get("url") if isinstance(store, dict) else None
    return (parse_url(url), False) if url else (own_store_url(run_dir), True)
