"""Effort-conditioned GRPO in-process: prefixes, per-level subgroups in one dispatched group, penalty."""

from collections import Counter, defaultdict

import pytest

from rewards.effort import effort_prefix
from rl.algo.async_grpo import run_async_grpo
from rl.config import Recipe
from rl.algo.job import open_job
from rl.store.trajectories import TrajectoryStore

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RECIPE = {
    "run": {"name": "effort", "seed": 0, "num_threads": 1},
    "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "init_std": 0.15,
              "ffn": {"type": "moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}},
    "datasets": [{"type": "arithmetic", "max_digits": 3, "num_heldout": 8}],
    "effort": {"levels": [25, 100], "samples_per_level": 3, "k0": 1.0, "c_max": 0.5, "l_norm": 8},
    "engine": {"max_batch_size": 48, "max_seq_len": 160, "max_new_tokens": 24},
    "runtime": {"ray": False},
    "stages": [{"type": "grpo", "max_steps": 2, "prompts_per_step": 4, "group_size": 6,
                "dispatch": {"max_inflight": 24}}],
    "logging": {"wandb": False, "progress_bar": False},
}


def test_effort_groups_subgroups_and_penalty(tmp_path):
    recipe = Recipe.model_validate(RECIPE)
    with open_job(recipe, tmp_path, checkpoints=False) as job:
        run_async_grpo(job, recipe.stages[0], 0)
        task = job.tasks["arith"]
    store = TrajectoryStore.read_run(tmp_path)
    trained = [store.get_sample(r.sample_id) for r in store.query(limit=1000) if r.train_step is not None]
    assert len(trained) == 2 * 4 * 6
    per_prompt = defaultdict(Counter)
    for s in trained:
        prompt_id, effort = s.group_id.split("@")
        assert prompt_id == s.prompt_id and s.effort == int(effort)
        per_prompt[prompt_id][int(effort)] += 1
        assert s.prompt_text.startswith(effort_prefix(int(effort)) + "\n")
        expected = float(s.correct) + recipe.effort.length_penalty(int(effort), len(task.reasoning(s.response_text)))
        assert s.reward == pytest.approx(expected)
    # the dispatcher released one group of Σ M_b = 6 per prompt: 3 samples at each level
    assert all(c == {25: 3, 100: 3} for c in per_prompt.values())
    assert any(s.reward < float(s.correct) for s in trained)  # the penalty bit somewhere
    # every step logs reward / accuracy / length per effort level, over exactly that step's samples
    for step in {s_.train_step for s_ in (store.query(limit=1000)) if s_.train_step is not None}:
        metrics = store.train_step_metrics(step)
        for b in (25, 100):
            mine = [s for s in trained if s.effort == b and store.sample_train_step(s.sample_id) == step]
            assert metrics[f"rollout/response_len/effort{b}"] == pytest.approx(
                sum(s.num_response_tokens for s in mine) / len(mine))
            assert metrics[f"rollout/reward/effort{b}"] == pytest.approx(sum(s.reward for s in mine) / len(mine))
    store.close()
