"""One file split between two stages: SFT on its first rows, GRPO on the rest (`skip_rows`/`max_rows`,
`stages[i].datasets`), evaluated once on the shared held-out file (`eval.datasets`)."""

import json

import pytest

from rl.algo.async_grpo import run_async_grpo
from rl.config import Recipe
from rl.algo.driver import run_sft
from rl.algo.job import open_job
from rl.store.trajectories import TrajectoryStore

pytestmark = pytest.mark.integration

ROWS = [{"q": f"{a}+{b}=", "a": str(a + b)} for a in range(10) for b in range(10)]
SPLIT = 60  # rows 1..60 for SFT, 61..100 for GRPO


def _recipe(tmp_path) -> Recipe:
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "test.jsonl").write_text("".join(json.dumps({"q": f"{a}+{a}+{a}=", "a": str(3 * a)}) + "\n" for a in range(6)))
    common = {"type": "jsonl", "path": str(tmp_path / "d.jsonl"), "prompt": "q", "answer": "a", "verifier": "exact",
              "heldout": {"path": str(tmp_path / "test.jsonl")}}
    return Recipe.model_validate({
        "run": {"name": "split", "seed": 0, "num_threads": 1},
        "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                  "max_position_embeddings": 64, "ffn": {"type": "dense", "intermediate_size": 128}},
        "datasets": [{**common, "name": "sft_rows", "max_rows": SPLIT}, {**common, "name": "rl_rows", "skip_rows": SPLIT}],
        "engine": {"max_batch_size": 32, "max_seq_len": 48, "max_new_tokens": 4},
        "runtime": {"ray": False},
        "stages": [{"type": "sft", "max_steps": 3, "batch_size": 16, "datasets": ["sft_rows"]},
                   {"type": "grpo", "max_steps": 2, "prompts_per_step": 4, "group_size": 4, "micro_batch_size": 16,
                    "datasets": ["rl_rows"], "dispatch": {"max_inflight": 16}}],
        "eval": {"max_problems": 4, "datasets": ["sft_rows"]},
        "logging": {"wandb": False, "progress_bar": False},
    })


def test_each_stage_draws_only_from_its_datasets_and_eval_only_from_its_own(tmp_path):
    recipe = _recipe(tmp_path)
    run_dir = tmp_path / "run"
    with open_job(recipe, run_dir, checkpoints=False) as job:
        rows = {name: {p.metadata["row_number"] for p in task._train} for name, task in job.tasks.items()}
        assert rows == {"sft_rows": set(range(1, SPLIT + 1)), "rl_rows": set(range(SPLIT + 1, len(ROWS) + 1))}
        drawn = []  # the dataset of every train problem drawn, by either stage
        for task in job.tasks.values():
            def spy(*a, _real=task.train_stream, **k):
                for p in _real(*a, **k):
                    drawn.append(p.dataset)
                    yield p
            task.train_stream = spy
        run_sft(job, recipe.stages[0], 0)
        assert drawn and set(drawn) == {"sft_rows"}  # 3 steps of 16 demonstrations, none from the RL rows
        n_sft, drawn[:] = len(drawn), []
        run_async_grpo(job, recipe.stages[1], 1)
        assert drawn and set(drawn) == {"rl_rows"}
        metrics = job.evaluate()
    assert n_sft >= 3 * 16
    assert {k.split("/")[1] for k in metrics if k.count("/") == 2} == {"sft_rows"}  # the shared held-out file, once
    assert metrics["eval/sft_rows/num_problems"] == 4
    store = TrajectoryStore.read_run(run_dir)
    rows = store.query(limit=1000)
    samples = [store.get_sample(r.sample_id) for r in rows]
    store.close()
    assert len([r for r in rows if r.train_step is not None]) == 2 * 4 * 4
    assert {s.dataset for s in samples} == {"rl_rows"}
    assert {s.prompt_text for s in samples} <= {r["q"] for r in ROWS[SPLIT:]}
