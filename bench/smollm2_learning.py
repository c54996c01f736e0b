"""Learning on a real model (issue #14 evidence): GRPO from SmolLM2-135M-Instruct next to an SFT control
that spends the same minutes from the same start, then OPD in which the GRPO-trained model teaches the
original one.

    python bench/smollm2_learning.py --phase arms [--minutes 7] [--out runs/smollm2-bench]   # both arms at once
    python bench/smollm2_learning.py --phase opd  [--minutes 6]   [--out runs/smollm2-bench]   # after the arms
    python bench/smollm2_learning.py --quick                       # CPU, one step of each: the plumbing only
    python bench/smollm2_learning.py --phase arms --arm sft_grpo=sft_grpo [--sft-share 0.7]   # + SFT, then GRPO
    python bench/smollm2_learning.py --phase arms --arm split=sft_grpo_split   # the same on two halves of the file
    python bench/smollm2_learning.py --phase arms --arm fresh=sft_grpo_fresh   # SFT on the file, GRPO on other questions

`arms` runs `rl train configs/smollm2_grpo.yaml` and `rl train configs/smollm2_sft.yaml` at the same time,
one per GPU when there are two (CUDA_VISIBLE_DEVICES=0 and 1), each for --minutes; `opd` runs
`rl train configs/smollm2_opd.yaml` with the GRPO run as its teacher. Every run evaluates its start and its
end greedily on the same held-out problems (eval.before_training), with math-verify on the final answer, and
reports the share of responses with an answer and the share cut at the length limit. A phase reads the
runs already under --out, so the last line covers every run there:
RESULT init_acc=.. grpo_acc=.. sft_acc=.. opd_acc=.. opd_gap_closed=.. answered_init=.. answered_grpo=..
truncated_init=.. truncated_grpo=.. grpo_rollout_tok_s=.. grpo_train_tok_s=.. grpo_train_split_acc=..
sft_train_split_acc=.. (greedy on 256 training problems, `rl eval --set`) grpo_last_rollout_acc=..
grpo_dropped_stale_groups=.. grpo_rollout_s=.. grpo_train_s=.. grpo_engine_s=.. (of the rollout: the workers' calls) grpo_worker_gap_s=.. (the workers' waits between calls) grpo_verify_s=.. grpo_reward_wait_s=.. grpo_reward_waits=.. grpo_store_s=.. grpo_store_writer_s=.. grpo_dispatch_s=.. grpo_checkpoint_s=..
grpo_engine_steps=.. grpo_prefill_calls=.. grpo_uniform_groups_skipped=.. ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]
RECIPES = {"grpo": "configs/smollm2_grpo.yaml", "sft": "configs/smollm2_sft.yaml", "opd": "configs/smollm2_opd.yaml",
           "sft_grpo": "configs/smollm2_sft_grpo.yaml", "sft_grpo_split": "configs/smollm2_sft_grpo_split.yaml",
           "sft_grpo_fresh": "configs/smollm2_sft_grpo_fresh.yaml"}
"""The arms' recipes. `sft_grpo` (SFT, then GRPO, splitting the minutes by --sft-share) and `sft_grpo_split` (the
same, SFT on the first half of the training file and GRPO on the other half) and `sft_grpo_fresh` (SFT on the
whole file, GRPO on the RL prompt file's other questions) run only as an --arm."""
TWO_STAGES = ("sft_grpo", "sft_grpo_split", "sft_grpo_fresh")
QUICK = ["run.device=cpu", "run.num_threads=1", "runtime.ray=false", "stages.0.max_steps=1", "eval.max_problems=2",
         "engine.max_new_tokens=16", "engine.max_batch_size=8", "logging.wandb=false", "checkpoint.every_steps=0"]
QUICK_STAGE = {"grpo": ["stages.0.prompts_per_step=2", "stages.0.group_size=2", "stages.0.micro_batch_size=4",
                        "stages.0.dispatch.max_inflight=4"],
               "sft": ["stages.0.batch_size=4"]}
QUICK_STAGE["opd"] = QUICK_STAGE["grpo"]
# the quick GRPO stage without dynamic sampling: its 16-token answers all score 0, every group would be filtered
# and the stage would end at its minutes with no step
QUICK_STAGE["sft_grpo"] = QUICK_STAGE["sft"] + [k.replace("stages.0.", "stages.1.") for k in QUICK_STAGE["grpo"]] + [
    "stages.1.max_steps=1", "stages.1.dynamic_sampling=false"]
QUICK_STAGE["sft_grpo_split"] = QUICK_STAGE["sft_grpo_fresh"] = QUICK_STAGE["sft_grpo"]


def _launch(arm: str, out: Path, minutes: float, quick: bool, gpu: int | None, extra: list[str] = (),
            base: str | None = None, sft_share: float = 0.4) -> subprocess.Popen:
    base = base or arm
    budget = ([f"stages.0.max_minutes={minutes * sft_share:.3g}", f"stages.1.max_minutes={minutes * (1 - sft_share):.3g}"]
              if base in TWO_STAGES else [f"stages.0.max_minutes={minutes}"])  # the same minutes in all, split
    sets = [*budget, "logging.progress_bar=false", *extra]
    if quick:
        sets += QUICK + QUICK_STAGE[base]
    if arm == "opd":
        sets.append(f"stages.0.teachers.teachers.0.checkpoint={out / 'grpo'}")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    log = open(out / f"{arm}.log", "w")
    cmd = [*CLI, "train", RECIPES[base], "--run-dir", str(out / arm), *[a for s in sets for a in ("--set", s)]]
    print(f"[{arm}] {' '.join(cmd[3:])}" + ("" if gpu is None else f"  (GPU {gpu})"), flush=True)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait(procs: dict[str, subprocess.Popen], out: Path) -> None:
    """Wait for every run; the first failure stops the others and exits with its log's tail."""
    while procs:
        for arm, p in list(procs.items()):
            if p.poll() is None:
                continue
            del procs[arm]
            if p.returncode != 0:
                for q in procs.values():
                    q.terminate()
                tail = (out / f"{arm}.log").read_text()[-3000:]
                sys.exit(f"{arm} run failed (exit {p.returncode}):\n{tail}")
        time.sleep(1)


TRAIN_FILE, TEST_FILE = ROOT / "configs/data/word_problems_train.jsonl", ROOT / "configs/data/word_problems_test.jsonl"
RL_FILE = ROOT / "configs/data/word_problems_rl.jsonl"  # the `sft_grpo_fresh` arm's GRPO prompts
TRAIN_SPLIT = ["--set", f"datasets.0.heldout.path={TRAIN_FILE}"]


def responses_evals(out: Path, arms: list[str], gpus: int, quick: bool) -> None:
    """`rl eval --responses` of each arm's final checkpoint, greedy, on the held-out problems (ARM/heldout.jsonl) and
    on the first problems of its *training* file (ARM/train.jsonl, summary in ARM/train_eval.txt): next to the run's
    own score the first tells the run's bf16 evaluation from a float32 one and where the answers go wrong (per
    kind); the second tells a generalisation gap (train high, held-out low) from a training reward that over-states
    the policy (both low)."""
    procs = []
    for i, arm in enumerate(arms):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(i % gpus)
        for name, sets in (("heldout", []), ("train", TRAIN_SPLIT)):
            cmd = [*CLI, "eval", str(out / arm), *sets, "--max-problems", "2" if quick else "256",
                   "--responses", str(out / arm / f"{name}.jsonl")]
            if quick:
                cmd += ["--set", "run.device=cpu"]
            log = out / arm / ("train_eval.txt" if name == "train" else "heldout_eval.txt")
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT))
    for p in procs:
        p.wait()


