"""The async GRPO loop in-process on a tiny model (real engine, trainer, SQLite store and checkpoint files,
no Ray, a few seconds): what the store holds after a stage, and that a job stopped at a token boundary or
crashing right after an optimizer step, once resumed, trains exactly what the uninterrupted job trains.
The CLI versions with kill -9 are in test_resume.py (minutes); these are the cheap ones."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import numpy as np
import pytest

from rl import reconfigure
from rl.algo.async_grpo import AsyncGRPO, run_async_grpo
from rl.config import Recipe
from rl.algo.job import open_job
from rl.checkpoint.preempt import Preempted
from rl.store.trajectories import LOGPROB_DTYPE, TrajectoryStore, decode_array

pytestmark = pytest.mark.integration

STEPS, PROMPTS, G, LAG = 6, 2, 2, 2  # long enough that prompts drawn after a resume get trained
RECIPE = {
    "run": {"name": "loop", "seed": 0, "num_threads": 1},
    "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16, "init_std": 0.15,
              "max_position_embeddings": 64,
              "ffn": {"type": "moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}},
    "datasets": [{"type": "arithmetic", "name": "arith", "max_digits": 1, "num_heldout": 4}],
    "engine": {"max_batch_size": 16, "block_size": 4, "max_seq_len": 48, "max_new_tokens": 12},
    "runtime": {"ray": False},
    "stages": [{"type": "grpo", "max_steps": STEPS, "prompts_per_step": PROMPTS, "group_size": G, "micro_batch_size": 8,
                "steps_per_call": 2, "dispatch": {"policy": "sample", "max_inflight": 8, "max_version_lag": LAG}}],
    "checkpoint": {"every_steps": 2, "keep_last": 2},
    "eval": {"max_problems": 2},
    "logging": {"wandb": False, "progress_bar": False},
}
NEUTRAL_PATCHES = ("mixture: {arith: 2.0}", "mixture: {arith: 3.0}")
"""Live patches that change nothing a single-dataset run dispatches (one weight among one dataset)."""


def run_stage(run_dir: Path, resume: bool = False, guard=None, recipe: Recipe | None = None) -> bool:
    """The GRPO stage as `rl train` runs it (RECIPE's unless given); False when it stopped at a preemption checkpoint."""
    recipe = recipe or Recipe.model_validate(RECIPE)
    with open_job(recipe, run_dir, say=lambda m: None, resume=resume) as job:
        job.checkpointer.guard = guard(job) if guard else None
        job.state.stage_t0 = time.monotonic()
        try:
            run_async_grpo(job, recipe.stages[0], 0)
        except Preempted:
            return False
    return True


def sums_dataset(tmp_path: Path, verifier: str) -> dict:
    """A JSONL dataset of the 36 sums of two digits, rewarded by a test reward function (tests/tasks/reward_fns.py)."""
    rows = [{"q": f"{a}+{b}=", "a": str(a + b)} for a in range(6) for b in range(6)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"type": "jsonl", "name": verifier, "path": str(tmp_path / "d.jsonl"), "prompt": "q", "answer": "a",
            "verifier": f"python:tests.tasks.reward_fns:{verifier}", "heldout": {"fraction": 0.1}}


def trained(run_dir: Path) -> tuple[dict, dict]:
    with sqlite3.connect(run_dir / "trajectories.db") as c:
        samples = {r[0]: r[1:] for r in c.execute(
            "select sample_id, response_tokens, behavior_logprobs, reward, train_step from samples where train_step is not null")}
        losses = {r[0]: json.loads(r[1])["rl/loss"] for r in c.execute("select step, metrics_json from train_steps")}
    return samples, losses


def checkpoints_written(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["checkpoint/global_step"] for r in map(json.loads, lines) if "checkpoint/global_step" in r]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("loop") / "reference"
    assert run_stage(run_dir)
    return run_dir, *trained(run_dir)


def test_every_group_is_trained_whole_once_at_its_step_and_every_prompt_has_an_outcome(reference):
    run_dir, samples, losses = reference
    assert len(samples) == STEPS * PROMPTS * G and sorted(losses) == list(range(1, STEPS + 1))
    with sqlite3.connect(run_dir / "trajectories.db") as c:
        prompts = {r[0]: r[1:] for r in c.execute("select prompt_id, policy_version, outcome from prompts")}
        rows = list(c.execute("select sample_id, prompt_id, train_step, policy_versions from samples"))
    by_step: dict[int, set[str]] = {}
    for sid, pid, step, blob in rows:
        if step is None:
            continue
        by_step.setdefault(step, set()).add(pid)
        versions = [int.from_bytes(blob[i : i + 4], "little") for i in range(0, len(blob), 4)]
        dispatched_at = prompts[pid][0]
        # a token is never older than its prompt's dispatch, never newer than the weights it trains, and
        # within the lag bound of them
        assert dispatched_at <= min(versions) and max(versions) <= step - 1 and step - 1 - min(versions) <= LAG, sid
    assert sorted(by_step) == list(range(1, STEPS + 1)) and all(len(p) == PROMPTS for p in by_step.values())
    trained_prompts = set().union(*by_step.values())
    assert all(sum(1 for _, p, s, _ in rows if p == pid and s is not None) == G for pid in trained_prompts)
    assert {pid: o for pid, (_, o) in prompts.items() if pid in trained_prompts} == dict.fromkeys(trained_prompts, "trained")
    assert {o for pid, (_, o) in prompts.items() if pid not in trained_prompts} <= {"dropped_stage_end"}
    store = TrajectoryStore.read_run(run_dir)
    assert store.audit() == {"trained_twice": 0, "trained": STEPS * PROMPTS * G, "link_mismatch": 0,
                             "prompts": len(prompts), "prompts_open": 0}
    store.close()
    assert checkpoints_written(run_dir) == [2, 4, 6]  # periodic at 2 and 4, then the stage end (after the last step)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ckpt_s = [r["time/checkpoint_s"] for r in lines if "time/checkpoint_s" in r]  # the periodic ones' seconds, taken
    assert ckpt_s[:2] == [0.0, 0.0] and 0 < ckpt_s[2] <= ckpt_s[-1]  # in step 3's rollout phase, not in rollout_s
    # each checkpoint's pause, by part: the periodic ones (background) wrote nothing in it, the stage end's did
    pauses = {r["step"]: r for r in lines if "checkpoint/trainer_copy_s" in r}
    assert sorted(pauses) == [2, 4, 6]
    assert [pauses[s]["checkpoint/write_s"] > 0 for s in (2, 4, 6)] == [False, False, True]
    assert all(pauses[s]["checkpoint/inflight_bytes"] > 0 and pauses[s]["checkpoint/inflight_s"] > 0 for s in (2, 4))


class StopAtStep:
    """A preemption request (what SIGTERM sets) once the job reaches a train step."""

    def __init__(self, job, step: int):
        self.job, self.step = job, step

    @property
    def requested(self) -> bool:
        return self.job.state.global_step >= self.step


def test_a_job_stopped_at_a_token_boundary_resumes_to_the_uninterrupted_result(reference, tmp_path):
    _, samples, losses = reference
    run_dir = tmp_path / "run"
    assert not run_stage(run_dir, guard=lambda job: StopAtStep(job, 3))
    assert checkpoints_written(run_dir) == [2, 3]
    assert run_stage(run_dir, resume=True)
    assert trained(run_dir) == (samples, losses)
    assert checkpoints_written(run_dir) == [2, 3, 4, 6]


class Crash(Exception):
    pass


def test_a_crash_after_an_optimizer_step_resumes_to_the_uninterrupted_result_and_patches_show_once(
        reference, tmp_path, monkeypatch):
    """Checkpoint at step 2; a live patch applied before it, one applied and one refused after it; the job
    dies inside step 4's train phase (optimizer stepped, store not told). The resume rolls the store back to
    step 2, applies the later patch again and redoes steps 3-6."""
    _, samples, losses = reference
    run_dir = tmp_path / "run"
    reconfigure.submit(run_dir, reconfigure.parse_patch(NEUTRAL_PATCHES[0]))
    calls = []

    def fault_point(name: str) -> None:
        calls.append(name)
        if len(calls) == 3:  # step 3: two patches arrive, answered at the next token boundary
            reconfigure.submit(run_dir, reconfigure.parse_patch(NEUTRAL_PATCHES[1]))
            reconfigure.submit(run_dir, reconfigure.parse_patch("mixture: {nope: 1.0}"))  # refused: no such dataset
        if len(calls) == 4:
            raise Crash(name)

    monkeypatch.setattr("rl.algo.async_grpo.fault_point", fault_point)
    # the step-2 checkpoint written in place: a background write commits at the first step after it is done, which a
    # loaded machine may not reach before the crash (the reference run writes in the background: the same samples)
    recipe = Recipe.model_validate({**RECIPE, "checkpoint": {**RECIPE["checkpoint"], "background": False}})
    with pytest.raises(Crash):
        run_stage(run_dir, recipe=recipe)
    monkeypatch.undo()
    assert run_stage(run_dir, resume=True, recipe=recipe)
    assert trained(run_dir) == (samples, losses)
    store = TrajectoryStore.read_run(run_dir)
    assert [(v["version"], v["status"], v["patch"]) for v in store.config_versions()] == [
        (1, "applied", {"mixture": {"arith": 2.0}}), (None, "refused", {"mixture": {"nope": 1.0}}),
        (2, "applied", {"mixture": {"arith": 3.0}})]  # the refusal is not retried; the applied patch shows once
    (restart,) = store.restarts()
    assert restart["train_step"] == 2 and restart["train_steps_rolled_back"] == 1 and restart["samples_regenerated"] > 0
    assert store.audit()["trained_twice"] == 0 and store.audit()["prompts_open"] == 0
    store.close()
    assert checkpoints_written(run_dir) == [2, 4, 6]  # the resumed job does not write its step-2 checkpoint again


def test_groups_with_equal_rewards_leave_the_train_step_without_changing_it(tmp_path):
    """skip_uniform_groups: a group whose rewards are all equal has advantage 0 everywhere, so leaving it out of the
    forward and backward changes no gradient: the run trains the same samples to the same losses as with it in
    (rewards here are a coin per sample, so both kinds of group occur), and every sample of the step is marked
    trained either way."""
    dataset = sums_dataset(tmp_path, "first_char_even")  # a coin per sample
    runs = {}
    for skip in (True, False):
        recipe = Recipe.model_validate({**RECIPE, "datasets": [dataset], "checkpoint": {"every_steps": 0},
                                        "stages": [{**RECIPE["stages"][0], "max_steps": 4, "skip_uniform_groups": skip}]})
        with open_job(recipe, tmp_path / str(skip), say=lambda m: None) as job:
            job.state.stage_t0 = time.monotonic()
            run_async_grpo(job, recipe.stages[0], 0)
        runs[skip] = trained(tmp_path / str(skip))
        lines = [json.loads(x) for x in (tmp_path / str(skip) / "metrics.jsonl").read_text().splitlines()]
        runs[skip] += ([r["train/uniform_groups_skipped_total"] for r in lines if "train/uniform_groups_skipped_total" in r],)
    (samples, losses, skipped), (samples_all, losses_all, skipped_none) = runs[True], runs[False]
    assert skipped[-1] > 0 and skipped_none[-1] == 0
    assert all(r.get("time/checkpoint_s", 0.0) == 0.0 for r in lines)  # checkpoint.every_steps 0: none periodic
    by_group: dict[str, set[float]] = {}
    for sid, (_, _, reward, _) in samples.items():
        by_group.setdefault(sid.rsplit("-", 1)[0], set()).add(reward)
    assert any(len(r) > 1 for r in by_group.values()), "no group with a reward spread: the check would be vacuous"
    assert len(samples) == 4 * PROMPTS * G and samples.keys() == samples_all.keys()
    # the same tokens, rewards and steps; the behaviour logprobs to float rounding (the forward's reductions run over
    # fewer rows without the uniform groups, and a step whose loss is ~0 is still a full-size AdamW update)
    for sid, (tokens, logprobs, reward, step) in samples.items():
        tokens_all, logprobs_all, reward_all, step_all = samples_all[sid]
        assert (tokens, reward, step) == (tokens_all, reward_all, step_all), sid
        assert np.frombuffer(logprobs, np.float32) == pytest.approx(np.frombuffer(logprobs_all, np.float32), abs=1e-5)
    assert losses == pytest.approx(losses_all, rel=1e-4, abs=1e-7) and any(abs(v) > 1e-4 for v in losses.values())


def test_dynamic_sampling_trains_only_groups_with_a_reward_spread_and_full_batches(tmp_path):
    """GRPOStage.dynamic_sampling (DAPO): groups whose rewards come out all equal are dropped when their rewards are
    in (prompt outcome `filtered`, never trained, counted in dispatch/filtered_groups), and each step still trains
    prompts_per_step groups, every one with a reward spread (a coin per sample: both kinds occur). Stopped at a
    token boundary after step 2 and resumed, the job trains and filters exactly what the uninterrupted one does."""
    dataset = sums_dataset(tmp_path, "first_char_even")  # a coin per sample
    recipe = Recipe.model_validate({**RECIPE, "datasets": [dataset], "checkpoint": {"every_steps": 2, "keep_last": 2},
                                    "stages": [{**RECIPE["stages"][0], "max_steps": 3, "dynamic_sampling": True}]})

    def outcomes(run_dir: Path) -> dict[str, str]:
        with sqlite3.connect(run_dir / "trajectories.db") as c:
            return dict(c.execute("select prompt_id, outcome from prompts"))

    run_dir = tmp_path / "ds"
    assert run_stage(run_dir, recipe=recipe)
    stopped = tmp_path / "stopped"
    assert not run_stage(stopped, guard=lambda job: StopAtStep(job, 2), recipe=recipe)
    assert run_stage(stopped, resume=True, recipe=recipe)
    assert trained(stopped) == trained(run_dir) and outcomes(stopped) == outcomes(run_dir)
    with sqlite3.connect(run_dir / "trajectories.db") as c:
        outcome = dict(c.execute("select prompt_id, outcome from prompts"))
        rows = c.execute("select prompt_id, reward, train_step from samples").fetchall()
    rewards: dict[str, set[float]] = {}
    steps: dict[int, set[str]] = {}
    for pid, reward, step in rows:
        rewards.setdefault(pid, set()).add(reward)
        if step is not None:
            steps.setdefault(step, set()).add(pid)
    assert sorted(steps) == [1, 2, 3] and all(len(p) == PROMPTS for p in steps.values())
    trained_pids = set().union(*steps.values())
    assert all(outcome[p] == "trained" and len(rewards[p]) == 2 for p in trained_pids)
    filtered = [p for p, o in outcome.items() if o == "filtered"]
    assert filtered and all(len(rewards[p]) == 1 for p in filtered)
    assert not any(step is not None for pid, _, step in rows if pid in filtered)
    last = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if "rl/loss" in x][-1]
    assert last["dispatch/filtered_groups"] == len(filtered)
    assert last["train/uniform_groups_skipped_total"] == 0  # nothing uniform reached a step
    # in-process the verdicts come with the call (no reward actor), so every batch formed from verified groups while
    # the engine generated: taken without a wait (a Ray run waits only where nothing generates)
    assert last["rollout/reward_waits_total"] == 0 and last["time/reward_wait_s"] == 0


