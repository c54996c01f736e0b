"""A run's identity, and where a run directory's store lives.

`RUN_DIR/run.json` = {"run_id": "<uuid4>", "name": ..., "created_at": <unix time>} is written
atomically the first time `rl train` opens its store in a directory and only read after that, so a
copied or renamed run directory keeps its identity (its rows in a shared database stay its own),
and two runs never share one by accident of naming.

A run directory from before run.json: its id is the one its store already holds, the directory's
name (what the old code used), or, for its own SQLite file holding exactly one run, that run (the
directory was renamed). The writer records that id in a new run.json; readers only look.

A run's store is `store.url` of its recipe.yaml when set, else `RUN_DIR/trajectories.db`.

Lineage: since the identity travels with the directory, a copy of it is the same run to the store. Every
checkpoint a job commits gets a fresh random token, appended to run.json's `checkpoint_tokens` (the newest
`LINEAGE_KEEP`) and then recorded in the store's `checkpoints` table (rl/algo/resume.py `record_lineage`). A
resume whose run.json does not hold the token of the store's newest row for the run is a copy that fell behind
(another copy checkpointed since): it is refused, or with `rl resume --new-identity` becomes a new run
(`fork_identity`: a new id in run.json, `forked_from` naming the old one). A directory moved to another node
holds the newest token and resumes; a job killed between its store writes and its next checkpoint leaves no
newer row, so its resume rolls back as ever. A copy taken at a directory's newest checkpoint cannot be told from
a move until one of the two writes another checkpoint; the other is refused at its next resume.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import yaml
from sqlalchemy.engine import URL

from configbase.files import atomic_write
from rl.store.db import DB_FILE, StoreError, parse_url, peek_run_ids, sqlite_url

RUN_FILE = "run.json"
RECIPE_FILE = "recipe.yaml"
_MAX_ID = 255
"""The store's id columns are VARCHAR(255)."""
LINEAGE_KEEP = 16
"""Checkpoint tokens run.json keeps, newest last: the store's newest row is its newest or, after a kill between
the two writes, the one before."""


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
    # atomic, never through or over a link planted at run.json (configbase/files.py): no run.json or a whole one
    atomic_write(run_dir / RUN_FILE, json.dumps(record, indent=1) + "\n")
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
    record = _read_record(run_dir)
    return None if record is None else record["run_id"]


def _read_record(run_dir: Path) -> dict | None:
    """run.json, its run id and lineage checked; None when there is none; `StoreError` when it is damaged."""
    path = Path(run_dir) / RUN_FILE
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bytes that are not UTF-8
        raise StoreError(f"{path} is not a readable run identity ({e})") from None
    run_id = record.get("run_id") if isinstance(record, dict) else None
    if not isinstance(run_id, str) or not run_id.strip() or len(run_id) > _MAX_ID:
        raise StoreError(f"{path} holds no valid run_id (a non-empty string of at most {_MAX_ID} characters)")
    tokens = record.get("checkpoint_tokens", [])
    if not isinstance(tokens, list) or not all(isinstance(t, str) and 0 < len(t) <= 64 for t in tokens):
        raise StoreError(f"{path} holds no valid checkpoint_tokens (a list of strings of at most 64 characters)")
    return record


def checkpoint_tokens(run_dir: str | Path) -> list[str]:
    """The lineage tokens of the checkpoints this run directory's jobs wrote, newest last ([] before any)."""
    record = _read_record(Path(run_dir))
    return [] if record is None else list(record.get("checkpoint_tokens", []))


def add_checkpoint_token(run_dir: str | Path, token: str) -> None:
    """Append a committed checkpoint's lineage token to run.json (atomically; the newest `LINEAGE_KEEP` kept)."""
    run_dir = Path(run_dir)
    record = _read_record(run_dir)
    if record is None:
        raise StoreError(f"{run_dir / RUN_FILE} is missing: a checkpoint's lineage has no run identity to join")
    record["checkpoint_tokens"] = [*record.get("checkpoint_tokens", []), token][-LINEAGE_KEEP:]
    atomic_write(run_dir / RUN_FILE, json.dumps(record, indent=1) + "\n")


def fork_identity(run_dir: str | Path, run_id: str, train_step: int) -> None:
    """Give the run directory the new identity `run_id` (its rows already copied into the store by
    `TrajectoryStore.fork`): run.json names the run it was copied from and the train step of the fork, and starts
    a lineage of its own."""
    run_dir = Path(run_dir)
    old = _read_record(run_dir) or {}
    record = {"run_id": run_id, "name": old.get("name", run_dir.name), "created_at": time.time(),
              "forked_from": {"run_id": old.get("run_id"), "train_step": int(train_step)}, "checkpoint_tokens": []}
    atomic_write(run_dir / RUN_FILE, json.dumps(record, indent=1) + "\n")


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
