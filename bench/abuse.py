"""Bad inputs and misuse through the real `rl` CLI (issues #13 and #40): does anything run foreign code, hang,
print a traceback, lose data, write outside what the command owns, or fail with more than one line?

    python bench/abuse.py [--quick] [--keep DIR] [--only SUBSTRING] [--list] [--jobs N]

Every case runs a real command in a subprocess (the `rl` CLI, or a small client script for the sandbox server) in
a scratch directory of its own, built from one tiny trained run (configs/tiny_grpo.yaml). The cases are in
bench/abuse_cases.py, by kind (`--list` prints them). What is judged, by the runner and not by the command's own
report:
  exit        each case names the exit code it wants (2 with ONE stderr line for a refusal, 0 where the command
              should simply work, 3 for a preempted job, 5 for a diverged one)
  hang        the command has not exited 10 s after the case's bound (`should_end_s`); a job a case started in
              the background has not exited 10 s after its SIGTERM
  traceback   "Traceback" on stderr
  foreign     canary files that exist only if planted code ran
  data loss   the case's own check (rows kept, bytes unchanged, a job still alive)
  outside     every file of the case's scratch directory except the paths the command may write (`may_write`),
              the shared `outside/` directory that planted symlinks point into, and the base run: each is hashed
              (type, size, bytes or link target, never following links) before and after the command
Cases run two at a time (`--jobs`). `--quick` is the same matrix (every case is a real run of a few seconds).
Last line: RESULT cases=<n> kinds=<k> one_line_errors=<n> tracebacks=0 hangs=0 data_loss=0 foreign_code_ran=0
wrong_exit=0 outside_writes=0
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]
TINY = yaml.safe_load((ROOT / "configs" / "tiny_grpo.yaml").read_text())
"""A 20K-parameter GRPO run of seconds (configs/tiny_grpo.yaml)."""
HANG_GRACE_S = 10.0
"""A command that has not exited this long after it should have is a hang (issue #40)."""
DEFAULT_MAY_WRITE = ("run", "r", "r2", "out", "home", "responses.jsonl", "job.stdout", "job.stderr")
"""What a case's command may write under its scratch directory unless the case says otherwise."""


SQLITE_SIDE_FILES = ("-shm", "-wal")
"""SQLite's shared-memory index and write-ahead log beside a store: a reader may create them (no data of its own)."""


def digest(path: Path) -> str:
    return hashlib.blake2b(path.read_bytes()).hexdigest() if path.exists() else "absent"


def tree_state(root: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """Every entry under `root` (not following symlinks) -> its type and content: a file's size and digest, a
    link's target, a directory's mode. `skip`: paths relative to `root` left out with all below them (what the
    command may write)."""
    state: dict[str, str] = {}
    if not os.path.lexists(root):
        return state
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel_dir = Path(dirpath).relative_to(root)
        for name in sorted(dirnames + filenames):
            p = Path(dirpath) / name
            rel = str(rel_dir / name) if rel_dir != Path(".") else name
            if rel in skip or name.endswith(SQLITE_SIDE_FILES):
                if name in dirnames:
                    dirnames.remove(name)
                continue
            st = p.lstat()
            if p.is_symlink():
                state[rel] = f"link:{os.readlink(p)}"
                if name in dirnames:
                    dirnames.remove(name)
            elif p.is_dir():
                state[rel] = f"dir:{st.st_mode:o}"
            elif p.is_file():
                state[rel] = f"file:{st.st_size}:{digest(p)}"
            else:
                state[rel] = f"other:{st.st_mode:o}"
    return state


@dataclass
class Call:
    """A command a case runs, when it is more than `rl ARGS` from the repository root."""

    argv: list[str]
    rl: bool = True
    """Prefix `argv` with the `rl` CLI."""
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    signal_after: tuple[int, float] | None = None
    """Send this signal this many seconds after the start (Ctrl-C during start-up, say)."""


@dataclass
class Case:
    kind: str
    name: str
    setup: Callable[[Path], list[str] | Call]
    """Builds what the case needs under its scratch directory; returns the CLI arguments or a `Call`."""
    want_rc: int | tuple[int, ...] = 2
    check: Callable[[Path], str | None] | None = None
    """After the command: why data was lost or the job was harmed (or None)."""
    canaries: list[str] = field(default_factory=list)
    """Files (relative to the scratch directory) whose existence means foreign code ran."""
    should_end_s: float = 120.0
    """By when the command must have exited; HANG_GRACE_S later it is a hang."""
    may_write: tuple[str, ...] = DEFAULT_MAY_WRITE
    """Paths under the scratch directory (and all below them) the command may write; all else is hashed."""
    one_line: bool = True
    """A refusal (exit 2) must be exactly one stderr line."""


class World:
    """The scratch area: one tiny trained run copied for every case that needs one, an `outside/` directory that
    planted symlinks point into, and the background jobs and locks cases hold while their command runs."""

    def __init__(self, root: Path):
        self.root = root
        self.outside = root / "outside"
        self.outside.mkdir(exist_ok=True)
        (self.outside / "precious.txt").write_text("a file no command may write\n")
        (self.outside / "dir").mkdir(exist_ok=True)
        (self.outside / "dir" / "kept.bin").write_bytes(os.urandom(4096))
        self.held: dict[str, object] = {}
        """Run-directory locks a case holds while its command runs, by scratch directory."""
        self.jobs: dict[str, list[subprocess.Popen]] = {}
        """Jobs a case started in the background, by scratch directory."""
        self._lock = threading.Lock()
        self.recipe = root / "tiny.yaml"
        self.recipe.write_text(yaml.safe_dump(TINY))
        self.base = root / "base-run"
        proc = subprocess.run([*CLI, "train", str(self.recipe), "--run-dir", str(self.base)], capture_output=True,
                              text=True, timeout=300, cwd=ROOT)
        if proc.returncode != 0:
            sys.exit(f"the base run failed:\n{proc.stderr[-2000:]}")

    def run_copy(self, d: Path, name: str = "run") -> Path:
        dst = d / name
        shutil.copytree(self.base, dst, ignore=shutil.ignore_patterns(".lock"))
        return dst

    def recipe_data(self, **patch) -> dict:
        data = json.loads(json.dumps(TINY))
        for dotted, value in patch.items():
            node, keys = data, dotted.split("__")
            for k in keys[:-1]:
                node = node[int(k)] if isinstance(node, list) else node[k]
            node[int(keys[-1]) if isinstance(node, list) else keys[-1]] = value
        return data

    def recipe_with(self, d: Path, name: str = "r.yaml", **patch) -> Path:
        path = d / name
        path.write_text(yaml.safe_dump(self.recipe_data(**patch)))
        return path

    def start_job(self, d: Path, argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None,
                  ready: Callable[[], bool] | None = None, ready_s: float = 120.0) -> subprocess.Popen:
        """`rl ARGV` in the background (its output to files under d); waits until `ready()` (or the job ends)."""
        out, err = open(d / "job.stdout", "wb"), open(d / "job.stderr", "wb")
        proc = subprocess.Popen([*CLI, *argv], stdout=out, stderr=err, cwd=cwd or ROOT,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        out.close()
        err.close()
        with self._lock:
            self.jobs.setdefault(str(d), []).append(proc)
        deadline = time.monotonic() + ready_s
        while ready is not None and not ready() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        return proc

    def end_jobs(self, d: Path) -> str | None:
        """SIGTERM every background job of the case; why one was a problem (outlived its SIGTERM by
        HANG_GRACE_S, or left processes of its session behind), or None."""
        problems = []
        for proc in self.jobs.pop(str(d), []):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=HANG_GRACE_S)
                except subprocess.TimeoutExpired:
                    problems.append(f"job {proc.pid} outlived its SIGTERM by {HANG_GRACE_S:.0f} s")
            if _session_alive(proc.pid):
                problems.append(f"processes of job {proc.pid}'s session outlived it")
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        return "; ".join(problems) or None


def _session_alive(sid: int) -> bool:
    """Whether any process is in session `sid` (a job started with start_new_session, and what it forked)."""
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":  # fields[3]: session id; Z: a zombie
                return True
    return False


def run_case(w: World, case: Case, d: Path) -> dict:
    d.mkdir(parents=True)
    t0 = time.monotonic()
    call = case.setup(d)
    if isinstance(call, list):
        call = Call(call)
    argv = [*CLI, *call.argv] if call.rl else call.argv
    around = {"scratch": tree_state(d, case.may_write), "outside": tree_state(w.outside),
              "base": tree_state(w.base, (".lock",))}
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=call.cwd or ROOT,
                            env={**os.environ, **call.env}, start_new_session=True)
    if call.signal_after is not None:
        sig, after = call.signal_after
        threading.Timer(after, lambda: proc.poll() is None and proc.send_signal(sig)).start()
    try:
        out, err = proc.communicate(timeout=case.should_end_s + HANG_GRACE_S)
        hang = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        hang = True
    seconds = time.monotonic() - t0
    rc = None if hang else proc.returncode
    err = err.decode(errors="replace")
    held = w.held.pop(str(d), None)
    if held is not None:
        held.release()
    loss = case.check(d) if case.check is not None and not hang else None
    job_problem = w.end_jobs(d)
    after = {"scratch": tree_state(d, case.may_write), "outside": tree_state(w.outside),
             "base": tree_state(w.base, (".lock",))}
    outside = [f"{where}/{p}" for where in around for p in sorted(set(around[where]) | set(after[where]))
               if around[where].get(p) != after[where].get(p)]
    lines = [line for line in err.strip().splitlines() if line.strip() and not line.startswith(("warning:", "wandb"))]
    want = case.want_rc if isinstance(case.want_rc, tuple) else (case.want_rc,)
    res = {"kind": case.kind, "name": case.name, "rc": rc, "want_rc": list(want), "seconds": round(seconds, 1),
           "hang": hang or bool(job_problem and "outlived its SIGTERM" in job_problem),
           "traceback": "Traceback" in err, "one_line_error": rc == 2 and len(lines) == 1,
           "foreign_code": [c for c in case.canaries if (d / c).exists()],
           "data_loss": loss or (job_problem if job_problem and "outlived its SIGTERM" not in job_problem else None),
           "outside_writes": outside[:5], "stdout_bytes": len(out), "stderr": lines[-1][:200] if lines else ""}
    res["wrong_exit"] = rc not in want or (rc == 2 and case.one_line and not res["one_line_error"])
    return res


def main() -> None:
    from abuse_cases import build_cases  # bench/ is on the path: this file is run as a script

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the same matrix (every case is a run of seconds)")
    ap.add_argument("--keep", type=Path, help="keep the scratch directories here")
    ap.add_argument("--only", action="append", default=[], help="run the cases whose kind/name contains this")
    ap.add_argument("--list", action="store_true", help="print the cases, run nothing")
    ap.add_argument("--jobs", type=int, default=2, help="cases at a time")
    ap.add_argument("--json", type=Path, help="write every case's result here")
    args = ap.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="abuse-"))
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o711)  # the sandbox cases' uids traverse it to their work directories (mkdtemp makes it 0700)
    if args.list:
        for c in build_cases(None):
            print(f"{c.kind:<13}{c.name}")
        return
    w = World(root)
    cases = [c for c in build_cases(w) if not args.only or any(o in f"{c.kind}/{c.name}" for o in args.only)]
    t0 = time.monotonic()

    def one(i_case):
        i, case = i_case
        try:
            r = run_case(w, case, root / f"case{i:03d}")
        except Exception as e:  # the case's own setup or check failed: the bench's bug, reported as a failure
            w.end_jobs(root / f"case{i:03d}")
            r = {"kind": case.kind, "name": case.name, "rc": None, "want_rc": case.want_rc, "seconds": 0.0,
                 "hang": False, "traceback": False, "one_line_error": False, "foreign_code": [], "outside_writes": [],
                 "data_loss": f"the case itself failed: {type(e).__name__}: {str(e)[-300:]}", "wrong_exit": True,
                 "stdout_bytes": 0, "stderr": ""}
        bad = r["hang"] or r["traceback"] or r["foreign_code"] or r["data_loss"] or r["wrong_exit"] or r["outside_writes"]
        why = r["data_loss"] or (f"outside: {r['outside_writes']}" if r["outside_writes"] else "")
        print(f"{'FAIL' if bad else 'ok  '} {r['kind']:<12}{r['name'][:62]:<64} rc={r['rc']} {r['seconds']:>5}s  "
              f"{r['stderr'][:100]} {why}", flush=True)
        return r

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(one, enumerate(cases)))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.keep is None:
        shutil.rmtree(root, ignore_errors=True)
    n = len(results)
    print(f"minutes={(time.monotonic() - t0) / 60:.1f}")
    print(f"RESULT cases={n} kinds={len({r['kind'] for r in results})} "
          f"one_line_errors={sum(r['one_line_error'] for r in results)} tracebacks={sum(r['traceback'] for r in results)} "
          f"hangs={sum(r['hang'] for r in results)} data_loss={sum(bool(r['data_loss']) for r in results)} "
          f"foreign_code_ran={sum(bool(r['foreign_code']) for r in results)} wrong_exit={sum(r['wrong_exit'] for r in results)} "
          f"outside_writes={sum(bool(r['outside_writes']) for r in results)}")


if __name__ == "__main__":
    main()
