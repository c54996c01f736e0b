"""The cases of bench/abuse.py, by kind. Each is a function of its scratch directory `d` that builds what it needs
there and returns the `rl` arguments (or a `Call`), with the exit code it wants and what must hold afterwards.

Kinds (issue #13's first six, then issue #40's):
  foreign_code  poisoned pickles, a run-directory module named as a verifier, a tokenizer's remote code
  ownership     a run directory in use, a finished run, checkpoints deleted, a patch with no job running
  paths         run names that are paths, directory names that break URLs, store URLs
  validation    values that validate but could not run, YAML bombs, bad datasets and checkpoints
  errors        usage errors and broken files: one line, exit 2, no traceback
  readers       `rl traj` / `rl eval` on good and bad stores: the store's bytes never change
  writes        outputs that would replace or write through what the command does not own: `--out` a run
                directory, a non-empty directory, `.`, a symlink; symlinks planted in a fresh run directory
  nonfinite     NaN and infinities in recipes, `--set`, patches and command-line floats; a run that diverges;
                weights that are not finite
  patches       live patches to a running job: refused with one line, the job lives on, a resume never
                re-applies a refused patch
  reward_code   user `python:` reward functions that exit, hang, fork, flood or return garbage
  identity      a copied run directory resumed against a shared store
  spins         inputs that used to end in a traceback, a recursion error or minutes of work: long prompts,
                hostile chat templates, deep JSON, huge models at validation, 64-bit overflows, a silent database
  sandbox       a sandbox server against hostile clients: disk quota, damaged state, frame budget, foreign ids
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from abuse import CLI, ROOT, Call, Case, digest

VERIFIER_DATA = [{"q": f"{a}+{b}=", "a": str(a + b)} for a in range(10) for b in range(6)]


def _rows(run: Path, table: str, db: Path | None = None) -> int:
    with sqlite3.connect(f"file:{db or run / 'trajectories.db'}?mode=ro", uri=True) as c:
        return c.execute(f"select count(*) from {table}").fetchone()[0]


def _steps(run: Path, db: Path | None = None) -> int:
    try:
        return _rows(run, "train_steps", db)
    except sqlite3.Error:
        return 0


def _rl(*args, cwd=ROOT, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **(env or {})})


def build_cases(w) -> list[Case]:
    cases: list[Case] = []

    def add(kind, name, want_rc=2, check=None, canaries=(), should_end_s=120.0, may_write=None, one_line=True):
        def deco(fn):
            kw = {} if may_write is None else {"may_write": may_write}
            cases.append(Case(kind, name, fn, want_rc, check, list(canaries), should_end_s, one_line=one_line, **kw))
            return fn
        return deco

    # == issue #13 ===================================================================================================
    # -- foreign code -----------------------------------------------------------------------------------------------
    @add("foreign_code", "format-1 controller.pkl payload in the newest checkpoint", canaries=["canary-pkl"])
    def _(d):
        from tests.payloads import pickle_payload

        run = w.run_copy(d)
        ck = sorted((run / "checkpoints").glob("step-*"))[-1]
        bad = ck.parent / "step-00000099-000"
        shutil.copytree(ck, bad)
        (bad / "controller.pkl").write_bytes(pickle_payload(d / "canary-pkl"))
        (bad / "MANIFEST.json").write_text(json.dumps({"format": 1, "global_step": 99, "files": {}}))
        return ["resume", str(run)]

    @add("foreign_code", "trainer.pt payload planted beside a checkpoint (never read)", want_rc=0, canaries=["canary-pt"])
    def _(d):
        from tests.payloads import pickle_payload

        run = w.run_copy(d)
        for ck in (run / "checkpoints").glob("step-*"):
            (ck / "trainer.pt").write_bytes(pickle_payload(d / "canary-pt"))
        return ["resume", str(run)]

    @add("foreign_code", "controller.json replaced by a pickle under a rewritten manifest", want_rc=0,
         canaries=["canary-json"])
    def _(d):
        from tests.payloads import pickle_payload

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

    @add("foreign_code", "GGUF model.init with an absurd header count")
    def _(d):
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

    # -- ownership --------------------------------------------------------------------------------------------------
    @add("ownership", "a second job on a run directory in use",
         check=lambda d: None if (d / "run" / "run.json").read_text() == (d / "run.json.before").read_text() else "run.json changed")
    def _(d):
        from rl.checkpoint.run_dir import RunLock

        run = w.run_copy(d)
        shutil.copy(run / "run.json", d / "run.json.before")
        w.held[str(d)] = RunLock(run).acquire()  # released after the case
        return ["resume", str(run)]

    @add("ownership", "rl train into a finished run",
         check=lambda d: None if _rows(d / "run", "train_steps") == 2 else "train steps lost")
    def _(d):
        return ["train", str(w.recipe), "--run-dir", str(w.run_copy(d))]

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

    # -- paths ------------------------------------------------------------------------------------------------------
    for bad in ("../escape", "/etc/abs", "a/b"):
        add("paths", f"run.name {bad!r}")(lambda d, bad=bad: ["validate", str(w.recipe), "--set", f"run.name={bad}"])

    for odd in ("q?x=1", "pct%41", "hash#frag"):
        add("paths", f"run directory named {odd!r}", want_rc=0, may_write=(odd,),
            check=lambda d, odd=odd: None if (d / odd / "trajectories.db").is_file() else "the store is not in the run directory",
            )(lambda d, odd=odd: ["train", str(w.recipe), "--run-dir", str(d / odd)])

    add("paths", "store.url that is not a URL")(
        lambda d: ["train", str(w.recipe), "--run-dir", str(d / "r"), "--set", "store.url=::not a url::"])

    # -- validation -------------------------------------------------------------------------------------------------
    add("validation", "KV pool smaller than one sequence")(
        lambda d: ["validate", str(w.recipe), "--set", "engine.num_blocks=1"])
    add("validation", "max_prompt_tokens leaves no room")(
        lambda d: ["validate", str(w.recipe), "--set", "engine.max_prompt_tokens=48"])

    @add("validation", "YAML alias bomb", should_end_s=50)
    def _(d):
        rows = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
        (d / "bomb.yaml").write_text("\n".join(rows) + "\n")
        return ["validate", str(d / "bomb.yaml")]

    @add("validation", "a 2 MB recipe", should_end_s=50)
    def _(d):
        (d / "big.yaml").write_text("run: {name: x}\n" + "# pad\n" * 400_000)
        return ["validate", str(d / "big.yaml")]

    add("validation", "negative learning rate")(lambda d: ["validate", str(w.recipe), "--set", "stages.0.optim.lr=-1"])
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

    # -- errors -----------------------------------------------------------------------------------------------------
    add("errors", "rl eval --max-problems -1000")(lambda d: ["eval", str(w.run_copy(d)), "--max-problems", "-1000"])
    add("errors", "malformed --set of a live patch")(lambda d: ["reconfigure", str(w.run_copy(d)), "--set", "mixture"])
    add("errors", "unknown subcommand")(lambda d: ["frobnicate"])

    @add("errors", "export into a non-empty directory", may_write=())
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

    # -- readers ----------------------------------------------------------------------------------------------------
    def reader_case(name: str, argv: Callable[[Path], list[str]], want_rc: int, corrupt: bytes | None = None):
        def setup(d):
            run = w.run_copy(d)
            if corrupt is not None:
                (run / "trajectories.db").write_bytes(corrupt)
                for side in ("trajectories.db-wal", "trajectories.db-shm"):
                    (run / side).unlink(missing_ok=True)
            return argv(run)
        # a reader writes nothing but SQLite's shared-memory index beside a WAL store: all else is hashed
        cases.append(Case("readers", name, setup, want_rc, may_write=("run/trajectories.db-shm", "run/trajectories.db-wal")))

    reader_case("rl traj ls on a good store", lambda r: ["traj", "ls", str(r)], 0)
    reader_case("rl traj ls on a garbage file", lambda r: ["traj", "ls", str(r)], 2, b"garbage" * 100)
    reader_case("rl traj ls on an empty file", lambda r: ["traj", "ls", str(r)], 2, b"")
    reader_case("rl traj show of an id past 64 bits", lambda r: ["traj", "show", str(r), "9" * 30], 2)
    reader_case("rl traj ls --step past 64 bits", lambda r: ["traj", "ls", str(r), "--step", "9" * 30], 2)
    reader_case("rl traj ls --limit past 64 bits", lambda r: ["traj", "ls", str(r), "--limit", "9" * 30], (0, 2))
    reader_case("rl eval on a good run (responses to stdout only)", lambda r: ["eval", str(r), "--max-problems", "2"], 0)

    _writes(w, add)
    _nonfinite(w, add)
    _patches(w, add)
    _reward_code(w, add)
    _identity(w, add)
    _spins(w, add)
    _sandbox(w, add)
    return cases


# == issue #40 =======================================================================================================
def _writes(w, add) -> None:
    """Class 1: writes that would destroy what the command does not own."""

    def unchanged_run(d: Path) -> str | None:
        return None if _rows(d / "run", "train_steps") == 2 and (d / "run" / "checkpoints").is_dir() else "the run was destroyed"

    @add("writes", "rl merge A B --out A (a run directory)", may_write=(), check=unchanged_run)
    def _(d):
        run = w.run_copy(d)
        return ["merge", str(run), str(run), "--out", str(run)]

    @add("writes", "rl merge --out a non-empty directory", may_write=())
    def _(d):
        (d / "out").mkdir()
        (d / "out" / "notes.txt").write_text("mine")
        return ["merge", str(w.base), str(w.base), "--out", str(d / "out")]

    @add("writes", "rl merge --out an empty directory", want_rc=0)
    def _(d):
        (d / "out").mkdir()
        return ["merge", str(w.base), str(w.base), "--out", str(d / "out")]

    @add("writes", "rl merge --out . (the working directory, not empty)", may_write=())
    def _(d):
        (d / "notes.txt").write_text("mine")
        return Call(["merge", str(w.base), str(w.base), "--out", "."], cwd=d)

    @add("writes", "rl merge --out a symlink to a directory elsewhere", may_write=())
    def _(d):
        (d / "out").symlink_to(w.outside / "dir")
        return ["merge", str(w.base), str(w.base), "--out", str(d / "out")]

    @add("writes", "rl merge --out a regular file", may_write=())
    def _(d):
        (d / "out").write_text("mine")
        return ["merge", str(w.base), str(w.base), "--out", str(d / "out")]

    @add("writes", "rl merge of a model directory that rl export wrote", want_rc=(0, 2), may_write=("out", "hf"))
    def _(d):
        r = _rl("export", str(w.base), "--out", str(d / "hf"))
        assert r.returncode == 0, r.stderr
        return ["merge", str(d / "hf"), str(w.base), "--out", str(d / "out")]

    @add("writes", "rl export --out the run directory itself", may_write=(), check=unchanged_run)
    def _(d):
        run = w.run_copy(d)
        return ["export", str(run), "--out", str(run)]

    @add("writes", "rl export --out a symlink to a directory elsewhere", may_write=())
    def _(d):
        (d / "out").symlink_to(w.outside / "dir")
        return ["export", str(w.base), "--out", str(d / "out")]

    @add("writes", "rl export --out a dangling symlink", may_write=())
    def _(d):
        (d / "out").symlink_to(w.outside / "made-by-export")
        return ["export", str(w.base), "--out", str(d / "out")]

    for planted in ("metrics.jsonl", "trajectories.db", "run.json", "recipe.yaml", "checkpoints", "control"):
        @add("writes", f"a symlink planted at run/{planted} before rl train", want_rc=(0, 2))
        def _(d, planted=planted):
            run = d / "run"
            run.mkdir()
            target = w.outside / "dir" if planted in ("checkpoints", "control") else w.outside / "precious.txt"
            (run / planted).symlink_to(target)
            return ["train", str(w.recipe), "--run-dir", str(run)]

    @add("writes", "a symlink planted at a checkpoint's step directory name", want_rc=(0, 2))
    def _(d):
        run = w.run_copy(d)
        newest = sorted((run / "checkpoints").glob("step-*"))[-1]
        step = int(newest.name.split("-")[1])
        (run / "checkpoints" / f"step-{step + 1:08d}-000").symlink_to(w.outside / "dir")
        return ["resume", str(run), "--set", f"stages.0.max_steps={step + 1}"]

    @add("writes", "rl models fetch --from with a symlink planted at DIR/.<file>.part", want_rc=(0, 2),
         should_end_s=180)
    def _(d):
        from model.registry import MODELS, model_path

        name = "smollm2-135m-instruct"
        src = model_path(name)
        (d / "out").mkdir()
        (d / "out" / f".{MODELS[name].filename}.part").symlink_to(w.outside / "precious.txt")
        return ["models", "fetch", name, "--from", str(src), "--dir", str(d / "out")]

    @add("writes", "rl eval --responses at a symlink to a file elsewhere", may_write=())
    def _(d):
        (d / "responses.jsonl").symlink_to(w.outside / "precious.txt")
        return ["eval", str(w.base), "--max-problems", "2", "--responses", str(d / "responses.jsonl")]

    @add("writes", "rl eval --responses at a directory", may_write=())
    def _(d):
        (d / "responses.jsonl").mkdir()
        (d / "responses.jsonl" / "x").write_text("keep")
        return ["eval", str(w.base), "--max-problems", "2", "--responses", str(d / "responses.jsonl")]

    @add("writes", "rl train --run-dir a regular file", may_write=())
    def _(d):
        (d / "run").write_text("mine")
        return ["train", str(w.recipe), "--run-dir", str(d / "run")]


def _nonfinite(w, add) -> None:
    """Class 3: non-finite numbers."""
    for key in ("stages.0.optim.lr", "stages.0.optim.grad_clip", "stages.0.clip_high", "eval.temperature",
                "runtime.worker_timeout_s"):
        for value in ("nan", "inf", "1e999", *(("-inf",) if key == "stages.0.optim.lr" else ())):
            add("nonfinite", f"--set {key}={value} on rl validate")(
                lambda d, key=key, value=value: ["validate", str(w.recipe), "--set", f"{key}={value}"])

    @add("nonfinite", "a NaN learning rate written into the recipe file")
    def _(d):
        return ["validate", str(w.recipe_with(d, stages__0__optim={"lr": float("nan")}))]

    for weights in (("nan", "1"), ("inf", "1"), ("1e308", "1e308"), ("0", "0"), ("-1", "1")):
        add("nonfinite", f"rl merge --weights {' '.join(weights)}", may_write=())(
            lambda d, weights=weights: ["merge", str(w.base), str(w.base), "--weights", *weights, "--out", str(d / "out")])

    add("nonfinite", "rl reconfigure --wait nan")(
        lambda d: ["reconfigure", str(w.run_copy(d)), "--set", "mixture.add=1", "--wait", "nan"])

    def last_checkpoint_finite(d: Path) -> str | None:
        from safetensors.torch import load_file

        cks = sorted((d / "run" / "checkpoints").glob("step-*"))
        if not cks:
            return None
        bad = [k for k, t in load_file(str(cks[-1] / "model.safetensors")).items() if not t.float().isfinite().all()]
        return f"the newest checkpoint {cks[-1].name} holds non-finite {bad[:3]}" if bad else None

    @add("nonfinite", "a finite learning rate that diverges (1e30): exit 5, the last good checkpoint kept",
         want_rc=5, check=last_checkpoint_finite)
    def _(d):
        # entropy_coef: a gradient even when every reward of the tiny task is 0 (all-zero advantages)
        return ["train", str(w.recipe_with(d, stages__0__max_steps=4, stages__0__entropy_coef=0.1,
                                           stages__0__optim={"lr": 1e30})),
                "--run-dir", str(d / "run")]

    def nan_weights_dir(d: Path) -> Path:
        return _edited_checkpoint(w, d / "nanmodel", lambda t: {**t, "lm_head.weight": t["lm_head.weight"].clone().fill_(float("nan"))})

    @add("nonfinite", "run.init_checkpoint whose weights are NaN", may_write=("run", "nanmodel"))
    def _(d):
        return ["train", str(w.recipe_with(d, run={**w.recipe_data()["run"], "init_checkpoint": str(nan_weights_dir(d))})),
                "--run-dir", str(d / "run")]

    @add("nonfinite", "model.init whose weights are NaN", may_write=("run", "nanmodel"))
    def _(d):
        return ["train", str(w.recipe), "--set", f"model.init={nan_weights_dir(d)}", "--run-dir", str(d / "run")]

    @add("nonfinite", "rl merge of a model whose weights are NaN", may_write=("out", "nanmodel"))
    def _(d):
        return ["merge", str(nan_weights_dir(d)), str(w.base), "--out", str(d / "out")]

    add("nonfinite", "rl traj ls --min-reward nan", may_write=())(
        lambda d: ["traj", "ls", str(w.base), "--min-reward", "nan"])
    add("nonfinite", "rl traj ls --max-reward inf", may_write=())(
        lambda d: ["traj", "ls", str(w.base), "--max-reward", "inf"])
    add("nonfinite", "--set stages.0.optim.betas=[.nan, 0.99]")(
        lambda d: ["validate", str(w.recipe), "--set", "stages.0.optim.betas=[.nan, 0.99]"])


def _live_job(w, d: Path, **patch) -> subprocess.Popen:
    """A GRPO job on the tiny recipe that runs until it is stopped, started in d/run; returns once it trains."""
    recipe = w.recipe_with(d, "live.yaml", stages__0__max_steps=100_000, **patch)
    return w.start_job(d, ["train", str(recipe), "--run-dir", str(d / "run")], ready=lambda: _steps(d / "run") >= 1)


def _job_alive(w, d: Path) -> str | None:
    jobs = w.jobs.get(str(d), [])
    if not jobs or jobs[0].poll() is not None:
        err = (d / "job.stderr").read_text()[-300:] if (d / "job.stderr").exists() else ""
        return f"the live job died (rc={jobs[0].returncode if jobs else None}): {err!r}"
    before = _steps(d / "run")
    deadline = time.monotonic() + 30
    while _steps(d / "run") <= before and time.monotonic() < deadline and jobs[0].poll() is None:
        time.sleep(0.2)
    return None if _steps(d / "run") > before else "the live job stopped training after the patch"


def _patches(w, add) -> None:
    """Class 2: live patches a running job refuses; the job lives on and a resume never re-applies them."""
    sets = {"mixture.add=nan": "a NaN mixture weight", "mixture.add=0": "every dataset weight 0",
            "mixture.add=-1": "a negative mixture weight", "mixture.nosuch=1": "a dataset that does not exist",
            "dataset_max_inflight.add=-3": "a negative cap",
            "dataset_max_inflight.add=1": "a cap below the group size (the job refuses it)", "frobnicate=1": "an unknown key",
            "teachers.add=ghost": "a teacher that does not exist (GRPO: no teachers)"}
    for kv, what in sets.items():
        add("patches", f"live patch: {what} ({kv})", check=lambda d: _job_alive(w, d), should_end_s=90)(
            lambda d, kv=kv: (_live_job(w, d), ["reconfigure", str(d / "run"), "--set", kv, "--wait", "60"])[1])

    @add("patches", "live patch file: YAML that is not a mapping", check=lambda d: _job_alive(w, d), should_end_s=90)
    def _(d):
        _live_job(w, d)
        (d / "p.yaml").write_text("- just\n- a list\n")
        return ["reconfigure", str(d / "run"), str(d / "p.yaml"), "--wait", "60"]

    @add("patches", "live patch file: an alias bomb", check=lambda d: _job_alive(w, d), should_end_s=90)
    def _(d):
        _live_job(w, d)
        rows = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
        (d / "p.yaml").write_text("\n".join(rows) + "\nmixture: {add: *a8}\n")
        return ["reconfigure", str(d / "run"), str(d / "p.yaml"), "--wait", "60"]

    @add("patches", "live patch: a teacher whose weights are damaged (add_teachers)", check=lambda d: _job_alive(w, d),
         should_end_s=90)
    def _(d):
        _live_job(w, d)
        bad = d / "badteacher"
        bad.mkdir()
        shutil.copy(w.base / "recipe.yaml", bad / "ignored.yaml")
        (bad / "config.json").write_text("{}")
        (bad / "model.safetensors").write_bytes(b"garbage")
        (d / "p.yaml").write_text(yaml.safe_dump({"add_teachers": [{"name": "bad", "path": str(bad)}],
                                                  "teachers": {"add": "bad"}}))
        return ["reconfigure", str(d / "run"), str(d / "p.yaml"), "--wait", "60"]

    @add("patches", "a good live patch is applied and the job lives on", want_rc=0, check=lambda d: _job_alive(w, d),
         should_end_s=90)
    def _(d):
        _live_job(w, d)
        return ["reconfigure", str(d / "run"), "--set", "dataset_max_inflight.add=2", "--wait", "60"]

    @add("patches", "resume after a refused patch does not re-apply it", want_rc=0, should_end_s=120)
    def _(d):
        job = _live_job(w, d)
        _rl("reconfigure", str(d / "run"), "--set", "mixture.add=0", "--wait", "60")
        job.send_signal(signal.SIGTERM)
        job.wait(timeout=60)
        return ["resume", str(d / "run"), "--set", f"stages.0.max_steps={_steps(d / 'run') + 2}"]


def _verifier_recipe(w, d: Path, body: str, **patch) -> Path:
    """The tiny recipe on a JSONL dataset scored by `python:evil_rewards:fn`, whose body is given (PYTHONPATH=d)."""
    (d / "evil_rewards.py").write_text(body)
    (d / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in VERIFIER_DATA))
    ds = [{"type": "jsonl", "name": "add", "path": str(d / "x.jsonl"), "prompt": "q", "answer": "a",
           "verifier": {"type": "python", "function": "evil_rewards:fn", "timeout_s": 2},
           "heldout": {"fraction": 0.1}}]
    return w.recipe_with(d, "rv.yaml", datasets=ds, **patch)


def _reward_code(w, add) -> None:
    """Class 4: user reward code that kills its child, hangs, forks, floods or returns garbage."""
    stops = {
        "calls sys.exit(3)": "import sys\ndef fn(t, a, r):\n    sys.exit(3)\n",
        "raises KeyboardInterrupt": "def fn(t, a, r):\n    raise KeyboardInterrupt\n",
        "calls os._exit(1)": "import os\ndef fn(t, a, r):\n    os._exit(1)\n",
        "kills itself with SIGKILL": "import os, signal\ndef fn(t, a, r):\n    os.kill(os.getpid(), signal.SIGKILL)\n",
        "returns a string": "def fn(t, a, r):\n    return 'yes'\n",
        "returns NaN": "def fn(t, a, r):\n    return float('nan')\n",
        "returns a malformed Verdict-like object": "class V:\n    reward = None\n    correct = 'x'\ndef fn(t, a, r):\n    return V()\n",
        "never returns (each call times out)": "import time\ndef fn(t, a, r):\n    time.sleep(3600)\n",
    }
    for what, body in stops.items():
        add("reward_code", f"a reward function that {what}: the job stops with one line", should_end_s=150,
            may_write=("run", "evil_rewards.py", "__pycache__"))(
            lambda d, body=body: Call(["train", str(_verifier_recipe(w, d, body, stages__0__max_steps=50)),
                                       "--run-dir", str(d / "run")], env={"PYTHONPATH": str(d)}))

    @add("reward_code", "a reward function that raises every call: each sample scores 0 with the error, the job finishes "
         "(README: a verifier that raises scores 0)", want_rc=0, should_end_s=150, may_write=("run", "__pycache__"))
    def _(d):
        body = "def fn(t, a, r):\n    raise ValueError('broken')\n"
        return Call(["train", str(_verifier_recipe(w, d, body, stages__0__max_steps=3)), "--run-dir", str(d / "run")],
                    env={"PYTHONPATH": str(d)})

    @add("reward_code", "a reward function that fails one call in three: the job finishes", want_rc=0,
         should_end_s=150, may_write=("run", "__pycache__"))
    def _(d):
        body = "import random\ndef fn(t, a, r):\n    if random.random() < 0.33:\n        raise ValueError('x')\n    return 1.0\n"
        return Call(["train", str(_verifier_recipe(w, d, body, stages__0__max_steps=3)), "--run-dir", str(d / "run")],
                    env={"PYTHONPATH": str(d)})

    @add("reward_code", "a reward function that prints 50 MiB a call: the job's output stays small", want_rc=0,
         should_end_s=150, may_write=("run", "__pycache__", "run.out"), check=lambda d: _small_output(d))
    def _(d):
        body = "import sys\ndef fn(t, a, r):\n    sys.stdout.write('x' * (50 << 20))\n    return 1.0\n"
        return Call(["sh", "-c", f"{' '.join(map(_q, CLI))} train {_q(str(_verifier_recipe(w, d, body, stages__0__max_steps=2)))} "
                     f"--run-dir {_q(str(d / 'run'))} > {_q(str(d / 'run.out'))} 2>&1"], rl=False,
                    env={"PYTHONPATH": str(d)})

    @add("reward_code", "a reward function that forks a process: nothing outlives the job", want_rc=0,
         should_end_s=150, may_write=("run", "__pycache__", "pids"), check=lambda d: _no_survivors(d))
    def _(d):
        body = (f"import subprocess\ndef fn(t, a, r):\n    p = subprocess.Popen(['sleep', '3600'])\n"
                f"    open({str(d / 'pids')!r}, 'a').write(f'{{p.pid}}\\n')\n    return 1.0\n")
        return Call(["train", str(_verifier_recipe(w, d, body, stages__0__max_steps=2)), "--run-dir", str(d / "run")],
                    env={"PYTHONPATH": str(d)})

    @add("reward_code", "SIGTERM while a reward function never returns: exit 3 within seconds", want_rc=3,
         should_end_s=150, may_write=("run", "__pycache__", "started"))
    def _(d):
        body = (f"import time\ndef fn(t, a, r):\n    open({str(d / 'started')!r}, 'w').close()\n"
                f"    time.sleep(3600)\n")
        recipe = _verifier_recipe(w, d, body, stages__0__max_steps=50)
        ds = yaml.safe_load(recipe.read_text())
        ds["datasets"][0]["verifier"]["timeout_s"] = 600
        recipe.write_text(yaml.safe_dump(ds))
        return Call([sys.executable, "-c", _TERM_WHEN_STARTED, str(d / "started"), *CLI, "train", str(recipe),
                     "--run-dir", str(d / "run")], rl=False, env={"PYTHONPATH": str(d)})


_TERM_WHEN_STARTED = """
import os, signal, subprocess, sys, time
flag, argv = sys.argv[1], sys.argv[2:]
p = subprocess.Popen(argv)
while not os.path.exists(flag) and p.poll() is None:
    time.sleep(0.1)