@pytest.mark.parametrize("ray", [False, True], ids=["in-process", "ray"])
def test_the_controller_lets_go_of_groups_that_are_trained_or_filtered(tmp_path, ray):
    """What the controller holds for a group (its prompt, teacher, rewarded samples) goes when the group is trained
    or closes without training: with dynamic sampling dropping most groups, a job kept every filtered prompt until
    it ended (memory that grew with the run). On Ray the verdicts come from a reward actor a call later, so a group
    can close before its verdicts are in; what it holds goes when the last one comes."""
    dataset = sums_dataset(tmp_path, "first_char_even")  # a coin per sample: groups of 2 are uniform half the time
    runtime = {"ray": True, "num_workers": 1, "num_cpus": 2, "num_reward_workers": 1} if ray else {"ray": False}
    # warm-up discard (seed §5.2.2: a group with a response under 12 tokens, one that ended at EOS, is dropped whole in
    # the first 2 steps): a group that closes when its last sample finishes, its verdicts still out on Ray
    dispatch = {**RECIPE["stages"][0]["dispatch"], "warmup_discard": {"steps": 2, "min_response_tokens": 12}}
    recipe = Recipe.model_validate({**RECIPE, "datasets": [dataset], "runtime": runtime, "checkpoint": {"every_steps": 0},
                                    "stages": [{**RECIPE["stages"][0], "max_steps": 4, "dynamic_sampling": True,
                                                "dispatch": dispatch}]})
    stage = recipe.stages[0]
    run_dir = tmp_path / "run"
    with open_job(recipe, run_dir, say=lambda m: None) as job:
        job.state.stage_t0 = time.monotonic()
        job.policy.begin_stage(stage)
        loop = AsyncGRPO(job, stage, 0)
        held = []
        step = loop.train_step

        def counting_step(batch, *rest):  # the groups held at each train step: bounded by what is in flight
            held.append(len(loop.prompts))
            return step(batch, *rest)

        loop.train_step = counting_step
        loop.run()
    with sqlite3.connect(run_dir / "trajectories.db") as c:
        outcome = dict(c.execute("select prompt_id, outcome from prompts"))
    gone = {p for p, o in outcome.items() if o in ("trained", "filtered", "dropped_stale", "discarded")}
    assert {"trained", "filtered", "discarded"} <= set(outcome.values()) and len(held) == 4
    assert not gone & (set(loop.prompts) | set(loop.teacher_of) | set(loop.finished))
    assert not loop.unverified and not loop.closed_unverified
    # in flight (max_inflight 8 = 4 groups of 2) + ready + the next batch's: never every prompt drawn so far
    assert max(held) <= 4 + 2 * PROMPTS * (LAG + 1) < len(outcome)


