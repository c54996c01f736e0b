"""What the web dashboard shows (issue #45), read from run directories and never written: each run's recipe, identity
and `metrics.jsonl`, and its trajectory store through a read-only engine (rl/store/db.py `reader_engine`: SQLite
opened `mode=ro`, PostgreSQL in read-only transactions), one short transaction a request, so a live job's writer is
never held up behind a long read.

Every value goes out as JSON data; the page puts it into the document as text (rl/ui/static/app.js), never as markup.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

from rl.checkpoint.run_dir import LOCK_FILE
from rl.store.identity import RECIPE_FILE, RUN_FILE

METRICS_FILE = "metrics.jsonl"
CURVE_POINTS = 2000
"""Points a curve is downsampled to (min and max of each bucket kept, so a spike is never averaged away)."""
PAGE_MAX = 200
SORTS = {"seq": "seq", "reward": "reward", "step": "train_step", "length": "num_response_tokens", "lag": "lag"}
FILTERS = ("dataset", "step", "min_reward", "max_reward", "finish_reason", "failure", "effort", "teacher", "status",
           "correct", "min_lag")


class UIError(ValueError):
    """A request the data cannot answer (unknown run, bad filter): one line, sent back as a 400."""


def _holder(run_dir: Path) -> str | None:
    """"pid N on HOST since T" when a live process on this host holds the run's lock (read from the lock file, no
    lock taken: a shared flock, even brief, would make a starting `rl resume` refuse); None otherwise."""
    try:
        text = (run_dir / LOCK_FILE).read_text(errors="replace").strip()
    except OSError:
        return None
    parts = text.split()
    if len(parts) >= 4 and parts[0] == "pid" and parts[1].isdigit() and parts[3] == socket.gethostname():
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return text
    return None


@dataclass
class RunSource:
    """One run directory: its name, recipe, metrics rows (read again when the file grows) and store."""

    run_dir: Path
    key: str
    _rows: list[dict] = field(default_factory=list)
    _lines: list[bytes] = field(default_factory=list)
    _skipped: int = 0
    _offset: int = 0
    _store: object = None
    _tokenizer: object = None

    @property
    def name(self) -> str:
        try:
            return json.loads((self.run_dir / RUN_FILE).read_text()).get("name") or self.run_dir.name
        except (OSError, ValueError, AttributeError):
            return self.run_dir.name

    def recipe_text(self) -> str:
        try:
            return (self.run_dir / RECIPE_FILE).read_text()
        except OSError:
            return ""

    def lines(self) -> list[bytes]:
        """metrics.jsonl's complete lines; only the bytes appended since the last call are read (a live job's file
        grows; a line it is still writing waits for the next call)."""
        path = self.run_dir / METRICS_FILE
        try:
            with path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return self._lines
        end = data.rfind(b"\n") + 1
        self._lines.extend(line for line in data[:end].splitlines() if line.strip())
        self._offset += end
        return self._lines

    def rows(self) -> list[dict]:
        """metrics.jsonl's rows (dicts; a line that does not parse is skipped), parsed once each."""
        lines = self.lines()
        self._rows.extend(r for r in map(_parse, lines[len(self._rows) + self._skipped:]) if r is not None)
        self._skipped = len(lines) - len(self._rows)
        return self._rows

    def tokenizer(self):
        """The run's tokenizer from its recipe, or None when it cannot be built here (a checkpoint not on this host)."""
        if self._tokenizer is None:
            try:
                import yaml

                from rl.config import Recipe

                self._tokenizer = Recipe.model_validate(yaml.safe_load(self.recipe_text())).tokenizer.build()
            except Exception:
                self._tokenizer = False
        return self._tokenizer or None

    @property
    def where(self) -> str:
        return str(self.run_dir)

    def holder(self) -> str | None:
        return _holder(self.run_dir)

    def store(self):
        if self._store is None:
            from rl.store.trajectories import TrajectoryStore

            self._store = TrajectoryStore.read_run(self.run_dir)
        return self._store

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def summary(self) -> dict:
        rows = self.rows()
        steps = [r["step"] for r in rows if isinstance(r.get("step"), int | float)]
        evals = [r for r in rows if isinstance(r.get("eval/accuracy"), int | float)]
        stages = []
        try:
            import yaml

            recipe = yaml.safe_load(self.recipe_text()) or {}
            stages = [str(s.get("type", "?")) for s in recipe.get("stages", []) if isinstance(s, dict)]
        except Exception:  # a recipe that does not parse still lists the run
            recipe = {}
        holder = self.holder()
        return {"key": self.key, "name": self.name, "dir": self.where, "stages": stages,
                "status": "running" if holder else "stopped", "holder": holder, "steps": max(steps, default=0),
                "heldout": evals[-1]["eval/accuracy"] if evals else None,
                "heldout_step": evals[-1].get("step") if evals else None}


