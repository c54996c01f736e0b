"""A task written outside rewards/ (tests/tasks/palindromes.py: chat-message prompts, a yes/no verifier)
enters through the recipe (`type: custom`) and trains through the public seam, SFT then GRPO, with no
change to rl/. A task that does not fit the protocol is refused by `rl validate` with one line."""

import sqlite3
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from rewards.task import Trajectory, VerifyContext
from tests.tasks.palindromes import Palindromes

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]
TASK = {"type": "custom", "name": "pal", "task": "tests.tasks.palindromes:Palindromes", "args": {"num_heldout": 16}}
RECIPE = {
    "run": {"name": "custom", "seed": 0, "num_threads": 1},
    "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
              "max_position_embeddings": 96, "ffn": {"type": "dense", "intermediate_size": 128}},
    "datasets": [TASK],
    "engine": {"max_batch_size": 32, "max_seq_len": 64, "max_new_tokens": 8},
    "runtime": {"ray": False},
    "stages": [{"type": "sft", "max_steps": 30, "batch_size": 16, "optim": {"lr": 3e-3}},
               {"type": "grpo", "max_steps": 3, "prompts_per_step": 4, "group_size": 4, "micro_batch_size": 16,
                "dispatch": {"max_inflight": 16}}],
    "logging": {"wandb": False, "progress_bar": False},
}


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)


def test_custom_task_trains_through_the_recipe(tmp_path):
    recipe = tmp_path / "custom.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    run_dir = tmp_path / "run"
    with ThreadPoolExecutor(max_workers=2) as pool:  # independent: `rl validate` runs beside `rl train`
        valid, proc = pool.map(lambda args: _cli(*args), [("validate", str(recipe)),
                                                          ("train", str(recipe), "--run-dir", str(run_dir))])
    assert valid.returncode == 0, valid.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT sft_acc=" in proc.stdout and "grpo_acc=" in proc.stdout
    task = Palindromes("pal")
    with sqlite3.connect(run_dir / "trajectories.db") as c:
        rows = c.execute("select prompt_text, response_text, reward, correct, train_step, reason, sample_id "
                         "from samples").fetchall()
    assert sum(r[4] is not None for r in rows) == 3 * 4 * 4  # every GRPO step trained whole groups
    for prompt_text, response, reward, correct, _, reason, _ in rows:
        system, user = prompt_text.split("\n")  # the char tokenizer's chat template: one message per line
        assert system == Palindromes.SYSTEM and user.startswith("pal ") and user.endswith("?")
        word = user[4:-1]
        problem = task.problem_for(word)
        verdict = task.verify(Trajectory.single(problem, response), VerifyContext())
        assert (verdict.reward, verdict.correct, verdict.reason) == (reward, bool(correct), reason)  # its own verifier
    show = _cli("traj", "show", str(run_dir), rows[0][6])
    assert show.returncode == 0 and f"({rows[0][5]})" in show.stdout  # the verdict's reason, beside the reward


@pytest.mark.parametrize("dataset, message", [
    (dict(TASK, task="tests.tasks.palindromes:NotATask"), "does not implement the Task protocol (rewards/task.py): missing verify"),
    (dict(TASK, task="tests.tasks.no_such_module:X"), "cannot import task module 'tests.tasks.no_such_module'"),
    (dict(TASK, task="tests.tasks.palindromes:Nope"), "module 'tests.tasks.palindromes' has no class 'Nope'"),
    (dict(TASK, task="not a path"), "String should match pattern"),
])
def test_a_task_that_does_not_fit_is_refused_in_one_line(tmp_path, dataset, message):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(yaml.safe_dump(dict(RECIPE, datasets=[dataset])))
    proc = _cli("validate", str(recipe))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "datasets.0" in proc.stderr
