"""Repercussion (rl/algo/repercussion.py, seed §5.1.3): a sample a sandbox failure ended carries its reason from the
worker's record to the `Sample`, the store and the step's metrics, and `tools.on_failure` decides what the trained
batch sees: reward 0 inside the group's baseline (zero_reward), or no tokens and no say in the baseline
(leave_loss)."""

from __future__ import annotations

import pytest

from model.tokenizer import CharTokenizer
from rewards.task import Problem, Verdict
from rl.train.losses import group_advantages
from rl.algo.rendering import Renderer
from rl.algo.repercussion import FAILURES, failure_counts, failure_of, settle, trained
from rl.store.trajectories import TrajectoryStore
from rl.train.trainer import TrainBatch
from rl.types import Prompt
from rollout.types import Generation
from sandbox_client.records import REASONS
from tests.unit.test_store import make_sample

TOK = CharTokenizer()


def test_every_reason_the_server_kills_for_is_a_failure():
    assert set(REASONS) - {"ok"} <= set(FAILURES) and "sandbox_error" in FAILURES


def test_a_failed_call_becomes_the_samples_failure_and_its_last_empty_turn(tmp_path):
    call = "```python\nx = b'x' * (1 << 30)\n```"
    tokens = tuple(TOK.encode(call))
    n = len(tokens)
    record = {"tool": "python", "call": "x = ...", "status": "error", "exit_code": None, "wall_s": 0.2,
              "output": "[killed: memory limit]", "truncated": False, "failure": "memory", "start": n, "end": n}
    g = Generation("p0-0", (1, 2), tokens, (-0.5,) * n, (0,) * n, "tool_failure", None, tool_turns=(record,))
    assert failure_of(g.tool_turns) == "memory" and failure_of([{"status": "ok", "failure": None}]) is None
    renderer = Renderer(TOK, {}, None, 0, None)
    prompt = Prompt("p0", "d", "q", (1, 2), "4", 4, 0)
    s = renderer.to_sample(prompt, Problem("p0", "d", "q", answer="4"), g, Verdict(0.0, False, "no answer"))
    assert s.failure == "memory" and s.finish_reason == "tool_failure"
    model, tool = s.turns
    assert (model.kind, model.start, model.end) == ("model", 0, n)
    assert (tool.kind, tool.start, tool.end, tool.status, tool.text) == ("tool", n, n, "error", "[killed: memory limit]")
    assert s.loss_mask_T() == (1,) * n  # nothing was appended: every token is the model's
    store = TrajectoryStore.for_run_dir(tmp_path / "run")  # samples.failure (revision 0005)
    store.add_samples([s, make_sample("p0-1")])
    assert store.get_sample("p0-0").failure == "memory" and store.get_sample("p0-1").failure is None
    assert [r.sample_id for r in store.query(failure="memory")] == ["p0-0"]
    store.close()


def _group():
    """A group of four, rewards 1, 0, 1 and a failed sample whose verifier said 1 (long: 20 tokens)."""
    return [make_sample("g-0", reward=1.0), make_sample("g-1", reward=0.0), make_sample("g-2", reward=1.0),
            make_sample("g-3", reward=1.0, versions=(3,) * 20, failure="timeout", reason="answer 4")]


def test_zero_reward_trains_the_failure_at_reward_0_inside_the_baseline():
    samples = [settle(s, "zero_reward") for s in _group()]
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 0.0]
    assert samples[3].reason == "tool failure (timeout): reward 0 (tools.on_failure=zero_reward); verifier: answer 4"
    rows = trained(samples, "zero_reward")
    assert len(rows) == 4
    adv = group_advantages([s.reward for s in rows], [s.group_id for s in rows], std_normalize=False)
    assert adv == [0.5, -0.5, 0.5, -0.5]  # the baseline (0.5) counts the failure; the failure is pushed down
    batch = TrainBatch.from_samples(rows, adv, float(sum(s.num_trained_tokens for s in rows)))
    assert len(batch) == 4 and batch.num_tokens == 6 + 6 + 6 + 20


def test_leave_loss_takes_the_failure_out_of_the_loss_and_the_baseline():
    samples = [settle(s, "leave_loss") for s in _group()]
    assert samples == _group()  # stored as the verifier scored it
    rows = trained(samples, "leave_loss")
    assert [s.sample_id for s in rows] == ["g-0", "g-1", "g-2"]
    adv = group_advantages([s.reward for s in rows], [s.group_id for s in rows], std_normalize=True)
    # mean and std of the three others (2/3, 0.471): the failure's reward of 1 would have moved both
    assert adv == pytest.approx([0.7071, -1.4142, 0.7071], abs=1e-4)
    batch = TrainBatch.from_samples(rows, adv, float(sum(s.num_trained_tokens for s in rows)))
    assert batch.num_tokens == 18 and len(batch) == 3
    assert all(len(r) == 6 for r in batch.responses_B)  # none of its 20 tokens is in the step
    only_failures = [make_sample("f", failure="crashed")]
    assert trained(only_failures, "leave_loss") == [] and trained(only_failures, "zero_reward") == only_failures


def test_failures_are_counted_per_reason_every_reason_a_series():
    m = failure_counts(_group() + [make_sample("x", failure="timeout"), make_sample("y", failure="refused")])
    assert m["rollout/tool_failures/timeout"] == 2 and m["rollout/tool_failures/refused"] == 1
    assert m["rollout/tool_failures/memory"] == 0 and m["rollout/tool_failures"] == 3
    assert set(m) == {f"rollout/tool_failures/{r}" for r in FAILURES} | {"rollout/tool_failures"}
