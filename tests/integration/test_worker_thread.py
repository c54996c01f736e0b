"""runtime.worker_thread: an in-process PolicyWorker whose calls run on a thread of their own, so that the pipelined
rollout calls of rl/async_grpo.py overlap the controller's work with the engine's as with a Ray actor (the default on
CUDA; forced on here, on CPU). The run is as deterministic as one without the thread, loses nothing a queued call
finished, and its batches' interrupts land at most one queued call late."""

import threading

import pytest

from rl.async_grpo import run_async_grpo
from rl.config import Recipe
from rl.job import open_job
from rl.runtime import Group
from rl.store import TrajectoryStore

pytestmark = pytest.mark.integration

STEPS, PROMPTS, G = 3, 4, 4

RECIPE = {
    "run": {"name": "thread", "seed": 0, "num_threads": 1},
    "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16, "init_std": 0.15,
              "max_position_embeddings": 96},
    "datasets": [{"type": "arithmetic", "max_digits": 2, "num_heldout": 4}],
    "engine": {"max_batch_size": 32, "block_size": 8, "max_seq_len": 64, "max_new_tokens": 30},
    "runtime": {"ray": False},
    "stages": [{"type": "grpo", "max_steps": STEPS, "prompts_per_step": PROMPTS, "group_size": G, "micro_batch_size": 16,
                "optim": {"lr": 1e-3}, "dispatch": {"policy": "sample", "max_inflight": 24}}],
    "logging": {"wandb": False, "progress_bar": False},
}


def _run(run_dir, worker_thread: bool | None):
    recipe = Recipe.model_validate({**RECIPE, "runtime": {"ray": False, "worker_thread": worker_thread}})
    with open_job(recipe, run_dir, checkpoints=False) as job:
        clock = run_async_grpo(job, recipe.stages[0], 0).clock
        info = job.policy.info()
    store = TrajectoryStore.read_run(run_dir)
    trained = sorted((r.sample_id, store.sample_train_step(r.sample_id), tuple(store.get_sample(r.sample_id).response_tokens))
                     for r in store.query(limit=10_000) if r.train_step is not None)
    finished = sum(r.status == "finished" for r in store.query(limit=10_000))
    store.close()
    return clock, info[0], trained, finished


def test_a_threaded_worker_pipelines_its_calls_deterministically_and_loses_nothing(tmp_path):
    clock, info, trained, finished = _run(tmp_path / "a", True)
    assert clock.pipelined_calls > 0  # the next call was queued on the worker's thread before reading the last
    assert len(trained) == STEPS * PROMPTS * G and len({s for s, *_ in trained}) == len(trained)
    assert [step for _, step, _ in trained].count(STEPS) == PROMPTS * G
    assert finished >= len(trained) and info["free_blocks"] == info["kv_blocks"] and info["reprefill_tokens"] == 0
    assert len(clock.interrupt_late_steps) == STEPS and max(clock.interrupt_late_steps) <= 1
    again = _run(tmp_path / "b", True)
    assert again[2] == trained  # the same samples, tokens and steps: the thread changes when work runs, not what
    inline = _run(tmp_path / "c", None)  # the default on CPU: no thread, calls in the controller's thread
    assert inline[0].pipelined_calls == 0 and len(inline[2]) == len(trained)


class _Member:
    def __init__(self):
        self.seen: list[tuple[int, int]] = []
        self.gate = threading.Event()

    def call(self, i: int) -> int:
        if i == 0:
            self.gate.wait(10)
        self.seen.append((i, threading.get_ident()))
        return i * i

    def fail(self) -> None:
        raise ValueError("the member's own error")


def test_a_threaded_group_runs_a_members_calls_in_order_off_the_callers_thread():
    member = _Member()
    group = Group([member], remote=False, threaded=True)
    futures = [group.submit(0, "call", i) for i in range(4)]
    assert not group.ready(futures)  # queued behind the first, which waits: the caller went on
    member.gate.set()
    assert group.get(futures) == [0, 1, 4, 9] and group.ready(futures)
    assert [i for i, _ in member.seen] == [0, 1, 2, 3] and {t for _, t in member.seen} != {threading.get_ident()}
    with pytest.raises(ValueError, match="the member's own error"):
        group.get(group.submit(0, "fail"))
    group.close()
    inline = Group([_Member()], remote=False)
    assert not inline.queues_calls and group.queues_calls
    with pytest.raises(ValueError, match="not threaded"):
        Group([member], remote=True, threaded=True)
