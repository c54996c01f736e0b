"""`rl traj ls` and `rl traj show`: read a run's trajectory store from the command line.

    rl traj ls RUN_DIR [--dataset D] [--min-reward X] [--max-reward X] [--step N] [--status S] [--failure R] [--limit N]
    rl traj show RUN_DIR SAMPLE_ID

Both read the run's store (`store.url` of RUN_DIR/recipe.yaml, else `RUN_DIR/trajectories.db`) unless
`--url` names another SQLAlchemy database, and show the run whose identity RUN_DIR/run.json holds.
`show` renders a multi-turn sample (tool calls) turn by turn: each model turn's text, each tool turn's call,
status, exit code, wall time and output (every output line marked with "│", a truncation named); tool tokens
show "-" for their version in the token grid (loss mask 0). A sample without turns renders as one response.

They only read: the store opens read-only, nothing is created or migrated; a store older than the
code is refused with a line naming `rl db upgrade`. Errors are one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from configbase import finite_float

if TYPE_CHECKING:  # the store (SQLAlchemy) is imported by `rl traj` only, not by every `rl` command
    from rl.store.trajectories import SampleRow, TrajectoryStore
    from rl.types import Sample

PREVIEW_WIDTH = 40
TOKEN_GRID_WIDTH = 100
"""Characters per line of the token/version grid in `show`."""
_VISIBLE = {"\n": "⏎", " ": "␣", "\t": "⇥"}


class _UserError(Exception):
    """A problem the user can fix; reported as one line and exit code 2."""


def add_traj_parser(subparsers) -> None:
    """Add `traj ls` and `traj show` to the main CLI's subparsers."""
    traj = subparsers.add_parser("traj", help="inspect a run's stored trajectories")
    sub = traj.add_subparsers(dest="traj_command", metavar="{ls,show}", required=True)

    ls = sub.add_parser("ls", help="list samples, filtered")
    ls.add_argument("run_dir", help="run directory (holds trajectories.db)")
    ls.add_argument("--dataset", help="only this dataset")
    ls.add_argument("--min-reward", type=finite_float, help="reward >= X")
    ls.add_argument("--max-reward", type=finite_float, help="reward <= X")
    ls.add_argument("--step", type=_sql_int, help="only samples consumed by train step N")
    ls.add_argument("--status", help="finished | discarded | failed | ...")
    ls.add_argument("--effort", type=_sql_int, help="only prompts at reasoning-effort level B")
    ls.add_argument("--teacher", help="only samples scored by this OPD teacher")
    ls.add_argument("--failure", help="only samples a sandbox failure ended, for this reason (timeout, memory, ...)")
    ls.add_argument("--limit", type=_positive_int, default=50, help="at most N rows (default 50)")
    ls.add_argument("--url", help="SQLAlchemy URL of the store (default: the run's store.url, else RUN_DIR/trajectories.db)")
    ls.set_defaults(func=cmd_ls)

    show = sub.add_parser("show", help="one sample in full: texts, reward, per-token policy versions")
    show.add_argument("run_dir", help="run directory (holds trajectories.db)")
    show.add_argument("sample_id")
    show.add_argument("--url", help="SQLAlchemy URL of the store (default: the run's store.url, else RUN_DIR/trajectories.db)")
    show.set_defaults(func=cmd_show)


def cmd_ls(args) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    from rl.store.trajectories import StoreError

    try:
        store = _open_store(args.run_dir, args.url)
        try:
            rows = store.query(
                dataset=args.dataset, min_reward=args.min_reward, max_reward=args.max_reward,
                train_step=args.step, status=args.status, effort=args.effort, teacher=args.teacher,
                failure=args.failure, limit=args.limit,
            )
        finally:
            store.close()
    except (_UserError, StoreError, SQLAlchemyError) as e:
        return _fail(e)
    print(format_table(rows))
    print(f"{len(rows)} samples shown" + (f" (--limit {args.limit} reached)" if len(rows) == args.limit else ""))
    return 0