@dataclass
class StoreRunSource(RunSource):
    """One run of a trajectory store given by URL (`rl ui sqlite:///PATH` or `postgresql://...`), without its run
    directory: the name and recipe from the store's `runs` row, the curves from the metrics each RL train step
    recorded in `train_steps` (SFT steps are not recorded there), the samples as for a directory. Whether a job
    runs is not known from the store alone."""

    url: object = None
    run_id: str = ""
    _last_step: int = -1
    _run: tuple | None = None

    @property
    def name(self) -> str:
        return self._run_row()[0] or self.run_id

    @property
    def where(self) -> str:
        from rl.store.db import redacted

        return f"{redacted(self.url)} run {self.run_id}"

    def holder(self) -> str | None:
        return None

    def _run_row(self) -> tuple[str | None, str | None]:
        """(name, recipe JSON) of the run's `runs` row, read once (a job writes it as it starts)."""
        if self._run is None:
            from sqlalchemy import select

            from rl.store.schema import RunTable

            row = self.store().read(lambda s: s.execute(select(RunTable.name, RunTable.recipe_json)
                                                        .where(RunTable.run_id == self.run_id)).first())
            if row is None:
                return (None, None)  # not written yet: asked again next time
            self._run = (row[0], row[1])
        return self._run

    def recipe_text(self) -> str:
        import yaml

        try:
            return yaml.safe_dump(json.loads(self._run_row()[1] or "{}"), sort_keys=False)
        except ValueError:
            return ""

    def lines(self) -> list[bytes]:
        """The train steps recorded since the last call, as metrics.jsonl's lines (step, time, the step's metrics)."""
        from sqlalchemy import select

        from rl.store.schema import TrainStepTable as t

        new = self.store().read(lambda s: list(s.execute(
            select(t.step, t.created_at, t.metrics_json).where(t.run_id == self.run_id, t.step > self._last_step)
            .order_by(t.step))))
        for step, created, metrics in new:
            try:
                row = {**json.loads(metrics), "step": step, "time": created}
            except ValueError:
                continue
            self._lines.append(json.dumps(row).encode())
            self._last_step = step
        return self._lines

    def store(self):
        if self._store is None:
            from rl.store.trajectories import TrajectoryStore

            self._store = TrajectoryStore(self.url, self.run_id, readonly=True)
        return self._store


def _is_url(source: str) -> bool:
    return "://" in str(source)


NUMBER = rb"-?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|Infinity|NaN)"
STEP = re.compile(rb'"step"\s*:\s*(' + NUMBER + rb")")


def _num(b: bytes) -> int | float:
    x = float(b)
    return int(x) if x.is_integer() else x


def _parse(line: bytes) -> dict | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