def test_a_time_budget_ends_the_stage_inside_a_rollout_phase_that_never_fills_a_batch(tmp_path):
    """With dynamic sampling and a reward that never varies no batch ever fills; the stage still ends at its
    max_minutes (at a rollout call's token boundary), says why (after 10 steps' worth of uniform groups in a row: 10
    at one prompt a step, which a cold process reaches well within the 2.4 s even on a loaded machine), writes its
    stage-end checkpoint and gives every prompt an outcome. (A guard preempts the job after 60 s, so the test fails
    instead of hanging.)"""
    dataset = sums_dataset(tmp_path, "graded")  # always 0.25
    recipe = Recipe.model_validate({**RECIPE, "datasets": [dataset], "checkpoint": {"every_steps": 0},
                                    "stages": [{**RECIPE["stages"][0], "max_steps": 3, "max_minutes": 0.04,
                                                "prompts_per_step": 1, "dynamic_sampling": True}]})
    said: list[str] = []
    run_dir = tmp_path / "flat"
    with open_job(recipe, run_dir, say=said.append) as job:
        t0 = time.monotonic()
        job.checkpointer.guard = type("After60s", (), {"requested": property(lambda _: time.monotonic() > t0 + 60)})()
        job.state.stage_t0 = t0
        run_async_grpo(job, recipe.stages[0], 0)  # Preempted (the guard) would fail the test
    assert job.state.global_step == 0
    assert any(m.startswith("dynamic_sampling: ") and "had equal rewards (0.25)" in m for m in said), said
    store = TrajectoryStore.read_run(run_dir)
    assert store.audit()["prompts_open"] == 0 and store.audit()["trained"] == 0
    store.close()
    with sqlite3.connect(run_dir / "trajectories.db") as c:
        outcomes = {o for (o,) in c.execute("select outcome from prompts")}
    assert "filtered" in outcomes and outcomes <= {"filtered", "dropped_stage_end"}
    assert checkpoints_written(run_dir) == [0]  # the stage-end checkpoint


