"""Prompts longer than the engine takes are dropped and counted, never sent to the engine: the engine's limit,
the renderer's draw, held-out evaluation on a real engine, and the GRPO loop's `rollout/prompts_too_long`."""

import json
import sqlite3
import time

import pytest
from pydantic import ValidationError

from model.tokenizer import CharTokenizer
from rewards.effort import EffortConfig
from rewards.task import Problem, Task, Verdict
from rl.algo.evaluation import engine_generate, evaluate
from rl.algo.rendering import Renderer
from rl.algo.streams import Cursor
from rollout.config import EngineConfig


class Lengths(Task):
    """Prompts "x" * n for a cycle of lengths; the answer is the prompt's first letter."""

    def __init__(self, name: str, lengths=(3, 30, 4, 50, 5)):
        self.name, self.lengths = name, lengths

    def _problem(self, i: int) -> Problem:
        n = self.lengths[i % len(self.lengths)]
        return Problem(f"{self.name}:{i}", self.name, "x" * n, "x")

    def train_stream(self, seed_offset: int = 0):
        i = 0
        while True:
            yield self._problem(i)
            i += 1

    def heldout(self):
        return [self._problem(i) for i in range(5)]

    def verify(self, trajectory, ctx):
        return Verdict(1.0, True)


def test_engine_config_prompt_limit():
    assert EngineConfig(max_seq_len=64).prompt_limit == 63
    assert EngineConfig(max_seq_len=64, max_prompt_tokens=40).prompt_limit == 40
    with pytest.raises(ValidationError, match="max_prompt_tokens=64 leaves no room for a response in max_seq_len=64"):
        EngineConfig(max_seq_len=64, max_prompt_tokens=64)


def test_draw_fitting_skips_and_counts_long_prompts():
    r = Renderer(CharTokenizer(), {}, max_prompt_tokens=10)  # BOS + up to 9 characters
    cursor = Cursor(Lengths("len"), seed_offset=0)
    drawn = [r.draw_fitting(cursor) for _ in range(3)]
    assert [(p.problem_id, d) for p, _, d in drawn] == [("len:0", 0), ("len:2", 1), ("len:4", 1)]
    assert drawn[0][1] == {None: ("xxx", (1, *CharTokenizer().encode("xxx")))} and cursor.drawn == 5  # drops count
    assert Renderer(CharTokenizer(), {}).draw_fitting(Cursor(Lengths("len"), 0))[2] == 0  # no limit: nothing dropped
    # with effort levels a prompt must fit under every level's prefix
    effort = EffortConfig(levels=[25, 100])
    long_prefix = len(Renderer(CharTokenizer(), {}, effort).prompt_tokens(Problem("p", "d", "xxx"), 100))
    r2 = Renderer(CharTokenizer(), {}, effort, max_prompt_tokens=long_prefix)
    assert r2.fits(r2.prompt_tokens(Problem("p", "d", "xxxx"), 25))  # "xxxx" fits at level 25, not at 100
    _, ids, dropped = r2.draw_fitting(Cursor(Lengths("e", (4, 3)), 0), [25, 25, 100, 100])
    assert sorted(ids) == [25, 100] and dropped == 1 and len(ids[100].ids) == long_prefix
    with pytest.raises(ValueError, match=r"4 prompts in a row of dataset 'len' are longer than engine.max_prompt_tokens=2"):
        Renderer(CharTokenizer(), {}, max_prompt_tokens=2).draw_fitting(Cursor(Lengths("len"), 0), max_dropped=3)


def test_evaluation_leaves_out_and_counts_long_prompts(moe_model):
    """A real engine refuses a prompt it cannot hold (ValueError); evaluation never hands it one."""
    cfg = EngineConfig(max_batch_size=4, block_size=4, max_seq_len=24, max_new_tokens=4)
    task = Lengths("len")
    generate = engine_generate(moe_model, cfg, eos_id=2)
    with pytest.raises(ValueError, match="max_seq_len is 24"):
        evaluate(generate, Renderer(CharTokenizer(), {"len": task}), {"len": task}, max_new_tokens=4)
    m = evaluate(generate, Renderer(CharTokenizer(), {"len": task}, max_prompt_tokens=cfg.prompt_limit), {"len": task},
                 max_new_tokens=4)
    assert m["eval/len/prompts_too_long"] == 2 and m["eval/len/num_problems"] == 3 and m["eval/accuracy"] == 1.0
    none_fit = evaluate(generate, Renderer(CharTokenizer(), {"len": task}, max_prompt_tokens=2), {"len": task}, max_new_tokens=4)
    assert none_fit["eval/len/prompts_too_long"] == 5 and none_fit["eval/len/num_problems"] == 0
    assert none_fit["eval/accuracy"] != none_fit["eval/accuracy"]  # nan: nothing was evaluated


@pytest.mark.integration
def test_grpo_loop_drops_long_prompts_and_logs_the_count(tmp_path):
    from rl.algo.async_grpo import run_async_grpo
    from rl.config import Recipe
    from rl.algo.job import open_job

    recipe = Recipe.model_validate({
        "run": {"name": "long", "seed": 0, "num_threads": 1},
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
                  "max_position_embeddings": 64, "ffn": {"type": "dense", "intermediate_size": 32}},
        "datasets": [{"type": "arithmetic", "name": "arith", "max_digits": 2, "num_heldout": 4}],
        "engine": {"max_batch_size": 8, "block_size": 4, "max_seq_len": 32, "max_new_tokens": 6, "max_prompt_tokens": 6,
                   "overlong_prompts": "drop"},
        "runtime": {"ray": False},
        "stages": [{"type": "grpo", "max_steps": 2, "prompts_per_step": 2, "group_size": 2, "micro_batch_size": 8,
                    "dispatch": {"max_inflight": 4}}],
        "logging": {"wandb": False, "progress_bar": False}, "eval": {"max_problems": 4},
    })
    with open_job(recipe, tmp_path / "run", say=lambda m: None, checkpoints=False) as job:
        job.state.stage_t0 = time.monotonic()
        run_async_grpo(job, recipe.stages[0], 0)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    counts = [r["rollout/prompts_too_long"] for r in rows if "rollout/prompts_too_long" in r]
    assert len(counts) == 2 and counts[-1] > 0 and counts == sorted(counts)  # "a+b=" prompts of 7 tokens dropped
    with sqlite3.connect(tmp_path / "run" / "trajectories.db") as c:
        texts = [r[0] for r in c.execute("select text from prompts")]
    assert texts and all(len(t) <= 5 for t in texts)  # BOS + at most 5 characters