class Dashboard:
    """The runs the server was started with, by key (their position, as a string)."""

    def __init__(self, sources: list[str | Path]):
        """`sources`: run directories, or store URLs (every run of the store)."""
        self.runs: dict[str, RunSource] = {}
        for d in sources:
            if _is_url(d):
                url = _parse_store_url(str(d))
                for run_id in _store_runs(url):
                    key = str(len(self.runs))
                    self.runs[key] = StoreRunSource(Path(), key, url=url, run_id=run_id)
                continue
            path = Path(d)
            if not path.is_dir():
                raise UIError(f"{path}: not a run directory")
            key = str(len(self.runs))
            self.runs[key] = RunSource(path.resolve(), key)

    def run(self, key: str) -> RunSource:
        if key not in self.runs:
            raise UIError(f"no run {key!r}")
        return self.runs[key]

    # -- pages ------------------------------------------------------------------------------------------------
    def runs_page(self) -> dict:
        return {"runs": [r.summary() for r in self.runs.values()]}

    def run_page(self, key: str) -> dict:
        r = self.run(key)
        return {**r.summary(), "recipe": r.recipe_text(), "config_versions": self._config_versions(r)}

    def _config_versions(self, r: RunSource) -> list[dict]:
        try:
            return [{k: v for k, v in c.items() if k in ("version", "status", "train_step", "reason", "patch")}
                    for c in r.store().config_versions()]
        except Exception:  # no store yet (a run that has not started writing): no versions to mark
            return []

    def timeline(self, key: str, points: int = CURVE_POINTS) -> dict:
        """The dispatch timeline: each train step's wall time (minutes from the run's first row, downsampled), the
        config versions (applied and refused patches, at their train steps) and the restarts (resumes) of the run."""
        r = self.run(key)
        rows = [(row["step"], row["time"]) for row in r.rows()
                if isinstance(row.get("step"), int | float) and isinstance(row.get("time"), int | float)
                and "eval/accuracy" not in row]
        t0 = rows[0][1] if rows else 0.0
        stride = max(1, math.ceil(len(rows) / points))
        kept = rows[::stride] + (rows[-1:] if rows and (len(rows) - 1) % stride else [])
        try:
            restarts = r.store().restarts()
        except Exception:  # no store yet
            restarts = []
        return {"run": key, "minutes": [(t - t0) / 60 for _, t in kept], "steps": [s for s, _ in kept],
                "config_versions": self._config_versions(r), "restarts": restarts}

    def keys(self, key: str) -> list[str]:
        """The numeric series a run's metrics hold."""
        seen: dict[str, None] = {}
        for row in self.run(key).rows():
            for k, v in row.items():
                if k not in ("step", "time") and isinstance(v, int | float) and not isinstance(v, bool):
                    seen.setdefault(k)
        return sorted(seen)

    def curve(self, key: str, metric: str, points: int = CURVE_POINTS) -> dict:
        """(steps, values) of one metric, downsampled to about `points` by keeping each bucket's min and max."""
        xs, ys = [], []
        name = json.dumps(metric).encode()
        value = re.compile(re.escape(name) + rb"\s*:\s*(" + NUMBER + rb")")
        for line in self.run(key).lines():  # two regex searches a line: a JSON parse of 100K lines costs ~0.5 s
            if name not in line:
                continue
            v, s = value.search(line), STEP.search(line)
            if v is None or s is None:
                continue
            y = float(v.group(1))
            if math.isfinite(y):
                xs.append(_num(s.group(1)))
                ys.append(y)
        n = len(xs)
        if n > points:
            bucket = math.ceil(n / (points // 2))
            keep: list[int] = []
            for a in range(0, n, bucket):
                idx = range(a, min(a + bucket, n))
                lo, hi = min(idx, key=ys.__getitem__), max(idx, key=ys.__getitem__)
                keep.extend(sorted({lo, hi}))
            xs, ys = [xs[i] for i in keep], [ys[i] for i in keep]
        return {"run": key, "metric": metric, "x": xs, "y": ys, "points": n}

    def samples(self, key: str, params: dict[str, str]) -> dict:
        """One page of the run's samples: filters (`FILTERS`), `sort` (`SORTS`, `-` first for descending), `offset`,
        `limit` (at most `PAGE_MAX`).

        Two reads in one transaction. The page's write positions (`seq`) come from a walk of a covering index
        (rl/store/schema.py `BROWSE_INDEXES`: run_id, key, seq and every filter column; the sort key's, or one whose
        key an equality filter fixes), which orders the page and answers every filter without reading a row of the
        table or sorting the matches (tests/unit/test_ui.py checks SQLite's plan for every filter and sort); then the
        page's rows, by (run_id, seq)."""
        from sqlalchemy import func, select

        from rl.store.schema import SampleTable as t

        store = self.run(key).store()
        lag = t.max_version - t.min_version
        conds = {
            "dataset": lambda v: t.dataset == v, "finish_reason": lambda v: t.finish_reason == v,
            "failure": lambda v: t.failure == v, "teacher": lambda v: t.teacher == v,
            "status": lambda v: t.status == v, "step": lambda v: t.train_step == _int(v, "step"),
            "effort": lambda v: t.effort == _int(v, "effort"),
            "min_reward": lambda v: t.reward >= _float(v, "min_reward"),
            "max_reward": lambda v: t.reward <= _float(v, "max_reward"),
            "correct": lambda v: t.correct == (v in ("1", "true", "yes")),
            "min_lag": lambda v: lag >= _int(v, "min_lag"),
        }
        unknown = sorted(set(params) - set(conds) - {"run", "sort", "offset", "limit"})
        if unknown:  # a misspelt filter would otherwise show every sample as if filtered
            raise UIError(f"unknown filter {unknown[0]!r}: expected one of {', '.join(FILTERS)}")
        sort = params.get("sort") or "seq"
        column = SORTS.get(sort.lstrip("-"))
        if column is None:
            raise UIError(f"sort {sort!r}: expected one of {', '.join(SORTS)} (a leading - for descending)")
        offset, limit = _int(params.get("offset") or "0", "offset"), _int(params.get("limit") or "50", "limit")
        if offset < 0 or not 0 < limit <= PAGE_MAX:
            raise UIError(f"offset {offset}, limit {limit}: expected offset >= 0 and 0 < limit <= {PAGE_MAX}")
        desc = sort.startswith("-")
        order = [t.seq] if column == "seq" else [lag if column == "lag" else getattr(t, column), t.seq]
        page = (select(t.seq).where(t.run_id == store.run_id,
                                    *(cond(params[n]) for n, cond in conds.items() if params.get(n) not in (None, "")))
                .order_by(*(o.desc() if desc else o for o in order)).offset(offset).limit(limit))
        names = ("sample_id", "dataset", "step", "reward", "correct", "finish_reason", "failure", "effort", "teacher",
                 "status", "tokens", "min_version", "max_version", "lag", "preview")

        def read(session) -> list:
            seqs = list(session.scalars(page))
            got = {r[0]: r[1:] for r in session.execute(
                select(t.seq, t.sample_id, t.dataset, t.train_step, t.reward, t.correct, t.finish_reason, t.failure,
                       t.effort, t.teacher, t.status, t.num_response_tokens, t.min_version, t.max_version, lag,
                       func.substr(t.response_text, 1, 120))
                .where(t.run_id == store.run_id, t.seq.in_(seqs)))} if seqs else {}
            return [dict(zip(names, got[q])) for q in seqs if q in got]

        return {"run": key, "offset": offset, "limit": limit, "sort": sort, "rows": store.read(read)}

    def sample(self, key: str, sample_id: str) -> dict:
        """One sample: prompt, response as tokens (text piece, behaviour log-prob, policy version, trained or not),
        segments, tool turns, verdict, teacher, config version."""
        store = self.run(key).store()
        sample = store.get_sample(sample_id)
        if sample is None:
            raise UIError(f"no sample {sample_id!r} in run {key}")
        pieces = self._pieces(key, sample.response_tokens, sample.response_text)
        mask = sample.loss_mask_T()
        train_step = store.sample_train_step(sample_id)
        stale, stale_note = self._stale(key, train_step, sample.policy_versions_T, mask)
        tokens = [{"id": t, "text": p, "logprob": lp, "version": v, "trained": bool(m), "stale": st}
                  for t, p, lp, v, m, st in zip(sample.response_tokens, pieces, sample.behavior_logprobs_T,
                                                sample.policy_versions_T, mask, stale)]
        return {
            "run": key, "sample_id": sample.sample_id, "prompt_id": sample.prompt_id, "dataset": sample.dataset,
            "status": sample.status, "finish_reason": sample.finish_reason, "failure": sample.failure,
            "reward": sample.reward, "correct": sample.correct, "reason": sample.reason,
            "train_step": train_step, "stale_note": stale_note, "config_version": sample.config_version,
            "effort": sample.effort, "teacher": sample.teacher, "prompt": sample.prompt_text,
            "response": sample.response_text, "tokens": tokens,
            "segments": [list(s) for s in store.segments(sample_id)],
            "turns": [{"kind": t.kind, "start": t.start, "end": t.end, "text": t.text, "tool": t.tool, "call": t.call,
                       "status": t.status, "exit_code": t.exit_code} for t in sample.turns],
        }

    def _stale(self, key: str, train_step: int | None, versions, mask) -> tuple[list, str]:
        """Each token's staleness mask as the train step applied it (rl/train/losses.py `staleness_keep`: stale when
        the trained weights' version - the token's version > max_staleness, every token when the sample's stale share
        exceeded max_sample_stale_frac), and a note. The step trained the weights of version train_step - 1
        (rl/algo/async_grpo.py marks samples with the version the step made). None a token where it cannot be told:
        the sample untrained, or the recipe's RL stages differing in their bounds (a step's stage is not recorded)."""
        unknown = [None] * len(versions)
        if train_step is None:
            return unknown, "not trained"
        try:
            import yaml

            stages = (yaml.safe_load(self.run(key).recipe_text()) or {}).get("stages") or []
            rules = {(s.get("max_staleness"), s.get("max_sample_stale_frac")) for s in stages
                     if isinstance(s, dict) and s.get("type") in ("grpo", "opd")}
        except Exception:  # a recipe that does not parse: nothing to tell
            return unknown, "the run's recipe does not parse"
        if len(rules) != 1:
            return unknown, "the RL stages differ in max_staleness: not shown"
        (bound, frac), = rules
        if bound is None:
            return [False] * len(versions), "no staleness bound in this run"
        current = train_step - 1
        stale = [bool(m) and current - v > bound for v, m in zip(versions, mask)]
        trained = sum(map(bool, mask))
        if frac is not None and trained and sum(stale) / trained > frac:
            return [bool(m) for m in mask], f"dropped whole: stale share {sum(stale) / trained:.2f} > {frac}"
        return stale, f"{sum(stale)} of {trained} trained tokens stale (weights v{current}, max_staleness {bound})"

    def _pieces(self, key: str, tokens: tuple[int, ...], text: str) -> list[str]:
        """Each response token's text, decoded alone by the run's own tokenizer (its recipe's); when that cannot be
        built here (its checkpoint is on another host): the stored text's characters if there is one token a
        character (the char tokenizer, plus an end token), else the ids."""
        tok = self.run(key).tokenizer()
        if tok is not None:
            try:
                return [tok.decode([t]) for t in tokens]
            except Exception:  # an id the tokenizer does not know: the fallback below
                pass
        if len(tokens) - len(text) in (0, 1):
            return list(text) + [f"#{t}" for t in tokens[len(text):]]
        return [f"#{t}" for t in tokens]

    def warm(self, lock=None) -> float:
        """Read each run's browse indexes once (SQLite stores; `rl ui` does it in the background as it starts): a
        store written by a job has its index pages spread through the file among the token arrays, so the first walk
        of each index from disk takes ~1 s at 1M samples, later ones ~0.1 s from the page cache (BENCHMARKS.md,
        issue 45). `lock`: the server's, held a walk at a time (requests go between). Returns the seconds it took; a
        run it cannot read is skipped (its pages say why)."""
        import contextlib
        import time

        from sqlalchemy import text

        from rl.store.db import sqlite_file
        from rl.store.schema import BROWSE_INDEXES, LAG_INDEX

        t0 = time.perf_counter()
        held = lock if lock is not None else contextlib.nullcontext()
        for r in list(self.runs.values()):
            for ix in (*BROWSE_INDEXES, LAG_INDEX):
                try:
                    with held:
                        store = r.store()
                        if sqlite_file(store.url) is None:
                            break  # PostgreSQL keeps its own buffers, on its own host
                        store.read(lambda s, ix=ix: s.execute(
                            text(f"SELECT count(*) FROM samples INDEXED BY {ix} WHERE run_id = :r"), {"r": store.run_id}))
                except Exception:
                    break
        return time.perf_counter() - t0

    def close(self) -> None:
        for r in self.runs.values():
            r.close()


def _int(v: str, name: str) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        raise UIError(f"{name}={v!r}: expected an integer") from None


def _float(v: str, name: str) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise UIError(f"{name}={v!r}: expected a number") from None
    if not math.isfinite(x):
        raise UIError(f"{name}={v!r}: expected a finite number")
    return x


def _parse_store_url(url: str):
    from rl.store.db import StoreError, parse_url

    try:
        return parse_url(url)
    except StoreError as e:
        raise UIError(str(e)) from None


def _store_runs(parsed) -> list[str]:
    """The run ids of the store at URL `parsed`, read-only; UIError (one line) when it cannot be read or holds no
    run."""
    from rl.store.db import StoreError, redacted
    from rl.store.trajectories import TrajectoryStore

    try:
        store = TrajectoryStore(parsed, "", readonly=True)
    except StoreError as e:
        raise UIError(str(e)) from None
    try:
        ids = store.run_ids()
    finally:
        store.close()
    if not ids:
        raise UIError(f"{redacted(parsed)}: no run in this store")
    return ids