time.sleep(0.5)
t0 = time.monotonic()
p.send_signal(signal.SIGTERM)
try:
    rc = p.wait(timeout=10)
except subprocess.TimeoutExpired:
    p.kill()
    sys.exit(f"the job outlived its SIGTERM by 10 s")
print(f"exited {time.monotonic() - t0:.1f} s after SIGTERM", file=sys.stderr)
sys.exit(rc)
"""


def _q(s: str) -> str:
    import shlex

    return shlex.quote(s)


def _small_output(d: Path) -> str | None:
    size = (d / "run.out").stat().st_size if (d / "run.out").exists() else 0
    return None if size < (8 << 20) else f"the job printed {size >> 20} MiB"


def _no_survivors(d: Path) -> str | None:
    if not (d / "pids").exists():
        return "the reward function never ran"
    alive = [pid for pid in map(int, (d / "pids").read_text().split()) if Path(f"/proc/{pid}").exists()
             and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    return f"{len(alive)} processes the reward function forked outlived the job" if alive else None


def _identity(w, add) -> None:
    """Class 6: a copied run directory resumed against a shared store."""

    def shared_run(d: Path) -> tuple[Path, Path]:
        db = d / "shared" / "store.db"
        db.parent.mkdir()
        recipe = w.recipe_with(d, "shared.yaml", store={"url": f"sqlite:///{db}"})
        r = _rl("train", str(recipe), "--run-dir", str(d / "orig"))
        assert r.returncode == 0, r.stderr[-1000:]
        return recipe, db

    def fallen_behind_copy(d: Path) -> None:
        """d/orig trained to step 2 on the shared store, copied to d/copy, then resumed to step 4."""
        shared_run(d)
        shutil.copytree(d / "orig", d / "copy", ignore=shutil.ignore_patterns(".lock"))
        r = _rl("resume", str(d / "orig"), "--set", "stages.0.max_steps=4")
        assert r.returncode == 0, r.stderr[-1000:]

    def original_kept(d: Path) -> str | None:
        run_id = json.loads((d / "orig" / "run.json").read_text())["run_id"]
        with sqlite3.connect(f"file:{d / 'shared' / 'store.db'}?mode=ro", uri=True) as c:
            n = c.execute("select count(*) from train_steps where run_id = ?", (run_id,)).fetchone()[0]
        return None if n == 4 else f"the original run's train steps in the shared store went 4 -> {n}"

    @add("identity", "a copy that fell behind resumed against the shared store", may_write=("copy",),
         check=original_kept, should_end_s=60)
    def _(d):
        fallen_behind_copy(d)
        return ["resume", str(d / "copy"), "--set", "stages.0.max_steps=6"]

    @add("identity", "the same copy resumed with --new-identity", want_rc=0, may_write=("copy", "shared"),
         check=original_kept, should_end_s=60)
    def _(d):
        fallen_behind_copy(d)
        return ["resume", str(d / "copy"), "--new-identity", "--set", "stages.0.max_steps=6"]

    @add("identity", "a directory moved to another path resumes (same newest step)", want_rc=0,
         may_write=("moved", "shared"), should_end_s=60)
    def _(d):
        shared_run(d)
        shutil.move(d / "orig", d / "moved")
        return ["resume", str(d / "moved"), "--set", "stages.0.max_steps=3"]


def _spins(w, add) -> None:
    """Class 7: tracebacks, recursion errors and minutes of work where one line is due."""

    def long_prompt_recipe(d: Path) -> Path:
        rows = [{"q": "1+1=", "a": "2"}] * 3 + [{"q": "9" * 200 + "+1=", "a": "1" + "0" * 200}] + [{"q": "1+2=", "a": "3"}] * 5
        (d / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return w.recipe_with(d, datasets=[{"type": "jsonl", "name": "x", "path": str(d / "x.jsonl"), "prompt": "q",
                                           "answer": "a", "verifier": "exact"}])

    add("spins", "a prompt longer than max_prompt_tokens on rl validate")(
        lambda d: ["validate", str(long_prompt_recipe(d))])

    @add("spins", "a prompt longer than max_prompt_tokens on rl train: refused, the directory restartable",
         check=lambda d: _restartable(w, d), may_write=("run", "fixed.yaml"))
    def _(d):
        return ["train", str(long_prompt_recipe(d)), "--run-dir", str(d / "run")]

    def tokenizer_with_template(d: Path, template: str) -> Path:
        from tests.tiny_tokenizer import write_hf_dir

        tok = write_hf_dir(d / "tok")
        cfg = json.loads((tok / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template
        (tok / "tokenizer_config.json").write_text(json.dumps(cfg))
        (d / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in VERIFIER_DATA))
        return w.recipe_with(d, tokenizer={"type": "hf", "path": str(tok)},
                             model={**w.recipe_data()["model"], "vocab_size": 600},
                             datasets=[{"type": "jsonl", "name": "add", "path": str(d / "x.jsonl"), "prompt": "q",
                                        "answer": "a", "chat": True, "verifier": "exact"}])

    templates = {
        "a recursive macro": "{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}",
        "'x' * 3000000000": "{{ 'x' * 3000000000 }}",
        "a loop of 10^9 iterations": "{% for i in range(1000000000) %}x{% endfor %}",
        "7 ** 100000000": "{{ 7 ** 100000000 }}",
        "'%3000000000s' % 'x'": "{{ '%3000000000s' % 'x' }}",
        "doubling with ~ in a loop": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
        "a nested empty loop of 10^10": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "a template that raises": "{{ raise_exception('no') }}",
        "a template that is not Jinja": "{% for %}",
    }
    for what, template in templates.items():
        add("spins", f"a chat template with {what}", should_end_s=30, may_write=("tok", "r.yaml", "x.jsonl"))(
            lambda d, template=template: ["validate", str(tokenizer_with_template(d, template))])

    @add("spins", "a tokenizer.json nested 100,000 deep", should_end_s=30)
    def _(d):
        from tests.tiny_tokenizer import write_hf_dir

        tok = write_hf_dir(d / "tok")
        (tok / "tokenizer.json").write_text('{"model": ' + "[" * 100_000 + "]" * 100_000 + "}")
        return ["validate", str(w.recipe_with(d, tokenizer={"type": "hf", "path": str(tok)}))]

    @add("spins", "a model config.json nested 100,000 deep", should_end_s=30)
    def _(d):
        m = d / "model"
        m.mkdir()
        (m / "config.json").write_text('{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
        (m / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
        return ["validate", str(w.recipe), "--set", f"model.init={m}"]

    @add("spins", "a GGUF with an array nested 100,000 deep", should_end_s=30)
    def _(d):
        p = d / "deep.gguf"
        depth = 100_000
        kv = struct.pack("<Q", 3) + b"key" + struct.pack("<I", 9)  # GGUF_TYPE_ARRAY
        kv += (struct.pack("<IQ", 9, 1)) * depth + struct.pack("<IQ", 4, 0)
        p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv)
        return ["validate", str(w.recipe), "--set", f"model.init={p}"]

    @add("spins", "rl validate of 20,000 layers (no model is built)", want_rc=(0, 2), should_end_s=15)
    def _(d):
        return ["validate", str(w.recipe), "--set", "model.num_layers=20000"]

    import torch

    garbage = {
        "a tensor of the wrong shape": lambda t: {**t, "lm_head.weight": torch.zeros(3, 5)},
        "an int32 tensor": lambda t: {**t, "lm_head.weight": t["lm_head.weight"].to(torch.int32)},
        "a missing tensor": lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"},
        "a truncated file": None,
    }
    for what, edit in garbage.items():
        @add("spins", f"run.init_checkpoint with {what}", may_write=("run", "ck"))
        def _(d, edit=edit):
            ck = _edited_checkpoint(w, d / "ck", edit)
            if edit is None:
                f = ck / "model.safetensors"
                f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
            return ["train", str(w.recipe_with(d, run={**w.recipe_data()["run"], "init_checkpoint": str(ck)})),
                    "--run-dir", str(d / "run")]

    @add("spins", "rl eval --checkpoint of another vocabulary")
    def _(d):
        from tests.tiny_tokenizer import write_hf_dir

        tok = write_hf_dir(d / "tok")
        other = w.recipe_with(d, "other.yaml", tokenizer={"type": "hf", "path": str(tok)},
                              model={**w.recipe_data()["model"], "vocab_size": 600})
        r = _rl("train", str(other), "--run-dir", str(d / "r2"))
        assert r.returncode == 0, r.stderr[-1000:]
        ck = sorted((d / "r2" / "checkpoints").glob("step-*"))[-1]
        return ["eval", str(w.run_copy(d)), "--checkpoint", str(ck), "--max-problems", "2"]

    @add("spins", "a PostgreSQL URL whose server accepts and never answers", should_end_s=45)
    def _(d):
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        port = srv.getsockname()[1]
        held = []
        threading.Thread(target=lambda: [held.append(srv.accept()) for _ in range(16)], daemon=True).start()
        (d / "port").write_text(str(port))
        return ["train", str(w.recipe), "--run-dir", str(d / "run"), "--set",
                f"store.url=postgresql+psycopg://u:p@127.0.0.1:{port}/db"]

    @add("spins", "Ctrl-C during start-up: one line, no traceback", want_rc=(3, 130))
    def _(d):
        return Call(["train", str(w.recipe), "--run-dir", str(d / "run")], signal_after=(signal.SIGINT, 1.5))


def _edited_checkpoint(w, dst: Path, edit) -> Path:
    """A copy of the base run's newest checkpoint at `dst`, its tensors passed through `edit` (None: unchanged)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(sorted((w.base / "checkpoints").glob("step-*"))[-1], dst)
    if edit is not None:
        save_file(edit(load_file(str(dst / "model.safetensors"))), str(dst / "model.safetensors"))
    return dst