def _kinds(path: Path) -> tuple[list[str], dict[str, str]]:
    """Kind of each row of a word-problem file (by row number, 1-based) and by question text."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return ["", *(r.get("kind", "?") for r in rows)], {r["question"]: r.get("kind", "?") for r in rows}


def per_kind(run_dir: Path) -> dict[str, dict[str, float]]:
    """Accuracy per problem kind: greedy held-out and train (`rl eval --responses` files) and the run's rollouts over
    its last 10 train steps (the store), with the sample counts."""
    out: dict[str, dict[str, float]] = {}

    def add(kind: str, col: str, correct: bool) -> None:
        d = out.setdefault(kind, {})
        d[col] = d.get(col, 0.0) + float(correct)
        d[f"n_{col}"] = d.get(f"n_{col}", 0) + 1
    for col, path, src in (("heldout", run_dir / "heldout.jsonl", TEST_FILE), ("train", run_dir / "train.jsonl", TRAIN_FILE)):
        if path.is_file():
            by_row, _ = _kinds(src)
            for line in path.read_text().splitlines():
                r = json.loads(line)
                add(by_row[r["row_number"]], col, r["correct"])
    db = run_dir / "trajectories.db"
    if db.is_file():
        import re
        import sqlite3

        by_text = {**_kinds(TRAIN_FILE)[1], **_kinds(RL_FILE)[1]}
        with sqlite3.connect(db) as c:
            last = c.execute("select max(train_step) from samples").fetchone()[0]
            rows = c.execute("select prompt_text, correct from samples where train_step > ?", ((last or 0) - 10,)).fetchall()
        for text, correct in rows:
            m = re.search(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", text, re.S)
            add(by_text.get(m.group(1).strip(), "?") if m else "?", "rollout", bool(correct))
    for d in out.values():
        for col in ("heldout", "train", "rollout"):
            if d.get(f"n_{col}"):
                d[col] /= d[f"n_{col}"]
    return out


def _eval_acc(run_dir: Path, name: str) -> float:
    path = run_dir / f"{name}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return sum(r["correct"] for r in rows) / len(rows) if rows else float("nan")


def summarize(run_dir: Path) -> dict[str, float] | None:
    """Start and end evaluation, steps, minutes and mean throughputs of a finished run (metrics.jsonl)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval/accuracy" in r]
    if len(evals) < 2 or evals[0]["step"] != 0:
        return None

    def mean(key: str) -> float:
        vals = [r[key] for r in rows if key in r and r.get("step", 0) > 0]
        return sum(vals) / len(vals) if vals else float("nan")
    first, last = evals[0], evals[-1]
    return {"init_acc": first["eval/accuracy"], "acc": last["eval/accuracy"],
            "answered_init": first["eval/answered"], "answered": last["eval/answered"],
            "truncated_init": first["eval/truncated"], "truncated": last["eval/truncated"],
            "num_problems": sum(v for k, v in last.items() if k.endswith("/num_problems")),
            "steps": last["step"], "minutes": (rows[-1]["time"] - rows[0]["time"]) / 60 if "time" in rows[0] else float("nan"),
            "rollout_tok_s": mean("rollout/tokens_per_s"), "train_tok_s": mean("train/tokens_per_s"),
            "response_len": last.get("eval/wp/response_len", float("nan")),
            "train_split_acc": _eval_acc(run_dir, "train"), "rl_eval_acc": _eval_acc(run_dir, "heldout"),
            "last_rollout_acc": _tail_mean(rows, "rollout/accuracy"),
            "dropped_stale_groups": last_value(rows, "dispatch/dropped_stale_groups"),
            "rollout_s": last_value(rows, "time/rollout_s"), "train_s": last_value(rows, "time/train_s"),
            "engine_s": last_value(rows, "time/engine_s"), "worker_gap_s": last_value(rows, "time/worker_gap_s"),
            "engine_steps": last_value(rows, "rollout/engine_steps_total"),
            "verify_s": last_value(rows, "time/verify_s"), "reward_wait_s": last_value(rows, "time/reward_wait_s"),
            "reward_waits": last_value(rows, "rollout/reward_waits_total"), "store_s": last_value(rows, "time/store_s"),
            "store_writer_s": last_value(rows, "time/store_writer_s"),
            "dispatch_s": last_value(rows, "time/dispatch_s"), "checkpoint_s": last_value(rows, "time/checkpoint_s"),
            "prefill_calls": last_value(rows, "rollout/prefill_calls_total"),
            "uniform_groups_skipped": last_value(rows, "train/uniform_groups_skipped_total"),
            "stage_accs": [e["eval/accuracy"] for e in evals[1:]]}


