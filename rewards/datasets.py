"""Datasets from files: `type: jsonl | parquet | hf_disk` in a recipe, one row per problem.

    datasets:
      - type: jsonl
        name: wp
        path: configs/data/word_problems_train.jsonl
        prompt: question          # the field holding the prompt text (or `messages: <field>`, chat messages)
        chat: true                # the text becomes one user message, rendered by the chat template
        system: "Solve the problem. End with: The answer is N."
        answer: answer            # the field holding the reference answer (text or a number)
        demonstration: solution   # SFT target (default: the answer)
        verifier: math            # exact | math | regex | python:pkg.module:fn (rewards/verifiers.py)
        heldout: {path: configs/data/word_problems_test.jsonl}   # or {fraction: 0.1, seed: 0}

Rows. A row is an object (JSONL) or a table row (Parquet, `hf_disk`) holding the named fields; other fields
are kept for `python:` verifiers (they receive the whole row). `prompt`: a non-empty string. `messages`: a
non-empty list of {role: system | user | assistant, content: string} ending with a user message. `answer`:
a non-empty string or a number. `demonstration`: a non-empty string.

Checks. `rl validate` (recipe load) checks that each file exists and that its first `PREVIEW_ROWS` rows
fit (instant); the job calls `scan()` before any worker starts, which reads every row (and, with a math
verifier, parses every answer) and raises one `DatasetError` line for the first bad row.

Splits. `heldout: {fraction, seed}` holds out round(fraction x distinct prompts) prompts (at least one),
chosen by a seeded hash of the prompt, with every row that repeats them; `heldout: {path}` reads the
held-out rows from another file (same fields), and train rows whose prompt appears there are left out.
Either way no held-out prompt is ever in the train stream, and the split depends only on the files and
the seed. The train stream is shuffled epochs over the train rows, reproducible per (seed, seed_offset).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from configbase import StrictConfig
from rewards.dataset_io import DatasetError, iter_rows
from rewards.task import Message, Problem, Task, Trajectory, Verdict, VerifyContext
from rewards.verifiers import MathVerifierConfig, PythonVerifierConfig, RegexVerifierConfig, VerifierConfig, \
    parse_reference, verifier_shorthand

PREVIEW_ROWS = 5
"""Rows of each file that `rl validate` checks (the job's scan checks them all)."""
_ROLES = ("system", "user", "assistant")


class HeldoutConfig(StrictConfig):
    """The held-out split: a fraction of the file's prompts, or another file."""

    fraction: float | None = Field(None, gt=0, lt=1)
    """Hold out this share of the distinct prompts (default 0.1 when no `path` is given)."""
    seed: int = 0
    """With `fraction`: seed of the hash that picks the held-out prompts."""
    path: Path | None = None
    """Read the held-out rows from this file (same type and fields as the dataset)."""
    split: str | None = None
    """hf_disk only: the split of a DatasetDict directory to hold out (`path` defaults to the dataset's)."""

    @model_validator(mode="before")
    @classmethod
    def _default_fraction(cls, data: Any) -> Any:
        if isinstance(data, dict) and all(data.get(k) is None for k in ("fraction", "path", "split")):
            return {**data, "fraction": 0.1}
        return data

    @model_validator(mode="after")
    def _one_source(self) -> "HeldoutConfig":
        if self.fraction is not None and (self.path is not None or self.split is not None):
            raise ValueError("give either fraction (a share of the file) or path/split (another file), not both")
        return self


class _FileDatasetConfig(StrictConfig):
    """Fields every file dataset shares (not a recipe type itself: it has no discriminator)."""

    name: str = Field(min_length=1)
    """Dataset name; it prefixes every problem_id and tags samples and metrics."""
    path: Path
    """The file (a directory for hf_disk); relative paths are relative to the directory `rl` runs in."""
    prompt: str | None = None
    """Field holding the prompt as text (give this or `messages`)."""
    messages: str | None = None
    """Field holding the prompt as chat messages, a list of {role, content} (give this or `prompt`)."""
    chat: bool = False
    """With `prompt`: the text becomes one user message (after `system`), rendered by the tokenizer's chat
    template; false: the prompt is the text as is (with `system` and a newline before it)."""
    system: str | None = None
    """A system prompt added to every prompt (before a row's own system message, joined by a newline)."""
    answer: str = Field(min_length=1)
    """Field holding the reference answer (a string or a number)."""
    demonstration: str | None = None
    """Field holding the SFT target (e.g. a worked solution); default: the answer itself."""
    direct_demonstration: str | None = None
    """The demonstration without its reasoning, a template of the row's fields, e.g. `"The answer is {answer}."`:
    the effort cold start (`stages[i].effort_cold_start`, seed §5.1.4) shows it at level b with probability
    1 − b/100 and the `demonstration` otherwise, so SFT teaches the policy to read the effort prefix. None: the file's
    demonstrations ignore the level (a recipe with the cold start on refuses to load)."""
    verifier: VerifierConfig
    """exact | math | regex | python:pkg.module:fn, or a mapping with options (rewards/verifiers.py)."""
    heldout: HeldoutConfig = Field(default_factory=HeldoutConfig)
    """{fraction, seed} of the file's prompts, or {path} of another file; never in the train stream."""
    seed: int = 0
    """Seed of the train stream's shuffles."""
    skip_rows: int = Field(0, ge=0)
    """Leave out the first this many rows of the file (before `max_rows` and the split): two datasets over one
    file, one with `max_rows: N` and one with `skip_rows: N`, split its rows, e.g. SFT rows for one stage and
    RL prompts for the next (`stages[i].datasets`)."""
    max_rows: int | None = Field(None, gt=0)
    """Use only the first this many rows of the file (after `skip_rows`; before the split)."""
    where: dict[str, str | int | list[str | int]] = Field(default_factory=dict)
    """Keep only rows whose fields have these values (a list: any of them), in the train file and the held-out file,
    e.g. `where: {kind: apples_add}`: one file as many sub-datasets, each with its own mixture weight, cap or OPD
    teacher. `skip_rows` and `max_rows` count the file's rows, before this filter."""

    @field_validator("verifier", mode="before")
    @classmethod
    def _verifier_shorthand(cls, value: Any) -> Any:
        return verifier_shorthand(value)

    @model_validator(mode="after")
    def _check_files(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt: <field> (text) or messages: <field> (chat messages)")
        if self.chat and self.messages is not None:
            raise ValueError("chat applies to a text prompt; messages are chat already")
        if self.heldout.split is not None and self.type != "hf_disk":
            raise ValueError(f"heldout.split applies to hf_disk datasets only, not to {self.type}")
        for i, (path, split) in enumerate(self.sources()):
            preview = min(PREVIEW_ROWS, self.max_rows or PREVIEW_ROWS)
            rows = list(train_rows(self, path, split, preview) if i == 0 else iter_rows(self.type, path, limit=preview, split=split))
            for n, row in rows:
                row_problem(self, path, n, row)
            absent = [k for k in self.where if not any(k in row for _, row in rows)]
            if absent:
                raise ValueError(f"where: {path} has no field {absent[0]!r} in its first {len(rows)} rows")
        return self

    def keeps(self, row: Mapping) -> bool:
        """The row passes `where`."""
        return all(k in row and (row[k] in v if isinstance(v, list) else row[k] == v) for k, v in self.where.items())

    def sources(self) -> list[tuple[Path, str | None]]:
        """(path, split) of the train file, then of the held-out file when there is one."""
        own = [(self.path, getattr(self, "split", None))]
        h = self.heldout
        return own if h.fraction is not None else own + [(h.path or self.path, h.split)]

    def build(self) -> "FileDataset":
        return FileDataset(self)


class JsonlDatasetConfig(_FileDatasetConfig):
    """A JSON Lines file: one JSON object per line."""

    type: Literal["jsonl"] = "jsonl"
    """Discriminator: a JSONL file."""


class ParquetDatasetConfig(_FileDatasetConfig):
    """A Parquet file (needs pyarrow: pip install -e ".[data]")."""

    type: Literal["parquet"] = "parquet"
    """Discriminator: a Parquet file."""


class HfDiskDatasetConfig(_FileDatasetConfig):
    """A directory written by `datasets.Dataset.save_to_disk` (needs datasets: pip install -e ".[data]")."""

    type: Literal["hf_disk"] = "hf_disk"
    """Discriminator: a Hugging Face `datasets` directory."""
    split: str | None = None
    """The split to train on when the directory holds a DatasetDict (e.g. train)."""


FILE_DATASET_CONFIGS = (JsonlDatasetConfig, ParquetDatasetConfig, HfDiskDatasetConfig)
"""The file dataset configs (recipe unions list these)."""


# ---- rows -> problems ------------------------------------------------------------------------------------


def _text(cfg: _FileDatasetConfig, path: Path, n: int, row: Mapping, field: str, *, numbers: bool = False) -> str:
    if field not in row:
        raise DatasetError(path, "missing", row=n, field=field)
    value = row[field]
    if numbers and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        kinds = "a string or a number" if numbers else "a string"
        raise DatasetError(path, f"is {_kind(value)}, expected {kinds}", row=n, field=field)
    if not value.strip():
        raise DatasetError(path, "is empty", row=n, field=field)
    return value


def _template(cfg: _FileDatasetConfig, path: Path, n: int, row: Mapping) -> str:
    """`direct_demonstration` filled with the row's fields (numbers as text)."""
    fields = {k: v for k, v in row.items() if isinstance(v, (str, int, float)) and not isinstance(v, bool)}
    try:
        return cfg.direct_demonstration.format_map(fields)
    except KeyError as e:
        raise DatasetError(path, f"is missing or not a string or number, which direct_demonstration "
                                 f"{cfg.direct_demonstration!r} names", row=n, field=e.args[0]) from None
    except (ValueError, IndexError) as e:
        raise DatasetError(path, f"direct_demonstration {cfg.direct_demonstration!r} is not a template of the row's "
                                 f"fields ({e})", row=n) from None


def _kind(value: Any) -> str:
    return "null" if value is None else f"a {type(value).__name__} ({_short_repr(value)})"


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _messages(cfg: _FileDatasetConfig, path: Path, n: int, row: Mapping) -> tuple[Message, ...]:
    field = cfg.messages
    if field not in row:
        raise DatasetError(path, "missing", row=n, field=field)
    value = row[field]
    if not isinstance(value, list) or not value:
        raise DatasetError(path, f"is {_kind(value)}, expected a non-empty list of {{role, content}}", row=n, field=field)
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or set(m) - {"role", "content"} or not isinstance(m.get("content"), str) \
                or m.get("role") not in _ROLES:
            raise DatasetError(path, f"message {i} is {_short_repr(m)}, expected {{role: system | user | assistant, "
                                     "content: string}", row=n, field=field)
        out.append(Message(m["role"], m["content"]))
    if out[-1].role != "user":
        raise DatasetError(path, f"ends with a {out[-1].role} message; the last message must be the user's", row=n, field=field)
    return tuple(out)


def _with_system(cfg: _FileDatasetConfig, prompt: str | tuple[Message, ...]) -> str | tuple[Message, ...]:
    if isinstance(prompt, str):
        if cfg.chat:
            prompt = (Message("user", prompt),)
        elif cfg.system is not None:
            return f"{cfg.system}\n{prompt}"
    if cfg.system is None or isinstance(prompt, str):
        return prompt
    if prompt[0].role == "system":
        return (Message("system", f"{cfg.system}\n{prompt[0].content}"), *prompt[1:])
    return (Message("system", cfg.system), *prompt)


def train_rows(cfg: _FileDatasetConfig, path: Path, split: str | None, limit: int | None) -> Iterator[tuple[int, dict]]:
    """(row number, row) of the train file after its first `skip_rows` rows, `limit` of them at most; DatasetError
    when none is left."""
    rows = iter_rows(cfg.type, path, limit=None if limit is None else cfg.skip_rows + limit, split=split)
    kept = 0
    for i, (n, row) in enumerate(rows):
        if i >= cfg.skip_rows:
            kept += 1
            yield n, row
    if not kept:
        raise DatasetError(path, f"no rows after the first {cfg.skip_rows} (skip_rows)")


def row_problem(cfg: _FileDatasetConfig, path: Path, n: int, row: Mapping, problem_id: str = "") -> Problem:
    """The problem of row `n` of `path`; DatasetError (file, row, field) when the row does not fit the config."""
    prompt = _text(cfg, path, n, row, cfg.prompt) if cfg.prompt is not None else _messages(cfg, path, n, row)
    answer = _text(cfg, path, n, row, cfg.answer, numbers=True).strip()
    metadata: dict[str, Any] = {"row_number": n}
    if cfg.demonstration is not None:
        metadata["demonstration"] = _text(cfg, path, n, row, cfg.demonstration)
    if cfg.direct_demonstration is not None:
        metadata["direct_demonstration"] = _template(cfg, path, n, row)
    if isinstance(cfg.verifier, PythonVerifierConfig):
        metadata["row"] = dict(row)  # the function's third argument
    return Problem(problem_id or f"{cfg.name}:{n}", cfg.name, _with_system(cfg, prompt), answer, metadata)


def split_key(cfg: _FileDatasetConfig, row: Mapping) -> str:
    """What identifies a row's prompt for the split: the row's own prompt field, before `system` or `chat`
    wrap it (changing the system prompt keeps the split), so two rows that share it are never separated."""
    return row[cfg.prompt] if cfg.prompt is not None else json.dumps(row[cfg.messages], sort_keys=True)


def _stable_int(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


# ---- the task -------------------------------------------------------------------------------------------


class FileDataset(Task):
    """The `Task` of a file dataset. Reading is lazy (`scan`, or the first train/held-out draw), so building
    one where only `verify` runs (reward workers) reads nothing."""

    def __init__(self, cfg: _FileDatasetConfig):
        self.cfg = cfg
        self.name = cfg.name
        self._verifier = cfg.verifier.build()
        self._train: list[Problem] | None = None
        self._heldout: list[Problem] = []
        self.summary = ""

    def _read(self, path: Path, split: str | None, prefix: str) -> list[tuple[str, Problem]]:
        """(split key, problem) of every row of a file, each row checked (and with a math verifier, its answer parsed)."""
        cfg = self.cfg
        out = []
        math_answers = isinstance(cfg.verifier, MathVerifierConfig) or (
            isinstance(cfg.verifier, RegexVerifierConfig) and cfg.verifier.compare == "math")
        rows = train_rows(cfg, path, split, cfg.max_rows) if prefix == "" else iter_rows(cfg.type, path, split=split)
        for n, row in rows:
            if not cfg.keeps(row):
                continue
            p = row_problem(cfg, path, n, row, f"{cfg.name}:{prefix}{n}")
            if math_answers and not parse_reference(p.answer, cfg.verifier.timeout_s):
                raise DatasetError(path, f"{_short_repr(p.answer)} is not parseable by math-verify (verifier: math)",
                                   row=n, field=cfg.answer)
            out.append((split_key(cfg, row), p))
        return out

    def scan(self, *, need_train: bool = True) -> str:
        """Read and check every row of the dataset's files and make the split; DatasetError (one line: file, row,
        field) for the first bad row. Returns a one-line summary. Idempotent. `need_train=False` (evaluation
        only, `rl eval`): a held-out file that holds every train prompt, such as the train file itself, is allowed."""
        if self._train is not None:
            return self.summary
        cfg = self.cfg
        (path, split), *heldout_source = cfg.sources()
        rows = self._read(path, split, "")
        if not rows and cfg.where:
            raise DatasetError(path, f"no rows match where: {cfg.where}")
        if heldout_source:
            hpath, hsplit = heldout_source[0]
            held_rows = self._read(hpath, hsplit, "heldout:")
            held = {k for k, _ in held_rows}
            heldout = [p for _, p in held_rows]
            train = [p for k, p in rows if k not in held]
            how = f"from {hpath}{f' split {hsplit}' if hsplit else ''}; {len(rows) - len(train)} train rows repeat a held-out prompt and are left out"
        else:
            keys = sorted({k for k, _ in rows}, key=lambda k: (_stable_int(f"{cfg.heldout.seed}:{k}"), k))
            if len(keys) < 2:
                raise DatasetError(path, f"has {len(keys)} distinct prompt(s): a held-out fraction needs at least 2")
            held = set(keys[: min(len(keys) - 1, max(1, round(cfg.heldout.fraction * len(keys))))])
            heldout = [p for k, p in rows if k in held]
            train = [p for k, p in rows if k not in held]
            how = f"{len(held)} of {len(keys)} distinct prompts (fraction {cfg.heldout.fraction}, seed {cfg.heldout.seed})"
        if not train and need_train:
            raise DatasetError(path, "no train rows left: every prompt of the file is in the held-out split")
        self._train, self._heldout = train, heldout
        self.summary = f"dataset {cfg.name}: {len(train)} train rows, {len(heldout)} held out ({how})"
        return self.summary

    def train_stream(self, seed_offset: int = 0) -> Iterator[Problem]:
        """Shuffled epochs over the train rows, reproducible per (cfg.seed, seed_offset)."""
        self.scan()
        rng = random.Random(_stable_int(f"train:{self.cfg.name}:{self.cfg.seed}:{seed_offset}"))
        order = list(range(len(self._train)))
        while True:
            rng.shuffle(order)
            for i in order:
                yield self._train[i]

    def heldout(self) -> list[Problem]:
        """The held-out rows in file order."""
        self.scan()
        return list(self._heldout)

    def verify(self, trajectory: Trajectory, ctx: VerifyContext | None = None) -> Verdict:
        return self._verifier(trajectory, trajectory.problem.answer, trajectory.problem.metadata.get("row", {}))

    def verify_many(self, trajectories: Sequence[Trajectory], ctx: VerifyContext | None = None) -> list[Verdict]:
        """`verify` of each, through the verifier's batch form where it has one (math: one child call)."""
        many = getattr(self._verifier, "many", None)
        if many is None:
            return [self.verify(t, ctx) for t in trajectories]
        return many([(t, t.problem.answer, t.problem.metadata.get("row", {})) for t in trajectories])

    def demonstration(self, problem: Problem, rng: random.Random, *, direct_answer_rate: float | None = None,
                      reasoning_frac: float | None = None) -> str:
        """The row's demonstration field, else its answer; with `direct_demonstration`, that instead with probability
        direct_answer_rate (or 1 − reasoning_frac: a file's demonstration has no lines to keep a share of)."""
        direct = problem.metadata.get("direct_demonstration")
        rate = direct_answer_rate if direct_answer_rate is not None else (
            None if reasoning_frac is None else 1 - reasoning_frac)
        if direct is not None and rate and rng.random() < rate:
            return direct
        return problem.metadata.get("demonstration", problem.answer)