def _restartable(w, d: Path) -> str | None:
    fixed = w.recipe_with(d, "fixed.yaml")
    r = _rl("train", str(fixed), "--run-dir", str(d / "run"))
    return None if r.returncode == 0 else f"the same command with a fixed recipe failed: {r.stderr.strip()[-200:]}"


_HOSTILE = """
import sys
from pathlib import Path
from sandbox_client.hostile import HostWorld, run_case
with HostWorld(Path(sys.argv[2])) as world:
    o = run_case(sys.argv[1], world)
print(f"{o.case}: {'contained' if o.contained else 'NOT CONTAINED'} {o.reason} {o.detail}"[:300], file=sys.stderr)
sys.exit(0 if o.contained else 1)
"""


def _sandbox(w, add) -> None:
    """Class 5: a sandbox server against hostile clients (sandbox_client/hostile.py's cases, each against a server
    of its own) and `rl sandbox serve` against a damaged state directory."""
    for name in ("fill_disk", "foreign_sandbox", "frame_flood", "damaged_state", "write_outside_workdir",
                 "planted_symlink", "huge_output", "reap_after_kill9"):
        add("sandbox", f"hostile client: {name}", want_rc=0, may_write=("sbx",), should_end_s=90)(
            lambda d, name=name: Call([sys.executable, "-c", _HOSTILE, name, str(d / "sbx")], rl=False))

    def serve(d: Path, **kw) -> Call:
        return Call(["sandbox", "serve", "--socket", str(d / "s.sock"), "--state-dir", str(d / "st")], **kw)

    @add("sandbox", "rl sandbox serve: the state directory's etc/ a symlink elsewhere", may_write=("s.sock", "st"))
    def _(d):
        (d / "st").mkdir()
        (d / "st" / "etc").symlink_to(w.outside / "dir")
        return serve(d, signal_after=(signal.SIGTERM, 20.0))

    @add("sandbox", "rl sandbox serve: the state directory a regular file", may_write=("s.sock",))
    def _(d):
        (d / "st").write_text("mine")
        return serve(d, signal_after=(signal.SIGTERM, 20.0))

    @add("sandbox", "rl sandbox serve: truncated and mismatched records in its state directory", want_rc=0,
         may_write=("s.sock", "st"), one_line=False)
    def _(d):
        live = d / "st" / "live"
        live.mkdir(parents=True)
        (live / "sb-00000000000a.json").write_text('{"id": "sb-00000000000a", "uid": 20')
        (live / "sb-00000000000b.json").write_text("[1, 2]")
        # (a record forged to name uid 0 or the root cgroup is tests/unit/test_sandbox_state.py's: here, should the
        # check ever regress, it would kill every process of the host)
        (live / "sb-00000000000c.json").write_text(json.dumps({"id": "sb-0000000000ff", "uid": 1234567}))
        return serve(d, signal_after=(signal.SIGTERM, 4.0))