def test_mini_batches_take_an_optimizer_step_each_and_train_every_group_once(tmp_path, reference):
    """GRPOStage.mini_batches 2: each train step's two groups go to two optimizer steps (the LR schedule counts
    both; the checkpoint's scheduler holds 2 x STEPS), every group is still trained whole once at one step, and the
    first step's samples (drawn before any update) are the reference run's while its weights move twice. With an
    entropy bonus no group is left out as uniform (its entropy term has a gradient), so both groups always train;
    its target scales it by the shortfall (logged as rl/entropy_coef)."""
    from rl.checkpoint.format import TRAINER_JSON, find_checkpoint

    recipe = Recipe.model_validate({**RECIPE, "stages": [{**RECIPE["stages"][0], "mini_batches": 2,
                                                          "entropy_coef": 0.01, "entropy_target": 50.0}]})
    run_dir = tmp_path / "mini"
    with open_job(recipe, run_dir, say=lambda m: None) as job:
        job.state.stage_t0 = time.monotonic()
        run_async_grpo(job, recipe.stages[0], 0)
    samples, losses = trained(run_dir)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "rl/loss" in r]
    assert len(steps) == STEPS and all(r["train/optimizer_steps"] == 2 for r in steps)
    assert all(r["train/uniform_groups_skipped_total"] == 0 for r in steps) and all(r["rl/entropy"] > 0 for r in steps)
    # a target far above the entropy: the bonus's weight is 0.01 x (1 - H / 50), logged per step
    assert all(r["rl/entropy_coef"] == pytest.approx(0.01 * (1 - r["rl/entropy"] / 50.0), rel=0.05) for r in steps)
    assert len(samples) == STEPS * PROMPTS * G and sorted(losses) == list(range(1, STEPS + 1))
    first = {k: v for k, v in samples.items() if v[3] == 1}
    assert first == {k: v for k, v in reference[1].items() if v[3] == 1}
    state = json.loads((find_checkpoint(run_dir) / TRAINER_JSON).read_text())
    scheduler = dict(dict(state["tree"]["dict"])["scheduler"]["dict"])
    assert scheduler["last_epoch"] == 2 * STEPS


