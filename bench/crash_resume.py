"""Crash-resume benchmark: kill -9 a CPU training run at random moments, restart it each time, and check
that nothing is lost and nothing is trained twice (issue: resume after preemption).

Kill moments mix external SIGKILLs at random times with fail points inside the process
(`ASYNCRL_FAULT`, rl/faults.py): in the middle of a checkpoint write (files written, manifest not yet)
and in the train phase (optimizer step taken, store not yet told). After every restart the script
checks: the resume found a loadable checkpoint (or started over when none was complete), the
checkpoint step never goes backwards, and the store's audit shows no sample consumed by two train
steps and every trained sample linked to its step. At the end: every dispatched prompt has an outcome
(trained, discarded, dropped), the trained samples equal those of an uninterrupted run (`lost` counts
the reference's trained samples missing from the crashed run), and the held-out accuracies are compared.
Before the last restart a SIGTERM measures signal-to-exit time (`sigterm_exit_s`, process exit included;
`sigterm_checkpoint_s`, the driver's own signal-to-checkpoint-written time) and the restart before it the
resume-to-first-token time (`resume_first_token_s`, from process start, imports included); when the kills
left the crashed run nothing to generate, both are measured on a fresh run instead.

    python bench/crash_resume.py --quick          # tiny recipe, 10 kills, under a minute on 2 CPU cores
    python bench/crash_resume.py --kills 12 --recipe configs/quickstart.yaml --set ...

Last line: RESULT kills=<n> lost=<n> trained_twice=<n> sigterm_exit_s=<x> ...
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rl.store.trajectories import TrajectoryStore, recorded_train_steps  # noqa: E402

CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]
TINY = {
    "run": {"name": "crash", "seed": 0, "num_threads": 1},
    "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
              "max_position_embeddings": 128,
              "ffn": {"type": "moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}},
    "datasets": [{"type": "arithmetic", "name": "arith", "max_digits": 2, "slip_rate": 0.7, "num_heldout": 32}],
    "engine": {"max_batch_size": 32, "max_seq_len": 96, "max_new_tokens": 48},
    "runtime": {"ray": False},
    "stages": [{"type": "sft", "max_steps": 40, "batch_size": 16, "optim": {"lr": 3e-3}},
               {"type": "grpo", "max_steps": 12, "prompts_per_step": 4, "group_size": 4, "micro_batch_size": 8,
                "steps_per_call": 4, "dispatch": {"policy": "sample", "max_inflight": 24, "max_version_lag": 2}}],
    "checkpoint": {"every_steps": 3, "keep_last": 2},
    "logging": {"wandb": False, "progress_bar": False},
}


class Proc:
    """A `rl` subprocess whose stdout lines are timestamped as they arrive."""

    def __init__(self, args: list[str], env: dict | None = None):
        self.t0 = time.monotonic()
        self.p = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, cwd=ROOT)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.p.stdout:
            self.lines.append((time.monotonic() - self.t0, line.rstrip()))

    def wait(self, timeout: float = 600) -> int:
        rc = self.p.wait(timeout=timeout)
        self._reader.join(timeout=5)
        return rc

    def first(self, pattern: str) -> tuple[float, str] | None:
        return next(((t, l) for t, l in self.lines if re.search(pattern, l)), None)


def trained(run_dir: Path) -> dict[str, tuple]:
    with sqlite3.connect(f"{run_dir}/trajectories.db") as c:
        return {r[0]: r[1:] for r in c.execute(
            "select sample_id, response_tokens, behavior_logprobs, train_step from samples where train_step is not null")}


def final_acc(p: Proc) -> float | None:
    hit = p.first(r"^RESULT ")
    m = hit and re.search(r"grpo_acc=([0-9.]+)", hit[1])
    return float(m.group(1)) if m else None


def measure_sigterm(recipe: Path, run_dir: Path, sets: list[str]) -> dict:
    """A fresh run: SIGTERM after its first GRPO step, then resume until the first new token (then stop it)."""
    p = Proc(["train", str(recipe), "--run-dir", str(run_dir), *sets])
    while recorded_train_steps(run_dir) < 1 and p.p.poll() is None:
        time.sleep(0.05)
    t_sig = time.monotonic()
    p.p.send_signal(signal.SIGTERM)
    rc = p.wait()
    exit_s = time.monotonic() - t_sig
    hit = p.first(r"written ([0-9.]+) s after the signal")
    written = float(re.search(r"written ([0-9.]+) s", hit[1]).group(1)) if hit else float("nan")
    states = sum(1 for _ in (run_dir / "checkpoints").glob("step-*/inflight-w*.msgpack"))
    q = Proc(["resume", str(run_dir), *sets])
    while q.first(r"resume: first new token") is None and q.p.poll() is None:
        time.sleep(0.02)
    tok = q.first(r"resume: first new token")
    q.p.send_signal(signal.SIGKILL)
    q.wait()
    for _, line in p.lines[-3:] + q.lines[:6]:
        print(line)
    return {"exit_s": exit_s, "written": written, "rc": rc, "first_token_s": tok[0] if tok else float("nan"),
            "inflight_files": states}


def sigterm_only(recipe: Path, work: Path, sets: list[str]) -> None:
    """SIGTERM after the first GRPO step, then resume until the first new token (then stop it)."""
    m = measure_sigterm(recipe, work / "sigterm", sets)
    print(f"RESULT sigterm_exit_s={m['exit_s']:.2f} sigterm_checkpoint_s={m['written']} sigterm_rc={m['rc']} "
          f"resume_first_token_s={m['first_token_s']:.2f} inflight_files={m['inflight_files']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny recipe, 10 kills (under a minute on CPU)")
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--recipe", help="recipe YAML (default: a tiny in-process recipe)")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-delay", type=float, default=None,
                    help="latest external kill, seconds after start-up (default: 2, or half the reference run)")
    ap.add_argument("--out", help="write the figures as JSON here")
    ap.add_argument("--sigterm-only", action="store_true",
                    help="only measure SIGTERM-to-exit and resume-to-first-token (e.g. on the quickstart recipe)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="crash_resume-"))
    recipe = Path(args.recipe) if args.recipe else work / "tiny.yaml"
    if not args.recipe:
        recipe.write_text(yaml.safe_dump(TINY))
    sets = [x for kv in args.overrides for x in ("--set", kv)]
    if args.sigterm_only:
        return sigterm_only(recipe, work, sets)

    # 1. the uninterrupted reference
    ref_dir = work / "reference"
    ref = Proc(["train", str(recipe), "--run-dir", str(ref_dir), *sets])
    assert ref.wait() == 0, "\n".join(l for _, l in ref.lines[-20:])
    ref_seconds = ref.lines[-1][0]
    ref_trained = trained(ref_dir)
    max_delay = args.max_delay or (2.0 if args.quick else ref_seconds / 2)

    # 2. kill -9 at random moments, restarting each time (fail points included)
    run_dir = work / "crashed"
    kinds = ["checkpoint_write", "checkpoint_write", "train", "train"] + ["external"] * max(0, args.kills - 4)
    rng.shuffle(kinds)
    kills, resumed_steps, problems, started, completed = 0, [], [], False, False
    for kind in kinds:
        cmd = ["resume", str(run_dir), *sets] if started else ["train", str(recipe), "--run-dir", str(run_dir), *sets]
        env = {"ASYNCRL_FAULT": f"{kind}:{rng.randint(1, 2)}"} if kind != "external" else {}
        p = Proc(cmd, env)
        started = True
        if kind == "external":  # a random moment after start-up (rollout, train, store or checkpoint writes)
            while p.first(r"^run dir ") is None and p.p.poll() is None:
                time.sleep(0.01)
            try:
                p.p.wait(timeout=rng.uniform(0.0, max_delay))
            except subprocess.TimeoutExpired:
                p.p.send_signal(signal.SIGKILL)
        rc = p.wait()
        hit = p.first(r"^resume: (step-(\d+)|no complete checkpoint)")
        if hit is not None and hit[1].startswith("resume: step-"):
            resumed_steps.append(int(re.search(r"step-(\d+)", hit[1]).group(1)))
        elif cmd[0] == "resume" and rc != -signal.SIGKILL:
            problems.append(f"restart after kill {kills}: no resume line (status {rc})")
        if rc == -signal.SIGKILL:
            kills += 1
        elif rc != 0:
            problems.append(f"run ended with status {rc}: " + " | ".join(l for _, l in p.lines[-3:]))
        audit = TrajectoryStore.for_run_dir(run_dir).audit() if (run_dir / "trajectories.db").exists() else None
        if audit and (audit["trained_twice"] or audit["link_mismatch"]):
            problems.append(f"after kill {kills}: {audit}")
        print(f"{kind:17s} status={rc:4d}  resumed from step {resumed_steps[-1] if resumed_steps else '-':>4}  "
              f"audit={audit}", flush=True)
        if rc == 0:
            completed = True
            break
    monotone = all(a <= b for a, b in zip(resumed_steps, resumed_steps[1:]))

    # 3. SIGTERM once more (if the run is not over), then finish: signal-to-exit, resume-to-first-token
    sigterm_exit_s = first_token_s = written_s = float("nan")
    rc_term = None
    if not completed:
        p = Proc(["resume", str(run_dir), *sets])
        while p.first(r"resume: first new token") is None and p.p.poll() is None:
            time.sleep(0.02)
        first_token_s = p.first(r"resume: first new token")[0] if p.first(r"resume: first new token") else first_token_s
        t_sig = time.monotonic()
        p.p.send_signal(signal.SIGTERM)
        rc_term = p.wait()
        sigterm_exit_s = time.monotonic() - t_sig
        hit = p.first(r"written ([0-9.]+) s after the signal")
        written_s = float(re.search(r"written ([0-9.]+) s", hit[1]).group(1)) if hit else written_s
    if first_token_s != first_token_s:  # the kills left nothing to generate: measure the signal on a fresh run
        m = measure_sigterm(recipe, work / "sigterm", sets)
        sigterm_exit_s, written_s, rc_term, first_token_s = m["exit_s"], m["written"], m["rc"], m["first_token_s"]
    final = Proc(["resume", str(run_dir), *sets])
    assert final.wait() == 0, "\n".join(l for _, l in final.lines[-20:])
    audit = TrajectoryStore.for_run_dir(run_dir).audit()
    got = trained(run_dir)
    lost = sum(1 for k in ref_trained if k not in got)
    differ = sum(1 for k in ref_trained if k in got and got[k] != ref_trained[k])
    acc_ref, acc_crashed = final_acc(ref), final_acc(final)
    # staleness bound right after every recovery: no train step (before or after a restart) trained a
    # token older than max_version_lag versions
    lags = [json.loads(l).get("async/max_version_lag") for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    max_lag = max((x for x in lags if x is not None), default=0)

    figures = {"kills": kills, "lost": lost, "trained_twice": audit["trained_twice"], "sigterm_exit_s": round(sigterm_exit_s, 2),
               "sigterm_checkpoint_s": written_s, "sigterm_rc": rc_term, "resume_first_token_s": round(first_token_s, 2), "differing_samples": differ,
               "link_mismatch": audit["link_mismatch"], "prompts_without_outcome": audit["prompts_open"],
               "steps_monotone": int(monotone), "max_version_lag_seen": max_lag, "acc_uninterrupted": acc_ref, "acc_crashed": acc_crashed,
               "problems": len(problems)}
    for line in problems:
        print("PROBLEM", line)
    print(json.dumps(figures, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))
    print("RESULT " + " ".join(f"{k}={v}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
