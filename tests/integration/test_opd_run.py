"""OPD on the async runtime with live reconfiguration, through the real CLI: tiny teachers of different
architectures, a running `rl train`, a refused patch (job unchanged), an applied patch (mixture, caps,
a teacher added and swapped in, another removed), and the store's record of it all."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
import yaml

from rewards.config import ReverseConfig, UppercaseConfig
from rl.store.trajectories import TrajectoryStore, recorded_train_steps
from teachers.architectures import ARCHITECTURES, tiny
from rl.algo.train_teachers import build_teachers

pytestmark = [pytest.mark.integration, pytest.mark.slow]
CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    datasets = [UppercaseConfig(name="upper", num_heldout=16, max_len=4), ReverseConfig(name="reverse", num_heldout=16, max_len=4)]
    pool, _ = build_teachers(root, num_teachers=5, num_trained=2, steps=3, datasets=datasets, batch_size=8,
                             architectures={k: tiny(v) for k, v in ARCHITECTURES.items()}, eval_problems=2, log=lambda m: None)
    return pool


def recipe(pool, max_steps=200) -> dict:
    return {
        "run": {"name": "opd", "seed": 0, "num_threads": 1},
        "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                  "max_position_embeddings": 128,
                  "ffn": {"type": "moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}},
        "datasets": [{"type": "uppercase", "name": "upper", "num_heldout": 16, "max_len": 4},
                     {"type": "reverse", "name": "reverse", "num_heldout": 16, "max_len": 4}],
        "engine": {"max_batch_size": 32, "max_seq_len": 64, "max_new_tokens": 24},
        "runtime": {"ray": False},
        "stages": [{"type": "opd", "max_steps": max_steps, "prompts_per_step": 4, "group_size": 2, "micro_batch_size": 8,
                    "steps_per_call": 2, "dispatch": {"policy": "sample", "max_inflight": 16},
                    "teachers": {"device_memory_mib": 0.2, "teachers": [
                        {"name": t.name, "checkpoint": str(t.checkpoint), "datasets": t.datasets} for t in pool.teachers]}}],
        "logging": {"wandb": False, "progress_bar": False},
    }


def _count(run_dir, where: str) -> int:
    try:
        with sqlite3.connect(f"file:{run_dir}/trajectories.db?mode=ro", uri=True) as c:
            return c.execute(f"select count(*) from samples where {where}").fetchone()[0]
    except sqlite3.OperationalError:
        return 0


def test_vocab_mismatch_is_refused_at_validate(teachers, tmp_path):
    bad = tmp_path / "bad-teacher"
    bad.mkdir()
    cfg = json.loads((teachers.teachers[2].checkpoint / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, vocab_size=120)))
    r = recipe(teachers)
    r["stages"][0]["teachers"]["teachers"].append({"name": "wrong-vocab", "checkpoint": str(bad)})
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(r))
    proc = subprocess.run([*CLI, "validate", str(path)], capture_output=True, text=True)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "wrong-vocab has vocab_size=120 but the student has vocab_size=99" in lines[0]


def test_a_teacher_larger_than_the_pool_ends_the_job_in_one_line(teachers, tmp_path):
    """device_memory_mib below one teacher's weights (found by issue #43's pipeline rehearsal): `rl train` says which
    teacher and how many MiB, exit 2, no traceback."""
    r = recipe(teachers)
    r["stages"][0]["teachers"]["device_memory_mib"] = 0.05
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(r))
    proc = subprocess.run([*CLI, "train", str(path), "--run-dir", str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "MiB on device but the pool's device_memory_mib is 0.05" in lines[0], lines


def test_live_reconfiguration_of_a_running_opd_job(teachers, tmp_path):
    names = [t.name for t in teachers.teachers]  # t00 (upper), t01 (reverse), 3 untrained spares
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe(teachers)))
    run_dir = tmp_path / "run"
    job = subprocess.Popen([*CLI, "train", str(path), "--run-dir", str(run_dir)], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while recorded_train_steps(run_dir) < 3:
            assert job.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        # refused by the CLI's validation: nothing reaches the job
        bad = subprocess.run([*CLI, "reconfigure", str(run_dir), "--set", "teachers.upper=nobody"],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "unknown teacher 'nobody'" in bad.stderr and len(bad.stderr.splitlines()) == 1
        # applied: mixture + cap + swap the upper teacher for a spare; the old upper teacher leaves the set
        patch = tmp_path / "patch.yaml"
        patch.write_text(yaml.safe_dump({"mixture": {"reverse": 3.0}, "dataset_max_inflight": {"upper": 4},
                                         "add_teachers": [{"name": "added", "checkpoint": str(teachers.teachers[2].checkpoint)}],
                                         "teachers": {"upper": "added"}}))
        good = subprocess.run([*CLI, "reconfigure", str(run_dir), str(patch)], capture_output=True, text=True, timeout=60)
        assert good.returncode == 0, good.stderr
        assert good.stdout.startswith("applied: config version 1 at train step ")
        applied_at = int(good.stdout.split("train step ")[1].split(":")[0])
        deadline = time.monotonic() + 180
        while recorded_train_steps(run_dir) < applied_at + 4 or _count(run_dir, "dataset = 'upper' and config_version = 1") < 2:
            assert job.poll() is None, job.stdout.read()[-2000:]  # the job never stopped
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        job.send_signal(signal.SIGTERM)
        out = job.communicate(timeout=60)[0]
    assert job.returncode == 3, out[-2000:]  # preempted with a checkpoint written (README "Exit codes")
    assert "reconfigure: config version 1" in out

    store = TrajectoryStore.for_run_dir(run_dir)
    assert [v["status"] for v in store.config_versions()] == ["applied"]
    assert store.config_versions()[0]["patch"]["teachers"] == {"upper": "added"}
    with sqlite3.connect(f"{run_dir}/trajectories.db") as c:
        rows = c.execute("select dataset, config_version, teacher, train_step, prompt_id from samples").fetchall()
        prompt_versions = dict(c.execute("select prompt_id, config_version from prompts").fetchall())
    # every sample keeps the config version of its prompt's dispatch; both versions exist
    assert all(v == prompt_versions[p] for _, v, _, _, p in rows) and {v for _, v, _, _, _ in rows} == {0, 1}
    # new dispatches follow the patch: upper samples of version 1 are scored by the new teacher
    assert {t for d, v, t, _, _ in rows if d == "upper" and v == 1} == {"added"}
    # the removed teacher scores nothing trained after the switch: its in-flight samples went to the new one
    assert not [r for r in rows if r[2] == names[0] and r[3] is not None and r[3] > applied_at]
    # the mixture moved towards reverse after the switch
    after = [d for d, v, _, _, _ in rows if v == 1]
    assert after.count("reverse") > after.count("upper")
    assert store.audit()["trained_twice"] == 0
    # resumed in a fresh process, the job still knows the teacher added live (and keeps training with it)
    steps = recorded_train_steps(run_dir)
    resumed = subprocess.run([*CLI, "resume", str(run_dir), "--set", f"stages.0.max_steps={steps + 3}"],
                             capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert recorded_train_steps(run_dir) == steps + 3 and "opd_acc=" in resumed.stdout.splitlines()[-1]
