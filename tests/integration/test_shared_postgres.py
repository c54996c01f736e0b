"""Two runs in one PostgreSQL database through the real CLI: two `rl train` processes write to it at
once with the same recipe (so the same prompt and sample ids); one is killed with SIGKILL in its
GRPO stage and resumed with `rl resume` (its rows roll back to the checkpoint's watermark). The other
run's rows stay unchanged to the byte, both audits are clean, and since the runs are deterministic the
resumed run trained exactly what the uninterrupted one did."""

from __future__ import annotations

import copy
import json
import signal
import time

import pytest
import yaml

from rl.store.trajectories import TrajectoryStore, recorded_train_steps
from tests.integration.test_resume import RECIPE, _run, _start
from tests.unit.test_store_postgres import rows_of

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _wait(condition, procs, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for p in procs:
            assert p.poll() is None, f"a run ended before {what}: {p.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _trained(url, run_id: str) -> tuple[dict, dict]:
    rows = rows_of(url, run_id)
    samples = {r.sample_id: (r.response_tokens, r.behavior_logprobs, r.reward, r.train_step)
               for r in rows["samples"] if r.train_step is not None}
    losses = {r.step: json.loads(r.metrics_json)["rl/loss"] for r in rows["train_steps"]}
    return samples, losses


def test_two_runs_share_a_postgres_database_and_one_is_killed_and_resumed(postgres_url, tmp_path):
    recipe = copy.deepcopy(RECIPE)
    recipe["run"]["name"] = "shared"
    recipe["stages"][0]["max_steps"] = 30
    recipe["checkpoint"]["every_steps"] = 2
    recipe["store"] = {"url": postgres_url.render_as_string(hide_password=False)}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    killed_dir, other_dir = tmp_path / "killed", tmp_path / "other"
    procs = [_start("train", str(tmp_path / "recipe.yaml"), "--run-dir", str(d)) for d in (killed_dir, other_dir)]
    killed, other = procs
    # Both write at once: each has stored GRPO steps before the first is killed.
    _wait(lambda: recorded_train_steps(other_dir) >= 1 and recorded_train_steps(killed_dir) >= 3, procs,
          "both runs' GRPO steps")
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL
    out, err = other.communicate(timeout=300)
    assert other.returncode == 0, err[-2000:]

    ids = {d: json.loads((d / "run.json").read_text())["run_id"] for d in (killed_dir, other_dir)}
    assert ids[killed_dir] != ids[other_dir]
    other_rows = rows_of(postgres_url, ids[other_dir])
    assert len(other_rows["train_steps"]) == 6 and len(other_rows["trained"]) == 6 * 4 * 4

    resumed = _run("resume", str(killed_dir))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resume: step-" in resumed.stdout and "store rolled back" in resumed.stdout

    assert rows_of(postgres_url, ids[other_dir]) == other_rows  # every column of every row, bytes included
    for d in (killed_dir, other_dir):
        store = TrajectoryStore.read_run(d)  # the recipe's store.url, the run's own id
        assert store.run_id == ids[d]
        audit = store.audit()
        assert audit["trained_twice"] == 0 and audit["link_mismatch"] == 0 and audit["prompts_open"] == 0, audit
        assert len(store.restarts()) == (1 if d == killed_dir else 0)
        store.close()
    # Same recipe, same ids, deterministic runs: the resumed run trained exactly the same samples.
    assert _trained(postgres_url, ids[killed_dir]) == _trained(postgres_url, ids[other_dir])
