"""Issue 40, class 2: a live patch is validated by the job itself before it is answered. Patches the CLI's checks let
through but the job cannot run (a mixture whose total overflows, caps no group fits, teachers for a GRPO stage, a
teacher whose weights are damaged) are refused with one line while the job keeps running unchanged; a refusal is never
re-applied by a resume; a patch the job never answered before a crash is validated on resume like any other.
In-process jobs on a tiny model (no Ray), as in test_async_loop.py: seconds each."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from model.checkpoint import save_checkpoint
from model.decoder import Decoder
from rl import reconfigure
from rl.algo.async_grpo import run_async_grpo
from rl.algo.job import open_job
from rl.config import Recipe
from rl.store.trajectories import TrajectoryStore

pytestmark = pytest.mark.integration
CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]

G = 2
MODEL = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16, "init_std": 0.15,
         "max_position_embeddings": 64}
RECIPE = {
    "run": {"name": "patches", "seed": 0, "num_threads": 1},
    "model": MODEL,
    "datasets": [{"type": "arithmetic", "name": "arith", "max_digits": 1, "num_heldout": 4},
                 {"type": "reverse", "name": "rev", "max_len": 3, "num_heldout": 4}],
    "engine": {"max_batch_size": 16, "block_size": 4, "max_seq_len": 48, "max_new_tokens": 8},
    "runtime": {"ray": False},
    "stages": [{"type": "grpo", "max_steps": 4, "prompts_per_step": 2, "group_size": G, "micro_batch_size": 8,
                "steps_per_call": 2, "dispatch": {"policy": "sample", "max_inflight": 8}}],
    # written in place: a crash "after the step-2 checkpoint" must find it committed (a background write commits at
    # the first step after it is done, which a slow machine may not reach before the crash)
    "checkpoint": {"every_steps": 2, "keep_last": 2, "background": False},
    "eval": {"max_problems": 2},
    "logging": {"wandb": False, "progress_bar": False},
}


class Crash(Exception):
    pass


def run_stage(run_dir: Path, recipe: dict, resume: bool = False, at_train=None) -> list[str]:
    """The stage as `rl train` runs it; `at_train(n)` runs after the n-th optimizer step (rl.faults.fault_point
    "train"). Returns what the job said."""
    said: list[str] = []
    recipe = Recipe.model_validate(recipe)
    calls = []

    def fault_point(name: str, *_):
        if name == "train" and at_train is not None:
            calls.append(name)
            at_train(len(calls))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("rl.algo.async_grpo.fault_point", fault_point)
        with open_job(recipe, run_dir, say=said.append, resume=resume) as job:
            job.state.stage_t0 = time.monotonic()
            run_async_grpo(job, recipe.stages[0], 0)
    return said


def answers(run_dir: Path) -> list[tuple[str, str]]:
    return [(a["status"], a.get("reason", "")) for a in reconfigure.answers(run_dir)]


def train_steps(run_dir: Path) -> int:
    with sqlite3.connect(run_dir / "trajectories.db") as c:
        return c.execute("select count(*) from train_steps").fetchone()[0]


def teacher_checkpoint(path: Path, damage: str | None = None) -> Path:
    """A tiny teacher (the student's vocabulary); `damage`: 'truncated' weights file or 'nan' weights."""
    torch.manual_seed(0)
    model = Decoder(Recipe.model_validate(RECIPE).model)
    if damage == "nan":
        with torch.no_grad():
            model.model.embed_tokens.weight[3, 1] = float("nan")
    save_checkpoint(model, path)
    if damage == "truncated":
        weights = path / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return path


# the CLI's checks (rl/cli/commands.py: the run's recipe) accept each of these; the job cannot run them
BAD_FOR_THE_JOB = {
    "mixture: {arith: 1.0e+308, rev: 1.0e+308}": "mixture: the weights' total is not finite",
    "dataset_max_inflight: {arith: 1}": "dataset_max_inflight.arith=1 is below the group size 2",
    "mixture: {arith: 0}\ndataset_max_inflight: {rev: 1}": "dataset_max_inflight.rev=1 is below the group size 2",
}


def test_patches_the_job_cannot_run_are_refused_and_the_job_runs_on_unchanged(tmp_path):
    run_dir = tmp_path / "run"
    teacher = teacher_checkpoint(tmp_path / "teacher")
    cli = []

    def at_train(n):
        if n == 1:
            for text in BAD_FOR_THE_JOB:
                reconfigure.submit(run_dir, reconfigure.parse_patch(text))
            # a GRPO stage has no teacher pool: adding one killed the job (AttributeError on the worker)
            reconfigure.submit(run_dir, reconfigure.parse_patch(f"add_teachers: [{{name: t9, checkpoint: {teacher}}}]"))
            # through the real CLI: it waits for the job's answer while the job goes on
            cli.append(subprocess.Popen([*CLI, "reconfigure", str(run_dir), "--set", "dataset_max_inflight.arith=1"],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            deadline = time.monotonic() + 60
            while len(reconfigure.pending(run_dir)) < len(BAD_FOR_THE_JOB) + 2:  # the CLI's patch is in the inbox
                assert cli[0].poll() is None and time.monotonic() < deadline, cli[0].communicate()
                time.sleep(0.05)
        if n == 2:
            reconfigure.submit(run_dir, reconfigure.parse_patch("mixture: {arith: 2.0}"))

    said = run_stage(run_dir, RECIPE, at_train=at_train)
    out, err = cli[0].communicate(timeout=120)
    assert cli[0].returncode == 2 and err.count("\n") == 1, (cli[0].returncode, out, err)
    assert err.startswith("rl reconfigure: the job refused the patch: dataset_max_inflight.arith=1 is below the group "
                          "size 2"), err
    assert train_steps(run_dir) == 4  # the job ran its stage to the end
    got = answers(run_dir)
    assert [s for s, _ in got] == ["refused"] * 5 + ["applied"]
    for (_, reason), needle in zip(got, [*BAD_FOR_THE_JOB.values(), "not an OPD stage"]):
        assert needle in reason and "\n" not in reason, (needle, reason)
    store = TrajectoryStore.read_run(run_dir)
    versions = store.config_versions()
    store.close()
    assert [(v["version"], v["status"]) for v in versions] == [(None, "refused")] * 5 + [(1, "applied")]
    assert sum("reconfigure: refused" in line for line in said) == 5


def test_a_resume_never_reapplies_a_refused_patch_and_validates_what_the_crashed_job_left(tmp_path):
    """The issue's reproduction: a patch answered "applied" that the job cannot run (what the old checks let through)
    killed the job and every resume; a patch queued but never answered before the crash, and one the job was validating
    when it died (its teacher's load killed the worker), must not brick the resume either."""
    run_dir = tmp_path / "run"
    recipe = {**RECIPE, "stages": [{**RECIPE["stages"][0], "max_steps": 3}]}
    teacher = teacher_checkpoint(tmp_path / "teacher")

    def at_train(n):
        if n == 3:  # after the step-2 checkpoint: these arrive after what the resume restores
            # what the old job answered (and died of at its next draw): "applied", a version past the checkpoint's
            reconfigure.answer(run_dir, "1-1", {"status": "applied", "version": 1, "train_step": 2, "stage": 0,
                                                "patch": {"mixture": {"arith": 1.0e308, "rev": 1.0e308}}})
            # queued, never seen: a teacher for a GRPO stage (it killed the job on its workers' missing pool)
            reconfigure.submit(run_dir, reconfigure.parse_patch(f"add_teachers: [{{name: t9, checkpoint: {teacher}}}]"))
            raise Crash()

    with pytest.raises(Crash):
        run_stage(run_dir, recipe, at_train=at_train)
    (pid, path), = reconfigure.pending(run_dir)
    recipe = {**recipe, "stages": [{**recipe["stages"][0], "max_steps": 4}]}
    said = run_stage(run_dir, recipe, resume=True)
    assert train_steps(run_dir) == 4
    assert reconfigure.pending(run_dir) == []
    done = {a.get("version"): a for a in reconfigure.answers(run_dir)}
    assert done[None]["status"] == "refused" and "not an OPD stage" in done[None]["reason"]
    assert sum("reconfigure: refused" in line for line in said) == 2, said
    store = TrajectoryStore.read_run(run_dir)
    assert [v["status"] for v in store.config_versions()] == ["refused", "refused"]
    store.close()
    # a second resume refuses the re-application again (a line, no crash) and re-applies nothing
    recipe = {**recipe, "stages": [{**recipe["stages"][0], "max_steps": 5}]}
    said = run_stage(run_dir, recipe, resume=True)
    assert train_steps(run_dir) == 5 and sum("reconfigure: refused" in line for line in said) == 1


def test_a_patch_the_job_was_validating_when_it_died_is_refused_on_resume(tmp_path):
    run_dir = tmp_path / "run"
    recipe = {**RECIPE, "stages": [{**RECIPE["stages"][0], "max_steps": 3}]}

    def at_train(n):
        if n == 3:
            pid = reconfigure.submit(run_dir, reconfigure.parse_patch("mixture: {arith: 5.0}"))
            reconfigure.claim(run_dir, pid)  # what the job does before it loads a patch's teachers
            raise Crash()

    with pytest.raises(Crash):
        run_stage(run_dir, recipe, at_train=at_train)
    recipe = {**recipe, "stages": [{**recipe["stages"][0], "max_steps": 4}]}
    said = run_stage(run_dir, recipe, resume=True)
    assert train_steps(run_dir) == 4
    (answer,) = reconfigure.answers(run_dir)
    assert answer["status"] == "refused" and "the job stopped while validating this patch" in answer["reason"]
    assert reconfigure.claimed(run_dir) == [] and reconfigure.pending(run_dir) == []
    assert any("reconfigure: refused" in line for line in said)


def opd_recipe(teacher: Path) -> dict:
    stage = {**RECIPE["stages"][0], "type": "opd", "max_steps": 4,
             "teachers": {"device_memory_mib": 4, "teachers": [{"name": "t0", "checkpoint": str(teacher),
                                                                "datasets": ["arith", "rev"]}]}}
    return {**RECIPE, "stages": [stage]}


@pytest.mark.parametrize("damage", ["truncated", "nan"])
def test_a_teacher_with_damaged_weights_is_refused_and_the_pool_is_left_as_it_was(tmp_path, damage):
    run_dir = tmp_path / "run"
    good = teacher_checkpoint(tmp_path / "t0")
    bad = teacher_checkpoint(tmp_path / "bad", damage=damage)

    def at_train(n):
        if n == 1:
            reconfigure.submit(run_dir, reconfigure.parse_patch(
                f"add_teachers: [{{name: bad, checkpoint: {bad}}}]\nteachers: {{arith: bad}}"))
        if n == 2:  # the refused teacher's name is free again: nothing of it stayed in the pool
            reconfigure.submit(run_dir, reconfigure.parse_patch(
                f"add_teachers: [{{name: bad, checkpoint: {good}}}]\nteachers: {{arith: bad}}"))

    run_stage(run_dir, opd_recipe(good), at_train=at_train)
    assert train_steps(run_dir) == 4
    (s1, reason), (s2, _) = answers(run_dir)
    assert s1 == "refused" and "teacher 'bad'" in reason and "\n" not in reason and s2 == "applied", reason
    if damage == "nan":
        assert "non-finite" in reason


def test_in_flight_samples_of_a_remapped_teacher_are_scored_by_the_dispatch_teacher_while_it_stays_active(tmp_path):
    """DESIGN/rl/reconfigure.py: an in-flight sample keeps the teacher it was dispatched with; the one exception is a
    teacher that left the active set: its samples go to their dataset's current teacher (and the store says so)."""
    run_dir = tmp_path / "run"
    t0, t1 = teacher_checkpoint(tmp_path / "t0"), teacher_checkpoint(tmp_path / "t1")
    applied: dict[int, int] = {}

    def at_train(n):
        if n == 1:  # arith -> t1 while t0 still scores rev: arith samples dispatched under t0 stay with t0
            reconfigure.submit(run_dir, reconfigure.parse_patch(
                f"add_teachers: [{{name: t1, checkpoint: {t1}}}]\nteachers: {{arith: t1}}"))
        if n == 3:  # rev -> t1: t0 leaves the active set, its in-flight rev samples go to t1
            reconfigure.submit(run_dir, reconfigure.parse_patch("teachers: {rev: t1}"))

    recipe = opd_recipe(t0)
    recipe["stages"][0]["max_steps"] = 6
    run_stage(run_dir, recipe, at_train=at_train)
    for a in reconfigure.answers(run_dir):
        assert a["status"] == "applied", a
        applied[a["version"]] = a["train_step"]
    with sqlite3.connect(run_dir / "trajectories.db") as c:
        rows = c.execute("select s.dataset, p.config_version, s.teacher, s.train_step from samples s "
                         "join prompts p on p.prompt_id = s.prompt_id where s.train_step is not null").fetchall()
    # dispatched under version 0 (t0 for both), trained after version 1 and before version 2: arith keeps t0
    kept = [t for d, v, t, step in rows if d == "arith" and v == 0 and applied[1] < step <= applied[2]]
    assert kept and set(kept) == {"t0"}, rows
    # dispatched under t0 (versions 0 and 1) for rev, trained after version 2: t0 left, so t1 scored them
    moved = [t for d, v, t, step in rows if d == "rev" and v < 2 and step > applied[2]]
    assert moved and set(moved) == {"t1"}, rows
    assert {t for d, v, t, _ in rows if v >= 1 and d == "arith"} <= {"t1"}
    assert not [r for r in rows if r[2] == "t0" and r[3] > applied[2]]
