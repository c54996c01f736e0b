"""Prompts longer than engine.max_prompt_tokens (issue 40, class 7): found before anything starts, as one line naming
the row and its length (`engine.overlong_prompts: refuse`, the default) or skipped and counted (`drop`); a dataset
none of whose prompts fits is refused either way, and a refused `rl train` leaves no run directory behind, so the
same command runs once the recipe is fixed."""

import json
import subprocess
import sys

import pytest
import yaml

from model.tokenizer import CharTokenizer
from rl.algo.prompt_lengths import check_prompt_lengths
from rl.algo.rendering import Renderer
from rl.config import Recipe

CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]
LONG = "9" * 40 + "+1="


def _recipe(tmp_path, rows, **engine) -> dict:
    (tmp_path / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"run": {"name": "long", "seed": 0, "num_threads": 1},
            "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
                      "max_position_embeddings": 64, "ffn": {"type": "dense", "intermediate_size": 32}},
            "datasets": [{"type": "jsonl", "name": "x", "path": str(tmp_path / "x.jsonl"), "prompt": "q", "answer": "a",
                          "verifier": "exact", "heldout": {"fraction": 0.2}}],
            "engine": {"max_batch_size": 8, "block_size": 4, "max_seq_len": 32, "max_new_tokens": 6, **engine},
            "runtime": {"ray": False}, "stages": [{"type": "sft", "max_steps": 1, "batch_size": 2}],
            "logging": {"wandb": False, "progress_bar": False}, "eval": {"max_problems": 2}}


def _check(recipe: dict, said: list | None = None, preview: bool = False):
    r = Recipe.model_validate(recipe)
    tasks = {d.name: d.build() for d in r.datasets}
    for t in tasks.values():
        getattr(t, "scan", lambda: None)()
    renderer = Renderer(CharTokenizer(), tasks, r.effort, 0, r.engine.prompt_limit)
    check_prompt_lengths(renderer, tasks, r.engine.overlong_prompts, r.effort.levels if r.effort else (),
                         (said if said is not None else []).append, preview=preview)


def test_refuse_names_the_row_its_length_and_the_option(tmp_path):
    rows = [{"q": f"{i}+1=", "a": str(i + 1)} for i in range(8)] + [{"q": LONG, "a": "1"}]
    with pytest.raises(ValueError) as e:
        _check(_recipe(tmp_path, rows))
    line = str(e.value)
    assert line.startswith(f"{tmp_path / 'x.jsonl'}: row 9: the prompt has 44 tokens, more than engine.max_prompt_tokens=31")
    assert "engine.overlong_prompts: drop" in line and "\n" not in line
    said = []
    _check(_recipe(tmp_path, rows, overlong_prompts="drop"), said)  # drop: counted, not refused
    assert said == ["dataset x: 1 of 9 prompts are longer than 31 tokens and are skipped (engine.overlong_prompts: drop)"]


def test_every_prompt_too_long_is_refused_even_with_drop_and_procedural_datasets_are_checked(tmp_path):
    with pytest.raises(ValueError, match=r"dataset x: all 3 prompts checked are longer than engine.max_prompt_tokens=31"):
        _check(_recipe(tmp_path, [{"q": LONG + str(i), "a": "1"} for i in range(3)], overlong_prompts="drop"))
    arith = {**_recipe(tmp_path, [{"q": "1+1=", "a": "2"}] * 2, max_prompt_tokens=4),
             "datasets": [{"type": "arithmetic", "name": "arith", "max_digits": 3, "num_heldout": 4}]}
    with pytest.raises(ValueError, match=r"dataset arith: problem arith:\S+: the prompt has \d+ tokens, more than "
                                         r"engine.max_prompt_tokens=4"):
        _check(arith, preview=True)


def _train_long(tmp_path) -> tuple[list, subprocess.CompletedProcess]:
    rows = [{"q": f"{i}+1=", "a": str(i + 1)} for i in range(8)] + [{"q": LONG, "a": "1"}]
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(_recipe(tmp_path, rows)))
    cmd = [*CLI, "train", "r.yaml", "--run-dir", "run"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[0].startswith(f"rl train: {tmp_path / 'x.jsonl'}: row 9: the prompt has 44 tokens")
    assert not (tmp_path / "run").exists()
    return rows, cmd


@pytest.mark.integration
def test_rl_train_refuses_before_the_run_directory_exists(tmp_path):
    _train_long(tmp_path)


@pytest.mark.integration
@pytest.mark.slow
def test_the_same_command_runs_once_the_dataset_is_fixed(tmp_path):
    rows, cmd = _train_long(tmp_path)
    (tmp_path / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:8]))
    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]


@pytest.mark.integration
def test_validate_refuses_a_procedural_dataset_whose_prompts_are_too_long(tmp_path):
    recipe = {**_recipe(tmp_path, [{"q": "1+1=", "a": "2"}] * 2, max_prompt_tokens=4),
              "datasets": [{"type": "arithmetic", "name": "arith", "max_digits": 3, "num_heldout": 4}]}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    proc = subprocess.run([*CLI, "validate", "r.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[0].startswith("rl validate: dataset arith: problem arith:") and "engine.max_prompt_tokens=4" in lines[0]