def test_a_pressured_kv_pool_parks_samples_and_a_stopped_job_resumes_to_the_same_samples(reference, tmp_path):
    """An engine pool of 14 blocks for 8 samples in flight that may each grow to 5 (issue #42): samples are parked and
    resumed as they grow (rollout/parks_total), the job trains what the roomy reference trains (the same tokens;
    log-probs and losses within float noise: parking changes which rows share a forward), and a job stopped at a token
    boundary with samples parked resumes to the same samples (the checkpoint holds parked states' KV too)."""
    _, samples, losses = reference
    tight = Recipe.model_validate({**RECIPE, "engine": {**RECIPE["engine"], "num_blocks": 14}})

    def same(run_dir: Path) -> None:
        got_samples, got_losses = trained(run_dir)
        assert got_samples.keys() == samples.keys()
        for sid, (tokens, logprobs, reward, step) in got_samples.items():
            ref = samples[sid]
            assert (tokens, reward, step) == (ref[0], ref[2], ref[3]), sid
            assert np.allclose(decode_array(logprobs, LOGPROB_DTYPE), decode_array(ref[1], LOGPROB_DTYPE), atol=1e-5), sid
        assert got_losses.keys() == losses.keys()
        assert all(abs(got_losses[k] - losses[k]) <= 1e-4 * max(1.0, abs(losses[k])) for k in losses)

    run_dir = tmp_path / "tight"
    assert run_stage(run_dir, recipe=tight)
    same(run_dir)
    last = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if "rl/loss" in x][-1]
    assert last["rollout/parks_total"] > 0 and last["rollout/parked_bytes_total"] > 0
    assert 0 < last["rollout/kv_used_frac"] <= 1
    stopped = tmp_path / "stopped"
    assert not run_stage(stopped, guard=lambda job: StopAtStep(job, 3), recipe=tight)
    assert run_stage(stopped, resume=True, recipe=tight)
    same(stopped)