def last_value(rows: list[dict], key: str) -> float:
    return next((r[key] for r in reversed(rows) if key in r), float("nan"))


def _tail_mean(rows: list[dict], key: str, n: int = 10) -> float:
    vals = [r[key] for r in rows if key in r][-n:]
    return sum(vals) / len(vals) if vals else float("nan")


def report(out: Path, arms: dict[str, str]) -> str:
    runs = {arm: s for arm in arms if (s := summarize(out / arm)) is not None}
    print(f"\n{'run':<6}{'steps':>6}{'min':>6}{'acc start':>10}{'acc end':>9}{'answered':>14}{'truncated':>14}"
          f"{'rollout tok/s':>14}{'train tok/s':>12}")
    for arm, s in runs.items():
        print(f"{arm:<6}{s['steps']:>6}{s['minutes']:>6.1f}{s['init_acc']:>10.3f}{s['acc']:>9.3f}"
              f"{s['answered_init']:>7.2f}->{s['answered']:<5.2f}{s['truncated_init']:>7.2f}->{s['truncated']:<5.2f}"
              f"{s['rollout_tok_s']:>14.0f}{s['train_tok_s']:>12.0f}")
    result = {}
    base = runs.get("grpo") or next(iter(runs.values()), None)
    if base is not None:
        result.update(init_acc=base["init_acc"], answered_init=base["answered_init"], truncated_init=base["truncated_init"],
                      num_problems=int(base["num_problems"]))
    for arm, s in runs.items():
        print(f"{arm}: greedy accuracy on 256 training problems {s['train_split_acc']:.3f} (held-out {s['acc']:.3f}, "
              f"{s['rl_eval_acc']:.3f} by `rl eval` of the final checkpoint); "
              f"rollout accuracy over the last 10 steps {s['last_rollout_acc']:.3f}; groups dropped as stale "
              f"{s['dropped_stale_groups']}; rollout {s['rollout_s']:.0f} s (of which engine calls {s['engine_s']:.0f} s, the workers waiting between calls {s['worker_gap_s']:.1f} s, "
              f"verdicts {s['verify_s']:.0f} s ({s['reward_wait_s']:.0f} s in {s['reward_waits']:.0f} waits for a batch), store {s['store_s']:.0f} s (its writer thread {s['store_writer_s']:.0f} s beside), new prompts {s['dispatch_s']:.0f} s, "
              f"{s['engine_steps']:.0f} engine steps, {s['prefill_calls']:.0f} prefills), periodic checkpoints {s['checkpoint_s']:.0f} s, train {s['train_s']:.0f} s "
              f"(groups with equal rewards left out: {s['uniform_groups_skipped']:.0f})")
        result.update({f"{arm}_train_split_acc": s["train_split_acc"], f"{arm}_rl_eval_acc": s["rl_eval_acc"]})
        if len(s["stage_accs"]) > 1:  # several stages (sft_grpo): the held-out accuracy at the end of each
            print(f"{arm}: held-out accuracy at the end of each stage " + " -> ".join(f"{a:.3f}" for a in s["stage_accs"]))
            result.update({f"{arm}_stage{i}_acc": a for i, a in enumerate(s["stage_accs"])})
        if arms[arm] != "sft":
            result.update({f"{arm}_last_rollout_acc": s["last_rollout_acc"], f"{arm}_dropped_stale_groups": s["dropped_stale_groups"],
                           f"{arm}_rollout_s": s["rollout_s"], f"{arm}_train_s": s["train_s"],
                           f"{arm}_engine_s": s["engine_s"], f"{arm}_worker_gap_s": s["worker_gap_s"], f"{arm}_engine_steps": s["engine_steps"],
                           f"{arm}_verify_s": s["verify_s"], f"{arm}_reward_wait_s": s["reward_wait_s"],
                           f"{arm}_reward_waits": s["reward_waits"], f"{arm}_store_s": s["store_s"], f"{arm}_store_writer_s": s["store_writer_s"],
                           f"{arm}_dispatch_s": s["dispatch_s"], f"{arm}_checkpoint_s": s["checkpoint_s"],
                           f"{arm}_prefill_calls": s["prefill_calls"],
                           f"{arm}_uniform_groups_skipped": s["uniform_groups_skipped"]})
        result.update({f"{arm}_acc": s["acc"], f"answered_{arm}": s["answered"], f"truncated_{arm}": s["truncated"],
                       f"{arm}_steps": s["steps"], f"{arm}_rollout_tok_s": s["rollout_tok_s"], f"{arm}_train_tok_s": s["train_tok_s"]})
    kinds = {arm: per_kind(out / arm) for arm in runs}
    (out / "per_kind.json").write_text(json.dumps(kinds, indent=1))
    names = sorted({k for d in kinds.values() for k in d})
    if names:
        print("\naccuracy per kind: held-out greedy / train greedy / rollouts of the last 10 steps")
        print(f"{'kind':<16}" + "".join(f"{arm:>22}" for arm in kinds))
        for k in names:
            cells = [kinds[arm].get(k, {}) for arm in kinds]
            print(f"{k:<16}" + "".join(f"{c.get('heldout', float('nan')):>8.2f}{c.get('train', float('nan')):>7.2f}"
                                       f"{c.get('rollout', float('nan')):>7.2f}" for c in cells))
    if "grpo" in runs and "opd" in runs:
        gap = runs["grpo"]["acc"] - runs["opd"]["init_acc"]
        result["opd_gap_closed"] = (runs["opd"]["acc"] - runs["opd"]["init_acc"]) / gap if gap > 0 else float("nan")
    return "RESULT " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", choices=["arms", "opd", "all"], default="all")
    ap.add_argument("--minutes", type=float, default=None, help="stage budget of each run (default: 7 arms, 6 opd)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "smollm2-bench")
    ap.add_argument("--quick", action="store_true", help="CPU, one step per run: checks the plumbing, not learning")
    ap.add_argument("--set", action="append", default=[], metavar="ARM:KEY=VALUE",
                    help="a recipe override for one arm (grpo, sft, opd or an --arm), e.g. grpo:stages.0.optim.lr=2e-5")
    ap.add_argument("--arm", action="append", default=[], metavar="NAME=BASE",
                    help="one more arm run at once with the others, from BASE's recipe (grpo, sft or sft_grpo: SFT, then "
                         "GRPO) and its own --set overrides, e.g. --arm grpo_std=grpo --set grpo_std:stages.0.std_normalize=true")
    ap.add_argument("--sft-share", type=float, default=0.7,
                    help="a two-stage arm's share of --minutes for its SFT stage (the rest for GRPO; default 0.7, "
                         "BENCHMARKS.md runs W and X; runs R-V used 0.4)")
    ap.add_argument("--only", action="append", default=[], metavar="ARM",
                    help="run only this arm in the arms phase (repeatable); the report still reads every run under --out")
    args = ap.parse_args()
    if not 0 < args.sft_share < 1:
        ap.error(f"--sft-share {args.sft_share}: expected a share strictly between 0 and 1")
    arms = {arm: arm for arm in ("grpo", "sft", "opd")}
    for item in args.arm:
        name, sep, base = item.partition("=")
        if not sep or base not in ("grpo", "sft", *TWO_STAGES) or not name.isidentifier() or name in arms:
            ap.error(f"--arm {item!r}: expected NAME=BASE with a new NAME and BASE one of grpo, sft, {', '.join(TWO_STAGES)}")
        arms[name] = base
    bad = [a for a in args.only if a not in arms or a == "opd"]
    if bad:
        ap.error(f"--only {bad[0]!r}: expected an arm of the arms phase ({', '.join(a for a in arms if a != 'opd')})")
    extra: dict[str, list[str]] = {arm: [] for arm in arms}
    for item in args.set:
        arm, sep, override = item.partition(":")
        if arm not in arms or not sep:
            ap.error(f"--set {item!r}: expected ARM:KEY=VALUE with ARM one of {', '.join(arms)}")
        extra[arm].append(override)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    import torch

    gpus = torch.cuda.device_count() if not args.quick else 0
    if args.phase in ("arms", "all"):
        minutes = args.minutes or (0.5 if args.quick else 7.0)
        at_once = [a for a in arms if a != "opd" and (not args.only or a in args.only)]
        procs = {arm: _launch(arm, out, minutes, args.quick, (i % gpus) if gpus else None, extra[arm], arms[arm], args.sft_share)
                 for i, arm in enumerate(at_once)}
        _wait(procs, out)
        responses_evals(out, at_once, gpus, args.quick)
    if args.phase in ("opd", "all"):
        minutes = args.minutes or (0.5 if args.quick else 6.0)
        _wait({"opd": _launch("opd", out, minutes, args.quick, 0 if gpus else None, extra["opd"])}, out)
        responses_evals(out, ["opd"], gpus, args.quick)  # the student's per-kind table and `rl eval` score too
    print(report(out, arms), flush=True)


if __name__ == "__main__":
    main()
