"""A copied run directory resumed against the same store (issue #40, class 6), through the real CLI: two run
directories share one SQLite store outside both (store.url). A run killed in its GRPO stage is copied; the original
resumes and finishes; the copy (its checkpoints now behind the store) is refused with one line and exit 2, not one
row of the store changed; `rl resume COPY --new-identity` then trains the copy as a run of its own, the original's
rows unchanged, both audits clean."""

from __future__ import annotations

import copy
import json
import shutil
import signal
import sqlite3

import pytest
import yaml

from rl.store.trajectories import TrajectoryStore
from tests.integration.test_resume import RECIPE, _run
from tests.unit.test_store_postgres import TABLES

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _rows(db, run_id: str) -> dict[str, list]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        return {t: sorted(c.execute(f"select * from {t} where run_id = ?", (run_id,)).fetchall(), key=repr)  # noqa: S608
                for t in TABLES}


def test_a_copy_that_fell_behind_is_refused_and_resumes_only_as_a_new_run(tmp_path):
    shared = tmp_path / "shared" / "store.db"
    recipe = copy.deepcopy(RECIPE)
    recipe["stages"][0]["max_steps"] = 20
    recipe["checkpoint"]["every_steps"] = 2
    recipe["store"] = {"url": f"sqlite:///{shared}"}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    original, copied = tmp_path / "original", tmp_path / "copy"

    killed = _run("train", str(tmp_path / "recipe.yaml"), "--run-dir", str(original), env={"ASYNCRL_FAULT": "train:3"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    shutil.copytree(original, copied)
    done = _run("resume", str(original))
    assert done.returncode == 0, done.stderr[-2000:]
    run_id = json.loads((original / "run.json").read_text())["run_id"]
    assert json.loads((copied / "run.json").read_text())["run_id"] == run_id
    before = _rows(shared, run_id)
    assert len(before["train_steps"]) == 6

    refused = _run("resume", str(copied))
    assert refused.returncode == 2, refused.stderr[-2000:]
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rl resume: the store already holds run ") and \
        lines[0].endswith(f"rl resume {copied} --new-identity"), refused.stderr
    assert _rows(shared, run_id) == before  # nothing rolled back

    forked = _run("resume", str(copied), "--new-identity")
    assert forked.returncode == 0, forked.stderr[-2000:]
    assert "resume: new identity " in forked.stdout
    new_id = json.loads((copied / "run.json").read_text())["run_id"]
    assert new_id != run_id
    assert _rows(shared, run_id) == before  # the original's rows, every column, bytes included
    for run_dir, expected in ((original, run_id), (copied, new_id)):
        store = TrajectoryStore.read_run(run_dir)
        assert store.run_id == expected and store.count_train_steps() == 6
        audit = store.audit()
        assert audit["trained_twice"] == 0 and audit["link_mismatch"] == 0 and audit["prompts_open"] == 0, audit
        store.close()
    again = _run("resume", str(copied))  # the fork resumes as itself from now on (nothing left to train)
    assert again.returncode == 0, again.stderr[-2000:]