def cmd_show(args) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    from rl.store.trajectories import StoreError

    try:
        store = _open_store(args.run_dir, args.url)
        try:
            sample = store.get_sample(args.sample_id)
            if sample is None:
                raise _UserError(f"no sample {args.sample_id!r} in {args.run_dir}")
            step = store.sample_train_step(args.sample_id)
            segments = store.segments(args.sample_id)
        finally:
            store.close()
    except (_UserError, StoreError, SQLAlchemyError) as e:
        return _fail(e)

    versions = sample.policy_versions_T
    t = sample.timings
    print(f"sample         {sample.sample_id}")
    print(f"prompt_id      {sample.prompt_id}   group {sample.group_id}   dataset {sample.dataset}")
    print(f"status         {sample.status}   finish_reason {sample.finish_reason}"
          + (f"   failure {sample.failure} (repercussion)" if sample.failure else ""))
    print(f"reward         {sample.reward:.4f}   correct {'yes' if sample.correct else 'no'}"
          + (f"   ({sample.reason})" if sample.reason else ""))
    print(f"train step     {step if step is not None else '- (not trained)'}   config version {sample.config_version}")
    if sample.effort is not None or sample.teacher is not None:
        print(f"effort         {sample.effort if sample.effort is not None else '-'}   teacher {sample.teacher or '-'}")
    print(f"tokens         prompt {len(sample.prompt_tokens)}   response {sample.num_response_tokens}")
    print(f"versions       {_version_range(min(versions, default=None), max(versions, default=None))}")
    print("segments       " + ("   ".join(f"[{a},{b}) v{v}" for a, b, v in segments) or "-"))
    if "generate_s" in t:
        print(f"generate_s     {t['generate_s']:.3f}")
    if sample.routing_trace is not None:
        print(f"routing_trace  int16 {list(sample.routing_trace.shape)} (tokens, layers, top_k)")
    if sample.turns:
        tools = [t for t in sample.turns if t.kind == "tool"]
        statuses = ", ".join(f"{n} {st}" for st, n in sorted(Counter(t.status or "-" for t in tools).items()))
        model = len(sample.turns) - len(tools)
        print(f"turns          {len(sample.turns)}: {model} model, {len(tools)} tool ({statuses or '-'})")
    print("\n--- prompt ---")
    print(sample.prompt_text)
    if sample.turns:
        print("\n--- response, turn by turn ---")
        print(format_turns(sample))
    else:
        print("\n--- response ---")
        print(sample.response_text)
    print("\n--- response tokens and policy versions ---")
    mask = sample.loss_mask_T()  # tool tokens were appended, not sampled: no version of their own to show
    print(format_token_grid(_token_pieces(sample.response_tokens, sample.response_text),
                            tuple(v if m else "-" for v, m in zip(versions, mask))))
    return 0


def format_turns(sample: Sample) -> str:
    """Each turn under a header line; a tool turn's call and output lines are marked with "│"."""
    out = []
    for i, t in enumerate(sample.turns):
        span = f"tokens [{t.start}, {t.end})"
        if t.kind == "model":
            out += [f"[{i}] model  {span}", t.text]
            continue
        facts = [t.tool or "(no tool)", span, f"status {t.status or '-'}"]
        facts += [f"exit {t.exit_code}"] if t.exit_code is not None else []
        facts += [f"{t.wall_s:.3f} s"] if t.wall_s is not None else []
        facts += ["output TRUNCATED"] if t.truncated else []
        out.append(f"[{i}] tool   " + "   ".join(facts))
        out += _marked("    call", (t.call or "-").rstrip("\n")) + _marked("  output", t.text)
    return "\n".join(out)


def _marked(label: str, text: str) -> list[str]:
    lines = text.split("\n")
    return [f"{label if j == 0 else ' ' * len(label)} │ {line}" for j, line in enumerate(lines)]