@pytest.mark.parametrize("park", ["device", "host"])
def test_samples_kept_in_the_pool_during_train_steps_train_what_parked_copies_train(reference, tmp_path, park):
    """`engine.park_kv: pool` (the default: the reference) keeps the in-flight samples' KV where it is across each
    train step and weight update; copying it out and back (device, host) must train exactly the same samples."""
    _, samples, losses = reference
    recipe = Recipe.model_validate({**RECIPE, "engine": {**RECIPE["engine"], "park_kv": park}})
    assert Recipe.model_validate(RECIPE).engine.park_kv == "pool"
    run_dir = tmp_path / park
    assert run_stage(run_dir, recipe=recipe)
    assert trained(run_dir) == (samples, losses)
    moved = [json.loads(x)["async/state_bytes_moved"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
             if "async/state_bytes_moved" in x]
    ref_moved = [json.loads(x)["async/state_bytes_moved"] for x in (reference[0] / "metrics.jsonl").read_text().splitlines()
                 if "async/state_bytes_moved" in x]
    assert sum(moved) > 0 and sum(ref_moved) == 0  # in place: nothing copied at a train step


def test_long_tail_samples_end_at_their_drawn_lengths_whether_the_engine_is_told_or_meets_them(tmp_path):
    """rewards/longtail.py's two ways of holding a sample to its drawn length (issue #42): `budget` hands the length
    to the engine as max_new_tokens; `eos` gives every request the run's cap and ends the sample when it reaches the
    length, as a policy's own EOS would. Both must train samples of exactly the drawn lengths: the random policy's
    own EOS (about one token in a hundred here) must not cut an `eos` sample short, or a long-tail benchmark trains
    short samples (it did: a mean of 73 tokens against 1,661 drawn, on the H200)."""
    lengths = {}
    for mode in ("budget", "eos"):
        recipe = Recipe.model_validate({
            **RECIPE,
            "model": {**RECIPE["model"], "max_position_embeddings": 80},
            "datasets": [{"type": "longtail", "name": "tail", "median_tokens": 24, "sigma": 0.6, "max_tokens": 40,
                          "mode": mode}],
            "engine": {**RECIPE["engine"], "max_seq_len": 64, "max_new_tokens": 40},
            "stages": [{**RECIPE["stages"][0], "max_steps": 3}],
        })
        run_dir = tmp_path / mode
        assert run_stage(run_dir, recipe=recipe)
        with sqlite3.connect(run_dir / "trajectories.db") as c:
            lengths[mode] = {sid: len(toks) // 4 for sid, toks in c.execute(
                "select sample_id, response_tokens from samples where train_step is not null")}
    assert lengths["eos"] == lengths["budget"] and len(lengths["eos"]) == 3 * PROMPTS * G
    assert len(set(lengths["eos"].values())) > 3  # drawn lengths, not one cap
