"""The seed's post-training pipeline on SmolLM2-135M-Instruct (issue #43, seed §5.2.4): domain specialists, then one
student distilled on-policy from 40+ teachers, against a multi-task GRPO baseline of the same data.

    python bench/pipeline_smollm2.py --phase specialists --out /tmp/pipe   # call 1: the specialists, at once
    python bench/pipeline_smollm2.py --phase final --out /tmp/pipe         # call 2: OPD (from the instruct model and
                                                                           # from `rl merge` of the specialists) and
                                                                           # the multi-task baseline, at once
    python bench/pipeline_smollm2.py --phase report --out /tmp/pipe        # call 3: every model on every domain
    python bench/pipeline_smollm2.py --quick                               # CPU: a miniature of all three phases
    python bench/pipeline_smollm2.py --smoke --no-ray                      # CPU: the same few steps on the real
                                                                           # SmolLM2: a rehearsal before a GPU run
    python bench/pipeline_smollm2.py --no-ray --out /tmp/pipe              # the H200 (no Ray there): every phase in
                                                                           # one process, ~20 minutes (BENCHMARKS.md)
    bash tools/remote/start.sh python3 bench/pipeline_smollm2.py --no-ray --out /tmp/pipe    # the same, detached on a
    bash tools/remote/poll.sh 540 /tmp/pipe                                # machine lent call by call; then poll

Specialists (configs/pipeline/): `wp` word problems (math-verify), `compute` questions answered through Python calls
that the job's sandbox runs, `extract` structured output (JSON against a schema), `effort` the word problems with
reasoning effort (seed §5.1.4), and `extract_l20`: the extract recipe on a SmolLM2 cut to its first 20 of 30 layers
(`model.num_layers`), a teacher of another architecture. Each keeps the weights of its earlier checkpoints
(`checkpoint.keep_weights`): the teachers of the final stage are the specialists and those snapshots.

The final stage's data is the domains split into sub-datasets (`final_datasets`): the word problems by kind and by
half of the training file (20), the computation questions by kind (9), the extraction texts by kind, with and
without a distractor (20): 49 sub-datasets, each scored by its own teacher (`assign_teachers`: a domain's final
checkpoint first, then its snapshots newest first; one extraction sub-dataset by the 20-layer model), at most 8
teachers on the device at once (`teachers.device_memory_mib`). The effort specialist is reported on its own (its
levels are a recipe-wide setting; the final stage trains without effort prefixes). The baseline is one GRPO run on
the same sub-datasets from the instruct model, with the specialists' SFT data first and as many trained samples as
the specialists' GRPO stages and the OPD stage together.

The report scores every model on each domain's held-out problems (greedy, `rl eval` of the specialist's run with
`--checkpoint`: the domain's own prompts and tools), with a 95% Wilson interval, the answered and truncated shares
and the mean response length, and the effort specialist's accuracy and length per level. Last line:
RESULT specialist_gain_min=<points> opd_gap_closed_min=<f> opd_over_baseline=<points> effort_len_ratio=<r> ...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from smollm2_learning import CLI, _wait as wait  # noqa: E402 - every run to its end, the first failure stops the rest
WP_TRAIN, WP_EVAL = "configs/data/word_problems_train.jsonl", "configs/data/word_problems_eval.jsonl"
WP_KINDS = ("plain_add", "plain_sub", "apples_add", "apples_sub", "money_add", "money_sub", "distance_add",
            "distance_sub", "boxes_mul", "share_two_step")
DOMAINS = ("wp", "compute", "extract")
"""The domains of the final stage and of the baseline (effort: reported on its own)."""
SPECIALISTS = {"wp": "configs/pipeline/word_problems.yaml", "compute": "configs/pipeline/compute.yaml",
               "extract": "configs/pipeline/extract.yaml", "effort": "configs/pipeline/word_problems_effort.yaml",
               "extract_l20": "configs/pipeline/extract.yaml", "compute_notool": "configs/pipeline/compute.yaml"}
"""The specialists' recipes; `extract_l20` the extract recipe on a SmolLM2 cut to 20 layers (a teacher of another
architecture), `compute_notool` the compute recipe without tools (the control of the tool-use specialist: the same
questions and minutes, answered from the model's head)."""
EFFORT_LEVELS = (10, 40, 70, 100)
TEACHER_MIB = 8 * 300
"""The device's teacher budget: 8 SmolLM2-135M teachers in bf16 (~270 MB each) at once."""


def load(path: str | Path) -> dict:
    return yaml.safe_load((ROOT / path).read_text())


MACHINE: dict = {}
"""What this machine needs of every recipe (`main`): Ray or not, the sandbox backend."""


def write(recipe: dict, path: Path) -> Path:
    if MACHINE.get("no_ray"):
        recipe = {**recipe, "runtime": {**recipe.get("runtime", {}), "ray": False}}
        recipe["runtime"].pop("num_cpus", None)
        recipe["runtime"].pop("num_workers", None)
    if "sandbox" in recipe and MACHINE.get("sandbox_backend"):
        recipe["sandbox"] = {**recipe["sandbox"], "backend": MACHINE["sandbox_backend"]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def miniature(recipe: dict) -> dict:
    """--quick: the recipe on a tiny random char-level model on CPU, a few steps a stage, no Ray. --smoke: the same
    few steps on the recipe's own model (SmolLM2 in float32 on CPU): a rehearsal of every phase before a GPU run."""
    r = json.loads(json.dumps(recipe))
    r["run"] = {"name": recipe["run"]["name"], "seed": 0, "device": "cpu", "num_threads": 1}
    if MACHINE.get("smoke"):
        r["run"]["dtype"] = "float32"
        r["engine"] = {**recipe["engine"], "max_batch_size": 8, "max_new_tokens": min(recipe["engine"]["max_new_tokens"], 48)}
    else:
        r["model"] = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
                      "max_position_embeddings": 640, "ffn": {"type": "dense", "intermediate_size": 64}}
        r["tokenizer"] = "char"
        r["engine"] = {"max_batch_size": 8, "block_size": 16, "max_seq_len": 600, "max_new_tokens": 24}
    r["runtime"] = {"ray": False}
    r["eval"] = {"max_problems": 2, "before_training": True}
    r["logging"] = {"wandb": False, "progress_bar": False}
    r["checkpoint"] = {**r.get("checkpoint", {}), "every_steps": 1, "keep_last": 1}
    for s in r["stages"]:
        s.update(max_steps=2, max_minutes=1)
        if s["type"] == "sft":
            s["batch_size"] = 4
        else:
            s.update(prompts_per_step=1, group_size=2, micro_batch_size=8, dynamic_sampling=False)
            s["dispatch"] = {"policy": "sample", "max_inflight": 8, "max_version_lag": 2}
            if s["type"] == "opd":
                # one tiny teacher at a time (two SmolLM2s in --smoke): switching
                s["teachers"] = {**s["teachers"], "device_memory_mib": 600 if MACHINE.get("smoke") else 1}
    if "effort" in r:  # two levels, one sample each: a group of 2
        r["effort"] = {**r["effort"], "levels": [10, 100], "samples_per_level": 1}
    for d in r["datasets"]:
        if d.get("type") == "custom":
            d["args"] = {**d.get("args", {}), "num_heldout": 4}
    return r


SNAPSHOTS = {"wp": 19, "compute": 8, "extract": 18, "effort": 0, "extract_l20": 0, "compute_notool": 0}
"""Earlier checkpoints' weights each specialist keeps: with its final model, one teacher per sub-dataset of its domain
(20, 9, 20 less the 20-layer model's one); ~0.54 GB each (the H200 run: 57 GB on disk at the specialists' end, 15.5
GB of it pruned before the final stage, `prune_specialists`)."""


def specialist_recipe(name: str, quick: bool, every_steps: int) -> dict:
    r = load(SPECIALISTS[name])
    if name == "extract_l20":
        r["run"]["name"] = "pipeline-extract-l20"
        r["model"]["num_layers"] = 20  # the first 20 of SmolLM2's 30 layers: another architecture
        # its SFT repairs a model missing a third of its layers, not a format: the recipe's 25 steps left it at 0.000
        # (every answer truncated) on the H200; the SFT minutes bind instead
        r["stages"][0]["max_steps"] = 2000
    if name == "compute_notool":
        r["run"]["name"] = "pipeline-compute-notool"
        del r["tools"], r["sandbox"]
        r["datasets"][0]["args"] = {**r["datasets"][0]["args"], "use_tool": False}
    keep_weights = min(SNAPSHOTS[name], 3) if quick else SNAPSHOTS[name]
    r["checkpoint"] = {**r.get("checkpoint", {}), "every_steps": every_steps, "keep_last": 1, "keep_weights": keep_weights}
    r["runtime"] = {**r["runtime"], "num_cpus": 2, "num_reward_workers": 2}  # six runs share the machine's cores
    if quick:
        r = miniature(r)
        r["checkpoint"]["keep_weights"] = keep_weights
        if name == "extract_l20" and not MACHINE.get("smoke"):
            r["model"]["num_layers"] = 1  # the miniature's other architecture: one layer where the others have two
    return r


# -- the final stage's data and teachers --------------------------------------------------------------------------
def final_datasets(quick: bool) -> tuple[list[dict], dict[str, str]]:
    """(dataset configs, dataset -> domain): the domains split into sub-datasets (module docstring)."""
    wp = load(SPECIALISTS["wp"])["datasets"][0]
    out, domain = [], {}
    for kind in WP_KINDS if not quick else ():
        for half in (0, 1):
            rows = {"max_rows": 2500} if half == 0 else {"skip_rows": 2500}
            out.append({**wp, "name": f"wp_{kind}_{half}", "where": {"kind": kind}, **rows})
            domain[out[-1]["name"]] = "wp"
    from rewards.compute import KINDS as COMPUTE_KINDS
    from rewards.extract import KINDS as EXTRACT_KINDS

    n_compute, n_extract = (2, 2) if quick else (len(COMPUTE_KINDS), len(EXTRACT_KINDS))
    held = 4 if quick else 112
    for kind in list(COMPUTE_KINDS)[:n_compute]:
        out.append({"type": "custom", "name": f"compute_{kind}", "task": "rewards.compute:ComputeTask",
                    "args": {"kinds": [kind], "use_tool": True, "num_heldout": held}})
        domain[out[-1]["name"]] = "compute"
    for kind in list(EXTRACT_KINDS)[:n_extract]:
        for distractor in (False, True):
            out.append({"type": "custom", "name": f"extract_{kind}{'_d' if distractor else ''}",
                        "task": "rewards.extract:ExtractTask",
                        "args": {"kinds": [kind], "distractor": distractor, "num_heldout": 4 if quick else 50}})
            domain[out[-1]["name"]] = "extract"
    return out, domain


def snapshots(run_dir: Path) -> list[Path]:
    """A specialist's models, best first: its newest checkpoint, then its kept weights newest first."""
    from rl.checkpoint.format import CheckpointManager

    newest = CheckpointManager(run_dir / "checkpoints", warn=lambda m: None).latest()
    kept = sorted((run_dir / "weights").glob("step-*"), reverse=True) if (run_dir / "weights").is_dir() else []
    return ([newest] if newest else []) + kept


def assign_teachers(out: Path, datasets: list[str], domain: dict[str, str]) -> list[dict]:
    """One teacher per sub-dataset: a domain's models in turn (snapshots), the first extraction sub-dataset the
    20-layer model's; more sub-datasets than models reuse the newest (named apart, so each sub-dataset has one)."""
    teachers, used = [], {}
    other = snapshots(out / "extract_l20")
    for name in datasets:
        d = domain[name]
        if d == "extract" and other and "extract_l20" not in used:
            used["extract_l20"] = 1
            teachers.append({"name": "extract_l20", "checkpoint": str(other[0]), "datasets": [name]})
            continue
        models = snapshots(out / d)
        if not models:
            raise SystemExit(f"no model of specialist {d!r} under {out / d}: run --phase specialists first")
        i = used.get(d, 0)
        used[d] = i + 1
        teachers.append({"name": f"{d}_{i:02d}", "checkpoint": str(models[min(i, len(models) - 1)]), "datasets": [name]})
    return teachers


def final_recipes(out: Path, quick: bool, minutes: float) -> dict[str, Path]:
    """The OPD recipe (from the instruct model and from the merged specialists) and the baseline's, written under
    out/recipes."""
    datasets, domain = final_datasets(quick)
    names = [d["name"] for d in datasets]
    base = load(SPECIALISTS["compute"])  # the SmolLM2 run settings, tools and sandbox (the compute sub-datasets call)
    base["datasets"] = datasets
    base["tools"] = {**base["tools"], "datasets": [n for n in names if domain[n] == "compute"]}  # the others: as trained
    # the two halves of a word-problem kind share their held-out problems: the run evaluates them once
    # the curves' held-out score, a few problems a sub-dataset (the report scores every model on all of them)
    base["eval"] = {**base["eval"], "max_problems": 20, "before_training": False,
                    "datasets": [n for n in names if not (domain[n] == "wp" and n.endswith("_1"))]}
    base["checkpoint"] = {"every_steps": 0, "keep_last": 1}  # the stage's end and SIGTERM's (disk: see prune_specialists)
    opd = json.loads(json.dumps(base))
    opd["run"]["name"] = "pipeline-opd"
    opd["stages"] = [{"type": "opd", "max_steps": 5000, "max_minutes": minutes, "prompts_per_step": 32, "group_size": 4,
                      "micro_batch_size": 128, "optim": {"lr": 1.0e-5, "grad_clip": 1.0}, "kl_weight": 1.0,
                      "rl_weight": 0.0, "steps_per_call": 4,
                      "dispatch": {"policy": "sample", "max_inflight": 256, "max_version_lag": 2},
                      "teachers": {"device_memory_mib": TEACHER_MIB, "dtype": "bfloat16",
                                   "teachers": assign_teachers(out, names, domain)}}]
    merged = json.loads(json.dumps(opd))
    merged["run"]["name"] = "pipeline-opd-merged"
    merged["model"]["init"] = str(out / "merged")
    from model.registry import resolve_model_source

    merged["tokenizer"] = {"type": "hf", "path": str(resolve_model_source(base["model"]["init"]))}  # a merge has none
    baseline = json.loads(json.dumps(base))
    baseline["run"]["name"] = "pipeline-baseline"
    # the specialists' SFT steps (batches of the same size) and their GRPO samples with the OPD stage's, which runs
    # beside it: as many again, about; both bounded by the stage's minutes, the OPD run's own (the SFT steps take
    # well under a minute; the report prints every count)
    samples = 2 * trained_samples(out)
    sft, grpo = load(SPECIALISTS["compute"])["stages"]
    baseline["stages"] = [{**sft, "max_minutes": 1.5, "max_steps": max(1, sft_steps(out))},
                          {**grpo, "max_minutes": max(minutes - 1, 0.5),
                           "max_steps": max(1, samples // (grpo["prompts_per_step"] * grpo["group_size"]))}]
    recipes = {"opd": opd, "opd_merged": merged, "baseline": baseline}
    if quick:
        recipes = {k: miniature(v) for k, v in recipes.items()}
        if not MACHINE.get("smoke"):
            recipes["opd_merged"]["model"] = {"init": str(out / "merged"), "max_position_embeddings": 640}
        for v in recipes.values():
            v["checkpoint"]["every_steps"] = 0
        recipes["opd"]["stages"][0]["max_steps"] = 60  # room for the live reconfiguration (a few seconds)
    return {k: write(v, out / "recipes" / f"{k}.yaml") for k, v in recipes.items()}


def sft_steps(out: Path, runs=DOMAINS) -> int:
    """SFT steps trained by these runs: the step of each run's evaluation at its SFT stage's end (the SFT stage logs
    every `log_every` steps, so its rows undercount)."""
    total = 0
    for name in runs:
        rows = _metrics(out / name)
        last = max((i for i, r in enumerate(rows) if "sft/loss" in r), default=None)
        if last is not None:
            total += next((r["step"] for r in rows[last:] if "eval/accuracy" in r), rows[last]["step"])
    return total


def trained_samples(out: Path, runs=DOMAINS) -> int:
    """Samples trained by these runs (their stores)."""
    import sqlite3

    n = 0
    for name in runs:
        db = out / name / "trajectories.db"
        if db.is_file():
            with sqlite3.connect(db) as c:
                n += c.execute("select count(*) from samples where train_step is not null").fetchone()[0]
    return n


# -- running -------------------------------------------------------------------------------------------------------
def launch(name: str, recipe: Path, out: Path) -> subprocess.Popen:
    cmd = [*CLI, "train", str(recipe), "--run-dir", str(out / name)]
    print(f"[{name}] rl {' '.join(cmd[3:])}", flush=True)
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            stdout=open(out / f"{name}.log", "w"), stderr=subprocess.STDOUT)


def phase_specialists(out: Path, quick: bool) -> None:
    procs = {}
    for name in SPECIALISTS:
        recipe = specialist_recipe(name, quick, every_steps=1 if quick else 20)
        if recipe:
            procs[name] = launch(name, write(recipe, out / "recipes" / f"{name}.yaml"), out)
    wait(procs, out)


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def _until(proc: subprocess.Popen, ready) -> bool:
    """Poll until ready() or the process ends; whether it is ready."""
    while proc.poll() is None and not ready():
        time.sleep(0.5)
    return proc.poll() is None


def opd_live(out: Path, run: str, recipe: Path, quick: bool, result: dict) -> None:
    """The OPD run's life, on a thread beside the others: train; once it has trained a step, reconfigure it live
    (the computation sub-datasets' weight raised in the mixture, the first extraction sub-dataset's teacher swapped
    for the extract specialist's final model, added live: `rl reconfigure`, in the store's config_versions and on the
    curves); once a step ran at the new config version, SIGTERM (a preemption: exit 3 with a checkpoint) and
    `rl resume` to its end. result["error"]: what went wrong, if anything."""
    run_dir = out / run
    proc = launch(run, recipe, out)
    if not _until(proc, lambda: any("opd/kl_loss" in r for r in _metrics(run_dir))):
        result["error"] = f"{run} ended (exit {proc.returncode}) before its first step"
        return
    datasets, domain = final_datasets(quick)
    first_extract = next(d["name"] for d in datasets if domain[d["name"]] == "extract")
    patch = {"mixture": {d["name"]: 2.0 for d in datasets if domain[d["name"]] == "compute"},
             "add_teachers": [{"name": "extract_swap", "checkpoint": str(snapshots(out / "extract")[0]), "datasets": []}],
             "teachers": {first_extract: "extract_swap"}}
    path = out / "recipes" / f"{run}-patch.yaml"  # a patch, not a recipe: none of write()'s machine settings
    path.write_text(yaml.safe_dump(patch, sort_keys=False))
    done = subprocess.run([*CLI, "reconfigure", str(run_dir), str(path)], cwd=ROOT, capture_output=True, text=True)
    print(f"[{run}] reconfigured live: exit {done.returncode} {done.stdout.strip()} {done.stderr.strip()}", flush=True)
    if done.returncode == 0 and _until(proc, lambda: any(r.get("config/version", 0) >= 1 and "opd/kl_loss" in r
                                                       for r in _metrics(run_dir))):
        proc.send_signal(signal.SIGTERM)
        code = proc.wait()
        result["preempted_at"] = max((r.get("step", 0) for r in _metrics(run_dir)), default=0)
        print(f"[{run}] SIGTERM after step {result['preempted_at']}: exit {code}", flush=True)
        if code != 3:
            result["error"] = f"{run} exited {code} on SIGTERM, not 3 (preempted with a checkpoint)"
            return
        cmd = [*CLI, "resume", str(run_dir)]
        print(f"[{run}] rl {' '.join(cmd[3:])}", flush=True)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                                stdout=open(out / f"{run}.log", "a"), stderr=subprocess.STDOUT)
    if proc.wait() != 0:
        result["error"] = f"{run} run failed (exit {proc.returncode}):\n{(out / f'{run}.log').read_text()[-3000:]}"


def prune_specialists(out: Path) -> None:
    """What the final stage and the report do not read: each specialist's Hugging Face exports and every checkpoint
    but its newest (the SFT stage's end; the scores of both stages are in its metrics). ~2.7 GB a specialist: the
    pipeline's disk peak stays well inside a 64 GiB machine."""
    import shutil

    freed = 0
    for name in SPECIALISTS:
        run = out / name
        newest = snapshots(run)[:1] if run.is_dir() else []
        old = [p for p in (run / "checkpoints").glob("step-*") if p not in newest] if newest else []
        for path in [*old, run / "export"]:
            if path.is_dir():
                freed += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
                shutil.rmtree(path)
    print(f"[prune] {freed / 1e9:.1f} GB of the specialists' exports and older checkpoints removed", flush=True)


def phase_final(out: Path, quick: bool, minutes: float) -> None:
    prune_specialists(out)
    merge = [*CLI, "merge", *[str(out / d) for d in DOMAINS if (out / d).is_dir()], "--out", str(out / "merged")]
    if not (out / "merged").exists():
        print(f"[merge] rl {' '.join(merge[3:])}", flush=True)
        subprocess.run(merge, cwd=ROOT, check=True)
    recipes = final_recipes(out, quick, minutes)
    import threading

    result: dict = {}
    live = threading.Thread(target=opd_live, args=(out, "opd", recipes.pop("opd"), quick, result))
    live.start()
    wait({name: launch(name, path, out) for name, path in recipes.items()}, out)
    live.join()
    if "error" in result:
        sys.exit(result["error"])


def audit(run_dir: Path) -> dict:
    """The store's consistency counts (TrajectoryStore.audit) and how many times the run was restarted."""
    from rl.store.trajectories import TrajectoryStore

    store = TrajectoryStore.for_run_dir(run_dir)
    try:
        return {**store.audit(), "restarts": len(store.restarts())}
    finally:
        store.close()


def wilson(k: int, n: int) -> tuple[float, float]:
    """95% Wilson interval of k successes in n."""
    if n == 0:
        return float("nan"), float("nan")
    z, p = 1.96, k / n
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return c - h, c + h


def score(out: Path, run: str, model: Path, quick: bool, efforts: str | None = None) -> dict:
    """`rl eval` of run `run` (its held-out problems, prompts and tools) with `--checkpoint model`: per effort level
    (None: no prefix), accuracy with its interval, answered and truncated shares, mean response length."""
    responses = out / "scores" / f"{run}-{model.parent.parent.name}-{model.name}{'-effort' if efforts else ''}.jsonl"
    cmd = [*CLI, "eval", str(out / run), "--checkpoint", str(model), "--responses", str(responses)]
    cmd += ["--effort", efforts] if efforts else []
    cmd += ["--set", "run.device=cpu"] if quick else []
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(x) for x in responses.read_text().splitlines()]
    by: dict = {}
    for r in rows:
        by.setdefault(r["effort"], []).append(r)
    result = {}
    for level, rs in by.items():
        k, n = sum(r["correct"] for r in rs), len(rs)
        answered = [r["answered"] for r in rs if r["answered"] is not None]
        result[level] = {"acc": k / n, "ci": wilson(k, n), "n": n, "answered": sum(answered) / max(len(answered), 1),
                         "truncated": sum(r["finish_reason"] == "length" for r in rs) / n,
                         "len": sum(r["response_tokens"] for r in rs) / n}
    return result


def run_score(run_dir: Path, index: int) -> dict | None:
    """A run's own held-out evaluation number `index` (0: before training, 1: after its first stage, ...) over all its
    datasets: the instruct model (index 0) and the SFT warm start (index 1 of a run with SFT then GRPO)."""
    def dataset_accuracy(k: str) -> bool:  # eval/<dataset>/accuracy, not the overall eval/accuracy
        return k.count("/") == 2 and k.startswith("eval/") and k.endswith("/accuracy")

    evals = [r for r in _metrics(run_dir) if any(map(dataset_accuracy, r))]
    if not -len(evals) <= index < len(evals):
        return None
    row = evals[index]
    accs = {k.split("/")[1]: v for k, v in row.items() if dataset_accuracy(k)}
    ns = {k.split("/")[1]: v for k, v in row.items() if k.endswith("/num_problems")}
    n = int(sum(ns.values()))
    k = round(sum(accs[d] * ns[d] for d in accs))
    return {"acc": k / max(n, 1), "ci": wilson(k, n), "n": n, "answered": float("nan"), "truncated": float("nan"),
            "len": float("nan")}


def final_model(run_dir: Path) -> Path:
    return snapshots(run_dir)[0]


def teacher_switching(run_dir: Path) -> str:
    """The OPD stage's teacher loads and the seconds the trainer waited for them, against its wall time."""
    metrics = _metrics(run_dir)
    rows = [r for r in metrics if "teachers/loads" in r]
    if not rows:
        return "no teacher metrics"
    loads, wait_s = sum(r["teachers/loads"] for r in rows), sum(r["teachers/load_wait_s"] for r in rows)
    steps = [r for r in metrics if "opd/kl_loss" in r]
    wall = max(steps[-1]["time"] - steps[0]["time"], 1e-9) if len(steps) > 1 else float("nan")
    return (f"{len(steps)} steps, {loads:.0f} teacher loads ({loads / max(len(steps), 1):.1f} a step), waited "
            f"{wait_s:.1f} s of {wall:.0f} s wall ({wait_s / wall:.1%})")


COLUMNS = ("instruct", "sft", "specialist", "no_tool", "merged", "opd", "opd_merged", "baseline")
"""The report's models: the instruct model and the SFT warm start (the specialist run's own evaluations before
training and after its SFT stage), the specialist, the tool-use specialist's no-tool control, `rl merge` of the
specialists (the merged student before OPD), the OPD students from the instruct model and from the merge, and the
multi-task GRPO baseline; all but the first two scored by `rl eval`."""


def phase_report(out: Path, quick: bool) -> str:
    domains = [d for d in (*DOMAINS, "effort") if (out / d).is_dir()]
    from concurrent.futures import ThreadPoolExecutor

    table: dict[str, dict[str, dict | None]] = {d: {"instruct": run_score(out / d, 0), "sft": run_score(out / d, 1)}
                                               for d in domains}
    jobs = {}  # (domain, column) -> (the run whose evaluation it is, the model)
    for d in domains:
        if d == "effort":  # below, per level
            continue
        models = {"specialist": final_model(out / d), "merged": out / "merged"}
        models |= {c: final_model(out / c) for c in ("opd", "opd_merged", "baseline") if (out / c).is_dir()}
        jobs |= {(d, c): (d, m) for c, m in models.items() if m.is_dir()}
        if d == "compute" and (out / "compute_notool").is_dir():
            jobs[(d, "no_tool")] = ("compute_notool", final_model(out / "compute_notool"))
    with ThreadPoolExecutor(max_workers=4) as pool:  # `rl eval` subprocesses, a few at a time
        scores = {key: pool.submit(score, out, run, model, quick) for key, (run, model) in jobs.items()}
        effort_job = pool.submit(score, out, "effort", final_model(out / "effort"), quick,
                                 ",".join(map(str, EFFORT_LEVELS))) if (out / "effort").is_dir() else None
        for (d, c), f in scores.items():
            table[d][c] = f.result()[None]
        effort = effort_job.result() if effort_job is not None else {}
    if effort:
        table["effort"]["specialist"] = effort[max(effort)]
    print("held-out accuracy, greedy [95% interval] problems:")
    print(f"{'domain':<9}" + "".join(f"{c:>24}" for c in COLUMNS))
    for d, row in table.items():
        cells = [("-" if (s := row.get(c)) is None else f"{s['acc']:.3f} [{s['ci'][0]:.2f},{s['ci'][1]:.2f}] {s['n']}").rjust(24)
                 for c in COLUMNS]
        print(f"{d:<9}" + "".join(cells))
    print("answered / truncated / mean response tokens:")
    for d, row in table.items():
        print(f"  {d:<9}" + "; ".join(f"{c} {s['answered']:.2f}/{s['truncated']:.2f}/{s['len']:.0f}"
                                      for c, s in row.items() if s is not None and not math.isnan(s["len"])))
    print(f"trained samples: specialists' GRPO {trained_samples(out)}, OPD {trained_samples(out, ['opd'])}, "
          f"baseline {trained_samples(out, ['baseline'])}; SFT steps: specialists {sft_steps(out)}, baseline "
          f"{sft_steps(out, ['baseline'])}")
    for run in ("opd", "opd_merged"):
        if (out / run).is_dir():
            print(f"{run}: {teacher_switching(out / run)}")
    audits = {run: audit(out / run) for run in ("opd", "opd_merged", "baseline") if (out / run).is_dir()}
    for run, a in audits.items():  # opd: preempted by SIGTERM and resumed (phase_final); the others uninterrupted
        print(f"store audit {run}: {a}")
    for level, s in sorted(effort.items()):
        print(f"  effort {level:>3}: accuracy {s['acc']:.3f} [{s['ci'][0]:.2f},{s['ci'][1]:.2f}], mean length {s['len']:.1f} tokens")
    gains = {d: row["specialist"]["acc"] - row["instruct"]["acc"] for d, row in table.items()
             if row.get("specialist") and row.get("instruct")}
    closed = {d: (row["opd"]["acc"] - row["instruct"]["acc"]) / gains[d] for d, row in table.items()
              if row.get("opd") and d in gains and gains[d] > 0}
    over = [row["opd"]["acc"] - row["baseline"]["acc"] for row in table.values() if row.get("opd") and row.get("baseline")]
    lens = [effort[b]["len"] for b in sorted(effort)]
    lost = sum(a["trained_twice"] + a["link_mismatch"] + a["prompts_open"] for a in audits.values())
    return (f"RESULT specialist_gain_min={100 * min(gains.values(), default=float('nan')):.1f} "
            f"opd_gap_closed_min={min(closed.values(), default=float('nan')):.3f} "
            f"opd_over_baseline={100 * (sum(over) / len(over) if over else float('nan')):.1f} "
            f"effort_len_ratio={(lens[-1] / lens[0]) if lens and lens[0] > 0 else float('nan'):.2f} "
            f"effort_len_increasing={int(all(a < b for a, b in zip(lens, lens[1:])))} "
            f"opd_resumed={audits.get('opd', {}).get('restarts', 0)} audit_faults={lost} domains={len(table)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", choices=["specialists", "final", "report", "all"], default="all")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "pipeline")
    ap.add_argument("--minutes", type=float, default=7.0,
                    help="the final stage's minutes: the OPD runs' and the baseline's (its SFT steps, then GRPO for the "
                         "minutes less one)")
    ap.add_argument("--quick", action="store_true", help="CPU: a miniature of every phase on a tiny random model")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU: --quick's few steps on the real SmolLM2 (float32): rehearse every phase before a GPU run")
    ap.add_argument("--no-ray", action="store_true", help="every run in-process (runtime.ray: false): a machine without Ray")
    ap.add_argument("--sandbox-backend", choices=["bwrap", "process"], default=None,
                    help="the sandboxes' isolation (default: bwrap where it is installed, else process, said so)")
    a = ap.parse_args()
    import shutil

    MACHINE["no_ray"] = a.no_ray
    MACHINE["smoke"] = a.smoke
    a.quick = a.quick or a.smoke
    MACHINE["sandbox_backend"] = a.sandbox_backend or ("bwrap" if shutil.which("bwrap") else "process")
    if MACHINE["sandbox_backend"] == "process" and a.sandbox_backend is None:
        print("bwrap is not installed here: the sandboxes run as plain processes (sandbox.backend: process)", flush=True)
    if a.quick and a.out == ROOT / "runs" / "pipeline":
        import tempfile

        a.out = Path(tempfile.mkdtemp(prefix="pipeline_quick_"))
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if a.phase in ("specialists", "all"):
        phase_specialists(a.out, a.quick)
        print(f"specialists: {time.time() - t0:.0f} s", flush=True)
    if a.phase in ("final", "all"):
        phase_final(a.out, a.quick, a.minutes)
        print(f"final stage and baseline: {time.time() - t0:.0f} s", flush=True)
    if a.phase in ("report", "all"):
        print(phase_report(a.out, a.quick))


if __name__ == "__main__":
    main()