def format_table(rows: list[SampleRow]) -> str:
    """Fixed-width table; numbers right-aligned, the response preview last."""
    header = ("sample_id", "dataset", "reward", "correct", "len", "versions", "step", "response")
    cells = [
        (r.sample_id, r.dataset, f"{r.reward:.3f}", "yes" if r.correct else "no", str(r.num_response_tokens),
         _version_range(r.min_version, r.max_version), "-" if r.train_step is None else str(r.train_step),
         _preview(r.response_preview))
        for r in rows
    ]
    widths = [max(len(c) for c in col) for col in zip(header, *cells)]
    right = {2, 4, 6}
    lines = []
    for line in [header, *cells]:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def format_token_grid(pieces: list[str], versions: tuple[int | str, ...], width: int = TOKEN_GRID_WIDTH) -> str:
    """Each token over its policy version, columns aligned, wrapped at `width` characters:

        [0]  tok  T  h  e  ␣  a ...
             ver  3  3  3  4  4 ...
    """
    if not pieces:
        return "(no response tokens)"
    label_w = len(f"[{len(pieces) - 1}]")
    out, row_t, row_v, row_start, used = [], [], [], 0, 0

    def flush() -> None:
        out.append(f"{f'[{row_start}]':<{label_w}}  tok " + " ".join(row_t))
        out.append(f"{'':<{label_w}}  ver " + " ".join(row_v))

    for i, (piece, v) in enumerate(zip(pieces, versions)):
        w = max(len(piece), len(str(v)))
        if row_t and used + w + 1 > width - label_w - 6:
            flush()
            row_t, row_v, row_start, used = [], [], i, 0
        row_t.append(piece.rjust(w))
        row_v.append(str(v).rjust(w))
        used += w + 1
    flush()
    return "\n".join(out)


def _token_pieces(tokens: tuple[int, ...], text: str) -> list[str]:
    """Display text of each response token: the stored text's characters when the tokens are the
    char tokenizer's encoding of it (plus an optional eos), else each id decoded on its own."""
    from model.tokenizer import CharTokenizer

    tok = CharTokenizer()
    special = {tok.pad_id: "<pad>", tok.bos_id: "<bos>", tok.eos_id: "<eos>"}
    try:
        encoded = tok.encode(text)
    except ValueError:
        encoded = None
    if encoded is not None and list(tokens[: len(encoded)]) == encoded and len(tokens) - len(encoded) <= 1:
        return [_visible(ch) for ch in text] + [special.get(t, f"#{t}") for t in tokens[len(encoded) :]]
    return [
        special[t] if t in special else _visible(tok.decode([t])) if 0 <= t < tok.vocab_size else f"#{t}"
        for t in tokens
    ]


def _open_store(run_dir: str, url: str | None) -> TrajectoryStore:
    from rl.store.trajectories import TrajectoryStore

    return TrajectoryStore.read_run(Path(run_dir), url=url)


def _fail(e: Exception) -> int:
    from rl.store.trajectories import StoreError

    if not isinstance(e, (_UserError, StoreError)):  # the driver's own message, without SQLAlchemy's SQL echo
        e = f"cannot read the trajectory store: {getattr(e, 'orig', None) or e}"
    msg = str(e)
    print("rl traj: " + " ".join(msg.split()), file=sys.stderr)  # one line, whatever the driver said
    return 2


SQL_INT_MAX = 2**63 - 1
"""The widest integer a store column holds (SQLite INTEGER, PostgreSQL BIGINT): the driver raises past it."""


def _sql_int(s: str) -> int:
    """An integer a filter can compare in SQL; one argparse line (exit 2) otherwise, never the driver's OverflowError."""
    try:
        n = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
    if not -SQL_INT_MAX - 1 <= n <= SQL_INT_MAX:
        raise argparse.ArgumentTypeError(f"{s[:30]}{'...' if len(s) > 30 else ''} is past the 64-bit integers a store holds")
    return n


def _positive_int(s: str) -> int:
    n = _sql_int(s)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {s}")
    return n


def _version_range(lo: int | None, hi: int | None) -> str:
    return "-" if lo is None else f"{lo}-{hi}"


def _preview(text: str) -> str:
    text = text.replace("\n", "⏎")
    return text if len(text) <= PREVIEW_WIDTH else text[: PREVIEW_WIDTH - 1] + "…"


def _visible(s: str) -> str:
    return "".join(_VISIBLE.get(ch, ch if ch.isprintable() else f"\\x{ord(ch):02x}") for ch in s)
