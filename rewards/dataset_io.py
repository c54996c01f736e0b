"""Reading the rows of a user's dataset file, with every problem as one `DatasetError` line naming the
file, the row and the field. Pure Python: JSONL needs nothing; Parquet needs pyarrow and `hf_disk` (a
directory written by `datasets.Dataset.save_to_disk`) the `datasets` package, both imported only when a
recipe names such a file (`pip install -e ".[data]"`).

Row numbers count from 1. In a JSONL file the row number is the line number (blank lines are skipped, so
an editor's line N is row N); in Parquet and `hf_disk` it is the row's position. Rows are plain dicts of
JSON values (`json_safe` converts what Arrow gives besides: bytes, dates, decimals).
"""

from __future__ import annotations

import base64
import datetime
import decimal
import importlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

FileKind = Literal["jsonl", "parquet", "hf_disk"]

_EXTRA_HINT = 'pip install -e ".[data]"'
_BATCH_ROWS = 1024
"""Rows per read from a columnar file (memory stays bounded however large the file)."""


class DatasetError(ValueError):
    """A dataset file that cannot be used; `str(err)` is one line: `<file>: row <n>: field '<f>': <what>`.

    A ValueError, so that raised inside a recipe validator it becomes the recipe's one-line error (with the
    dataset's YAML line, rl/recipe_io.py); `rl train` prints it and exits 2 when the job's scan raises it."""

    def __init__(self, path: str | Path, message: str, *, row: int | None = None, field: str | None = None):
        self.path, self.row, self.field = str(path), row, field
        parts = [self.path, *([f"row {row}"] if row is not None else []), *([f"field {field!r}"] if field else []),
                 " ".join(message.split())]
        super().__init__(": ".join(parts))


def check_exists(kind: FileKind, path: Path) -> None:
    """The file (JSONL, Parquet) or directory (`hf_disk`) is there."""
    want_dir = kind == "hf_disk"
    if not path.exists():
        raise DatasetError(path, f"{'directory' if want_dir else 'file'} not found")
    if want_dir and not path.is_dir():
        raise DatasetError(path, "is not a directory (an hf_disk dataset is the directory save_to_disk wrote)")
    if not want_dir and not path.is_file():
        raise DatasetError(path, f"is not a file (a {kind} dataset is one file)")


def iter_rows(kind: FileKind, path: Path, *, limit: int | None = None, split: str | None = None) -> Iterator[tuple[int, dict]]:
    """(row number, row) for the first `limit` rows (all when None) of a dataset file; raises DatasetError on a
    missing file, an unreadable or malformed row, or a file with no rows at all."""
    check_exists(kind, path)
    if kind == "hf_disk":
        rows = _hf_disk_rows(path, limit, split)
    else:
        if split is not None:
            raise DatasetError(path, f"`split` applies to hf_disk datasets only, not to {kind} files")
        rows = _jsonl_rows(path, limit) if kind == "jsonl" else _parquet_rows(path, limit)
    empty = True
    for n, row in rows:
        empty = False
        yield n, row
    if empty:
        raise DatasetError(path, "no rows (empty file)" if kind == "jsonl" else "no rows")


def _jsonl_rows(path: Path, limit: int | None) -> Iterator[tuple[int, dict]]:
    count = 0
    with open(path, "rb") as f:  # bytes: a bad byte is reported with its line, not as the whole file's failure
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(path, f"not UTF-8 text ({e.reason} at byte {e.start})", row=lineno) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip())  # without the newline, an unfinished object's column is on its own line
            except json.JSONDecodeError as e:
                raise DatasetError(path, f"not valid JSON ({e.msg} at column {e.colno})", row=lineno) from None
            if not isinstance(row, dict):
                raise DatasetError(path, f"not a JSON object (a JSON {type(row).__name__})", row=lineno)
            yield lineno, row
            count += 1
            if limit is not None and count >= limit:
                return


def _optional(module: str, package: str, kind: str, path: Path) -> Any:
    """Import an optional extra, or one line saying which package to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DatasetError(path, f"reading a `type: {kind}` dataset needs the {package} package: pip install {package} "
                                 f"(or {_EXTRA_HINT})") from None


def _parquet_rows(path: Path, limit: int | None) -> Iterator[tuple[int, dict]]:
    pq = _optional("pyarrow.parquet", "pyarrow", "parquet", path)
    try:
        pf = pq.ParquetFile(path)
        batches = pf.iter_batches(batch_size=min(limit or _BATCH_ROWS, _BATCH_ROWS))
        n = 0
        for batch in batches:
            for row in batch.to_pylist():
                n += 1
                yield n, {k: json_safe(v) for k, v in row.items()}
                if limit is not None and n >= limit:
                    return
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
        if isinstance(e, DatasetError):
            raise
        raise DatasetError(path, f"cannot read as Parquet ({type(e).__name__}: {e})") from None


def _hf_disk_rows(path: Path, limit: int | None, split: str | None) -> Iterator[tuple[int, dict]]:
    datasets = _optional("datasets", "datasets", "hf_disk", path)
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as e:  # FileNotFoundError for a directory save_to_disk did not write
        raise DatasetError(path, f"cannot load with datasets.load_from_disk ({type(e).__name__}: {e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split is None:
            raise DatasetError(path, f"holds the splits {sorted(ds)}: name one with `split:`")
        if split not in ds:
            raise DatasetError(path, f"has no split {split!r} (its splits: {sorted(ds)})")
        ds = ds[split]
    elif split is not None:
        raise DatasetError(path, f"is a single dataset without splits; remove `split: {split}`")
    total = len(ds) if limit is None else min(limit, len(ds))
    for start in range(0, total, _BATCH_ROWS):
        columns = ds[start:min(start + _BATCH_ROWS, total)]  # a dict of equal-length columns
        names = list(columns)
        for i, values in enumerate(zip(*(columns[c] for c in names))):
            yield start + i + 1, {c: json_safe(v) for c, v in zip(names, values)}


def json_safe(value: Any) -> Any:
    """A JSON value for what Arrow readers return (rows travel in checkpoints as JSON): bytes as base64 text,
    dates and decimals as text; other values unchanged."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, (decimal.Decimal, datetime.timedelta)):
        return str(value)
    return value
