"""File datasets through the `rl` command: every kind of bad input is one line and exit 2 (`rl validate` for
the first rows, `rl train` for a bad row further down, before the run directory or any worker exists), and a
tiny JSONL dataset with `verifier: exact` trains end to end (SFT, then GRPO) on the char tokenizer and is
evaluated by `rl eval`."""

import json
import sqlite3
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]
ROWS = [{"q": f"{a}+{b}=", "a": str(a + b)} for a in range(10) for b in range(10)]


def _recipe(tmp_path, dataset: dict, **over) -> str:
    recipe = {
        "run": {"name": "files", "seed": 0, "num_threads": 1},
        "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                  "max_position_embeddings": 64, "ffn": {"type": "dense", "intermediate_size": 128}},
        "datasets": [{"type": "jsonl", "name": "add", "prompt": "q", "answer": "a", "verifier": "exact", **dataset}],
        "engine": {"max_batch_size": 32, "max_seq_len": 48, "max_new_tokens": 4},
        "runtime": {"ray": False},
        "stages": [{"type": "sft", "max_steps": 30, "batch_size": 16, "optim": {"lr": 3e-3}},
                   {"type": "grpo", "max_steps": 2, "prompts_per_step": 4, "group_size": 4, "micro_batch_size": 16,
                    "dispatch": {"max_inflight": 16}}],
        "eval": {"max_problems": 8},
        "logging": {"wandb": False, "progress_bar": False},
        **over,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return str(path)


def _jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _cli(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def _one_line_exit_2(proc: subprocess.CompletedProcess, *parts: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and all(p in lines[0] for p in parts), proc.stderr
    return lines[0]


@pytest.mark.parametrize("case", ["missing file", "empty file", "row 1 without answer", "malformed line", "verifier misfit"])
def test_validate_refuses_bad_input_in_one_line(tmp_path, case):
    data = tmp_path / "d.jsonl"
    dataset, parts = {"path": str(data)}, [str(data)]
    if case == "missing file":
        parts.append("file not found")
    elif case == "empty file":
        _jsonl(data, [])
        parts.append("no rows (empty file)")
    elif case == "row 1 without answer":
        _jsonl(data, [{"q": "1+1="}, *ROWS])
        parts.append("row 1: field 'a': missing")
    elif case == "malformed line":
        _jsonl(data, [*ROWS[:2], '{"q": "1+1=", "a": "2"', *ROWS[2:]])
        parts.append("row 3: not valid JSON (Expecting ',' delimiter at column 23)")
    else:
        _jsonl(data, ROWS)
        dataset["verifier"] = "python:tests.tasks.reward_fns:two_args"
        parts = ["datasets.0.verifier", "reward function 'tests.tasks.reward_fns:two_args' does not fit RewardFunction",
                 "does not accept (trajectory, answer, row)"]
    line = _one_line_exit_2(_cli("validate", _recipe(tmp_path, dataset)), *parts)
    assert line.startswith(f"rl validate: recipe error: {tmp_path / 'recipe.yaml'}:")  # with the dataset's YAML line


def test_a_bad_row_past_the_first_rows_passes_validate_and_stops_train_before_anything_starts(tmp_path):
    data = tmp_path / "d.jsonl"
    _jsonl(data, [*ROWS[:6], {"q": "6+6=", "answer": "12"}, *ROWS[6:]])
    recipe = _recipe(tmp_path, {"path": str(data)})
    run_dir = tmp_path / "run"
    with ThreadPoolExecutor(max_workers=2) as pool:  # independent: `rl validate` runs beside `rl train`
        valid, proc = pool.map(lambda args: _cli(*args), [("validate", recipe), ("train", recipe, "--run-dir", str(run_dir))])
    assert valid.returncode == 0  # validate reads the first 5 rows: it stays instant
    assert _one_line_exit_2(proc, f"{data}: row 7: field 'a': missing") == f"rl train: {data}: row 7: field 'a': missing"
    assert not run_dir.exists() and "worker" not in proc.stdout  # no run directory, store or worker was made


def test_a_jsonl_dataset_trains_end_to_end(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", ROWS)
    recipe = _recipe(tmp_path, {"path": data, "chat": True, "system": "sum", "heldout": {"fraction": 0.2, "seed": 1}})
    run_dir = tmp_path / "run"
    proc = _cli("train", recipe, "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dataset add: 80 train rows, 20 held out (20 of 100 distinct prompts (fraction 0.2, seed 1))" in proc.stdout
    assert "RESULT sft_acc=" in proc.stdout and "grpo_acc=" in proc.stdout
    from rewards.datasets import JsonlDatasetConfig

    heldout = {p.prompt for p in JsonlDatasetConfig(name="add", path=data, prompt="q", answer="a", verifier="exact",
                                                                 heldout={"fraction": 0.2, "seed": 1}).build().heldout()}
    with sqlite3.connect(run_dir / "trajectories.db") as c:
        rows = c.execute("select prompt_text, response_text, reward, reason, train_step from samples").fetchall()
    assert sum(r[4] is not None for r in rows) == 2 * 4 * 4  # two GRPO steps of whole groups
    for prompt_text, response, reward, reason, _ in rows:
        system, user = prompt_text.split("\n")  # the char tokenizer's chat template: one message per line
        assert system == "sum" and user not in heldout  # no held-out prompt in training
        answer = str(eval(user[:-1]))
        last = response.strip().splitlines()[-1].strip() if response.strip() else ""
        assert reward == float(last == answer) and reason.startswith("answer" if response.strip() else "empty")
    # the training problems scored greedily (the train file as the held-out file), every response written out
    out = tmp_path / "responses.jsonl"
    ev = _cli("eval", str(run_dir), "--set", "datasets.0.heldout.fraction=null", "--set", f"datasets.0.heldout.path={data}",
              "--max-problems", "12", "--responses", str(out))
    assert ev.returncode == 0, ev.stderr[-2000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["row_number"] for r in records] == list(range(1, 13))  # the train file's first rows (1-based), in order
    for r, row in zip(records, ROWS):
        assert r["answer"] == row["a"]
        last = r["response"].strip().splitlines()[-1].strip() if r["response"].strip() else ""
        assert r["correct"] == (last == r["answer"]) and r["response_tokens"] > 0 and r["dataset"] == "add"
    printed = next(line.split() for line in ev.stdout.splitlines() if line.split()[:2] == ["-", "add"])
    assert float(printed[2]) == round(sum(r["correct"] for r in records) / 12, 3) and printed[-1] == "12"
    _jsonl(tmp_path / "d.jsonl", [*ROWS[:50], {"q": "x"}, *ROWS[50:]])  # the file changed since: `rl eval` says where
    _one_line_exit_2(_cli("eval", str(run_dir)), f"rl eval: {data}: row 51: field 'a': missing")
