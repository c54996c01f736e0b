"""Bad inputs and misuse through the real `rl` CLI (issue #13): does anything run foreign code, hang, print a
traceback, lose data, or fail with more than one line?

    python bench/abuse.py [--quick] [--keep DIR]

Every case runs the CLI in a subprocess (a timeout counts as a hang) in a scratch directory built from one
tiny trained run. Cases by kind:
  foreign_code  poisoned pickles, a run-directory module named as a verifier, a tokenizer's remote code:
                canary files show whether anything ran
  ownership     a run directory in use, a finished run, checkpoints deleted, a patch with no job running
  paths         run names that are paths, directory names that break URLs, store URLs
  validation    values that validate but could not run, YAML bombs, bad datasets and checkpoints
  errors        usage errors and broken files: one line, exit 2, no traceback
  readers       `rl traj` / `rl eval` on good and bad stores: the store's bytes never change
Each case states the exit code it wants (2 with one stderr line for refusals, 0 where the command should
simply work) and what must still hold afterwards (canaries absent, bytes unchanged, rows kept).
Last line: RESULT cases=<n> kinds=<k> one_line_errors=<n> tracebacks=0 hangs=0 data_loss=0 foreign_code_ran=0
wrong_exit=<n>
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.payloads import pickle_payload  # noqa: E402

CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]
TINY = yaml.safe_load((ROOT / "configs" / "tiny_grpo.yaml").read_text())
"""A 20K-parameter GRPO run of seconds (configs/tiny_grpo.yaml)."""


def digest(path: Path) -> str:
    return hashlib.blake2b(path.read_bytes()).hexdigest() if path.exists() else "absent"


@dataclass
class Case:
    kind: str
    name: str
    setup: Callable[[Path], list[str]]
    """Builds what the case needs under its scratch directory; returns the CLI arguments."""
    want_rc: int = 2
    check: Callable[[Path], str | None] | None = None
    """After the command: why data was lost (or None)."""
    canaries: list[str] = field(default_factory=list)
    """Files (relative to the scratch directory) whose existence means foreign code ran."""
    timeout: float = 180.0


class World:
    """The scratch area: one tiny trained run, copied for every case that needs one."""

    def __init__(self, root: Path):
        self.root = root
        self.held = None
        """A run-directory lock a case holds while its command runs."""
        self.recipe = root / "tiny.yaml"
        self.recipe.write_text(yaml.safe_dump(TINY))
        self.base = root / "base-run"
        proc = subprocess.run([*CLI, "train", str(self.recipe), "--run-dir", str(self.base)], capture_output=True,
                              text=True, timeout=300, cwd=ROOT)
        if proc.returncode != 0:
            sys.exit(f"the base run failed:\n{proc.stderr[-2000:]}")

    def run_copy(self, d: Path) -> Path:
        dst = d / "run"
        shutil.copytree(self.base, dst, ignore=shutil.ignore_patterns(".lock"))
        return dst

    def recipe_with(self, d: Path, **patch) -> Path:
        data = json.loads(json.dumps(TINY))
        for dotted, value in patch.items():
            node, keys = data, dotted.split("__")
            for k in keys[:-1]:
                node = node[int(k)] if isinstance(node, list) else node[k]
            node[int(keys[-1]) if isinstance(node, list) else keys[-1]] = value
        path = d / "r.yaml"
        path.write_text(yaml.safe_dump(data))
        return path


def _rows(run: Path, table: str) -> int:
    with sqlite3.connect(f"file:{run / 'trajectories.db'}?mode=ro", uri=True) as c:
        return c.execute(f"select count(*) from {table}").fetchone()[0]


def build_cases(w: World) -> list[Case]:
    cases: list[Case] = []

    def add(kind, name, want_rc=2, check=None, canaries=(), timeout=180.0):
        def deco(fn):
            cases.append(Case(kind, name, fn, want_rc, check, list(canaries), timeout))
            return fn
        return deco

    # -- foreign code -----------------------------------------------------------------------------------
    @add("foreign_code", "format-1 controller.pkl payload in the newest checkpoint", canaries=["canary-pkl"])
    def _(d):
        run = w.run_copy(d)
        ck = sorted((run / "checkpoints").glob("step-*"))[-1]
        bad = ck.parent / "step-00000099-000"
        shutil.copytree(ck, bad)
        (bad / "controller.pkl").write_bytes(pickle_payload(d / "canary-pkl"))
        (bad / "MANIFEST.json").write_text(json.dumps({"format": 1, "global_step": 99, "files": {}}))
        return ["resume", str(run)]

    @add("foreign_code", "trainer.pt payload planted beside a checkpoint (never read)", want_rc=0, canaries=["canary-pt"])
    def _(d):
        run = w.run_copy(d)
        for ck in (run / "checkpoints").glob("step-*"):
            (ck / "trainer.pt").write_bytes(pickle_payload(d / "canary-pt"))
        return ["resume", str(run)]

    @add("foreign_code", "controller.json replaced by a pickle under a rewritten manifest", want_rc=0,
         canaries=["canary-json"])
    def _(d):
        run = w.run_copy(d)
        ck = sorted((run / "checkpoints").glob("step-*"))[-1]
        (ck / "controller.json").write_bytes(pickle_payload(d / "canary-json"))
        m = json.loads((ck / "MANIFEST.json").read_text())
        p = ck / "controller.json"
        m["files"]["controller.json"] = {"bytes": p.stat().st_size, "blake2b": digest(p)}
        (ck / "MANIFEST.json").write_text(json.dumps(m))
        return ["resume", str(run)]  # skipped as unreadable; an older checkpoint resumes

    @add("foreign_code", "a module in the run directory named as the verifier", canaries=["canary-mod"])
    def _(d):
        run = w.run_copy(d)
        (run / "evil_verifier.py").write_text(f"open({str(d / 'canary-mod')!r}, 'w')\ndef fn(t, a, r): return 1.0\n")
        recipe = yaml.safe_load((run / "recipe.yaml").read_text())
        recipe["datasets"] = [{"type": "jsonl", "name": "add", "path": str(d / "x.jsonl"), "prompt": "q", "answer": "a",
                               "verifier": "python:evil_verifier:fn"}]
        (d / "x.jsonl").write_text('{"q": "1+1=", "a": "2"}\n' * 20)
        (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
        return ["resume", str(run)]

    @add("foreign_code", "tokenizer with auto_map and a tokenization module", canaries=["canary-tok"])
    def _(d):
        tok = d / "tok"
        tok.mkdir()
        (tok / "tokenization_evil.py").write_text(f"open({str(d / 'canary-tok')!r}, 'w')\n")
        (tok / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTok", None]},
                                                               "tokenizer_class": "EvilTok"}))
        return ["validate", str(w.recipe_with(d, tokenizer={"type": "hf", "path": str(tok)}))]

    @add("foreign_code", "GGUF model.init with an absurd header count", canaries=[])
    def _(d):
        import struct
        p = d / "bad.gguf"
        p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**40, 2**40))
        return ["validate", str(w.recipe), "--set", f"model.init={p}"]

    @add("foreign_code", "safetensors with an oversized header length")
    def _(d):
        m = d / "model"
        m.mkdir()
        (m / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 99, "hidden_size": 32,
                                                   "intermediate_size": 64, "num_hidden_layers": 1,
                                                   "num_attention_heads": 2, "num_key_value_heads": 1}))
        (m / "model.safetensors").write_bytes((2**62).to_bytes(8, "little") + b"{}")
        return ["train", str(w.recipe), "--run-dir", str(d / "r2"), "--set", f"model.init={m}",
                "--set", "model.hidden_size=32"]

    # -- ownership ----------------------------------------------------------------------------------------
    @add("ownership", "a second job on a run directory in use",
         check=lambda d: None if (d / "run" / "run.json").read_text() == (d / "run.json.before").read_text() else "run.json changed")
    def _(d):
        from rl.checkpoint.run_dir import RunLock

        run = w.run_copy(d)
        shutil.copy(run / "run.json", d / "run.json.before")
        w.held = RunLock(run).acquire()  # released after the case
        return ["resume", str(run)]

    @add("ownership", "rl train into a finished run",
         check=lambda d: None if _rows(d / "run", "train_steps") == 2 else "train steps lost")
    def _(d):
        run = w.run_copy(d)
        return ["train", str(w.recipe), "--run-dir", str(run)]

    @add("ownership", "resume after every checkpoint was deleted",
         check=lambda d: None if _rows(d / "run", "train_steps") == 2 else "train steps rolled back")
    def _(d):
        run = w.run_copy(d)
        shutil.rmtree(run / "checkpoints")
        return ["resume", str(run)]

    @add("ownership", "a live patch with no job running",
         check=lambda d: "a patch was queued for a later job" if (d / "run" / "control").exists() else None)
    def _(d):
        return ["reconfigure", str(w.run_copy(d)), "--set", "mixture.add=2"]

    @add("ownership", "--resume together with --overwrite")
    def _(d):
        return ["train", str(w.recipe), "--resume", str(w.run_copy(d)), "--overwrite"]

    @add("ownership", "--overwrite keeps files that are not the run's", want_rc=0,
         check=lambda d: None if (d / "run" / "notes.txt").exists() else "a user file was deleted")
    def _(d):
        run = w.run_copy(d)
        (run / "notes.txt").write_text("mine")
        return ["train", str(w.recipe), "--run-dir", str(run), "--overwrite"]

    # -- paths ----------------------------------------------------------------------------------------------
    for bad in ("../escape", "/etc/abs", "a/b"):
        add("paths", f"run.name {bad!r}")(lambda d, bad=bad: ["validate", str(w.recipe), "--set", f"run.name={bad}"])

    for odd in ("q?x=1", "pct%41", "hash#frag"):
        add("paths", f"run directory named {odd!r}", want_rc=0,
            check=lambda d, odd=odd: None if (d / odd / "trajectories.db").is_file() else "the store is not in the run directory",
            )(lambda d, odd=odd: ["train", str(w.recipe), "--run-dir", str(d / odd)])

    add("paths", "store.url that is not a URL")(
        lambda d: ["train", str(w.recipe), "--run-dir", str(d / "r"), "--set", "store.url=::not a url::"])

    # -- validation -------------------------------------------------------------------------------------------
    add("validation", "KV pool smaller than one sequence")(
        lambda d: ["validate", str(w.recipe), "--set", "engine.num_blocks=1"])
    add("validation", "max_prompt_tokens leaves no room")(
        lambda d: ["validate", str(w.recipe), "--set", "engine.max_prompt_tokens=48"])

    @add("validation", "YAML alias bomb", timeout=60)
    def _(d):
        rows = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
        (d / "bomb.yaml").write_text("\n".join(rows) + "\n")
        return ["validate", str(d / "bomb.yaml")]

    @add("validation", "a 2 MB recipe", timeout=60)
    def _(d):
        (d / "big.yaml").write_text("run: {name: x}\n" + "# pad\n" * 400_000)
        return ["validate", str(d / "big.yaml")]

    add("validation", "negative learning rate")(
        lambda d: ["validate", str(w.recipe), "--set", "stages.0.optim.lr=-1"])
    add("validation", "unknown recipe key")(lambda d: ["validate", str(w.recipe), "--set", "engine.max_batch=4"])

    @add("validation", "dataset row without its answer")
    def _(d):
        (d / "x.jsonl").write_text('{"q": "1+1="}\n')
        return ["validate", str(w.recipe_with(d, datasets=[{"type": "jsonl", "name": "x", "path": str(d / "x.jsonl"),
                                                            "prompt": "q", "answer": "a", "verifier": "exact"}]))]

    @add("validation", "empty dataset file")
    def _(d):
        (d / "x.jsonl").write_text("")
        return ["validate", str(w.recipe_with(d, datasets=[{"type": "jsonl", "name": "x", "path": str(d / "x.jsonl"),
                                                            "prompt": "q", "answer": "a", "verifier": "exact"}]))]

    add("validation", "model.init that does not exist")(
        lambda d: ["validate", str(w.recipe), "--set", f"model.init={d / 'nothing'}"])

    # -- errors -------------------------------------------------------------------------------------------------
    add("errors", "rl eval --max-problems -1000")(lambda d: ["eval", str(w.run_copy(d)), "--max-problems", "-1000"])
    add("errors", "malformed --set of a live patch")(lambda d: ["reconfigure", str(w.run_copy(d)), "--set", "mixture"])
    add("errors", "unknown subcommand")(lambda d: ["frobnicate"])

    @add("errors", "export into a non-empty directory")
    def _(d):
        (d / "out").mkdir()
        (d / "out" / "x").write_text("keep")
        return ["export", str(w.run_copy(d)), "--out", str(d / "out")]

    @add("errors", "garbage weights in every checkpoint",
         check=lambda d: None if _rows(d / "run", "train_steps") == 2 else "train steps rolled back")
    def _(d):
        run = w.run_copy(d)
        for ck in (run / "checkpoints").glob("step-*"):
            (ck / "model.safetensors").write_bytes(b"garbage")
        return ["resume", str(run)]

    @add("errors", "rl db upgrade of a file that is not a store")
    def _(d):
        (d / "f.db").write_bytes(b"not sqlite at all" * 10)
        return ["db", "upgrade", str(d / "f.db")]

    # -- readers ------------------------------------------------------------------------------------------------
    def unchanged(d: Path) -> str | None:
        return None if digest(d / "run" / "trajectories.db") == (d / "db.digest").read_text() else "a reader changed the store"

    def reader_case(name: str, argv: Callable[[Path], list[str]], want_rc: int, corrupt: bytes | None = None):
        def setup(d):
            run = w.run_copy(d)
            if corrupt is not None:
                (run / "trajectories.db").write_bytes(corrupt)
                for side in ("trajectories.db-wal", "trajectories.db-shm"):
                    (run / side).unlink(missing_ok=True)
            (d / "db.digest").write_text(digest(run / "trajectories.db"))
            return argv(run)
        cases.append(Case("readers", name, setup, want_rc, unchanged))

    reader_case("rl traj ls on a good store", lambda r: ["traj", "ls", str(r)], 0)
    reader_case("rl traj ls on a garbage file", lambda r: ["traj", "ls", str(r)], 2, b"garbage" * 100)
    reader_case("rl traj ls on an empty file", lambda r: ["traj", "ls", str(r)], 2, b"")
    reader_case("rl eval on a good run", lambda r: ["eval", str(r), "--max-problems", "2"], 0)
    return cases


def run_case(w: World, case: Case, d: Path) -> dict:
    d.mkdir(parents=True)
    w.held = None
    argv = case.setup(d)
    t0 = time.monotonic()
    try:
        proc = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=case.timeout, cwd=ROOT)
        rc, err, hang = proc.returncode, proc.stderr, False
    except subprocess.TimeoutExpired as e:
        rc, err, hang = None, (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or ""), True
    finally:
        if w.held is not None:
            w.held.release()
    lines = [line for line in err.strip().splitlines() if line.strip() and not line.startswith(("warning:", "wandb"))]
    out = {"kind": case.kind, "name": case.name, "rc": rc, "want_rc": case.want_rc, "seconds": round(time.monotonic() - t0, 1),
           "hang": hang, "traceback": "Traceback" in err,
           "one_line_error": rc == 2 and len(lines) == 1,
           "foreign_code": [c for c in case.canaries if (d / c).exists()],
           "data_loss": case.check(d) if case.check is not None and not hang else None,
           "stderr": lines[-1][:160] if lines else ""}
    out["wrong_exit"] = rc != case.want_rc or (case.want_rc == 2 and not out["one_line_error"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the same matrix (it is quick already: ~2-3 min on 2 cores)")
    ap.add_argument("--keep", type=Path, help="keep the scratch directories here")
    args = ap.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="abuse-"))
    root.mkdir(parents=True, exist_ok=True)
    w = World(root)
    results = []
    for i, case in enumerate(build_cases(w)):
        r = run_case(w, case, root / f"case{i:02d}")
        results.append(r)
        bad = r["hang"] or r["traceback"] or r["foreign_code"] or r["data_loss"] or r["wrong_exit"]
        print(f"{'FAIL' if bad else 'ok  '} {r['kind']:<13}{r['name'][:58]:<60} rc={r['rc']} {r['seconds']:>5}s  {r['stderr'][:90]}",
              flush=True)
    if args.keep is None:
        shutil.rmtree(root, ignore_errors=True)
    n = len(results)
    print(f"RESULT cases={n} kinds={len({r['kind'] for r in results})} "
          f"one_line_errors={sum(r['one_line_error'] for r in results)} tracebacks={sum(r['traceback'] for r in results)} "
          f"hangs={sum(r['hang'] for r in results)} data_loss={sum(bool(r['data_loss']) for r in results)} "
          f"foreign_code_ran={sum(bool(r['foreign_code']) for r in results)} wrong_exit={sum(r['wrong_exit'] for r in results)}")


if __name__ == "__main__":
    main()
