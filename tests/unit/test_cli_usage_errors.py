"""Usage errors of the `rl` command are one line and exit 2, like its other expected failures (issue #13):
argparse's own errors included, and values that validate but could not run."""

import subprocess
import sys

import pytest

CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]


@pytest.mark.parametrize("args, needle", [
    (["eval", "runs/none", "--max-problems", "-1000"], "rl eval: argument --max-problems: must be at least 1, got -1000"),
    (["eval", "runs/none", "--max-problems", "x"], "rl eval: argument --max-problems: not an integer: 'x'"),
    (["train"], "rl train: the following arguments are required: recipe"),
    (["nosuch"], "rl: argument command: invalid choice: 'nosuch'"),
    (["validate", "configs/quickstart.yaml", "--set", "engine.num_blocks=1"],
     "num_blocks=1 of block_size=16 hold 16 tokens, fewer than one sequence of max_seq_len=160"),
    # formerly a "rollout stalled" RuntimeError minutes in: completed groups waiting for the step count as in flight
    (["validate", "configs/quickstart.yaml", "--set", "stages.1.dispatch.max_inflight=200"],
     "stages.1.dispatch.max_inflight=200 is below one train step's samples (prompts_per_step=32 x group_size=8 = 256)"),
    (["validate", "configs/opd.yaml", "--set", "stages.1.dynamic_sampling=true"],
     "stages.1: Value error, dynamic_sampling drops groups whose rewards are equal; an OPD stage's teacher signal"),
])
def test_usage_errors_are_one_line_exit_2(args, needle):
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr


@pytest.mark.slow
def test_a_procedural_heldout_set_too_large_for_its_space_is_one_line_before_training(tmp_path):
    """One- and two-digit sums have 100 instances, ~10 of them held out: 16 cannot be drawn. Said by `rl validate`,
    and by `rl train` before any training (it was a traceback at the first evaluation, after the SFT stage)."""
    sets = [a for s in ("datasets.0.max_digits=1", "datasets.0.num_heldout=16", "logging.wandb=false") for a in ("--set", s)]
    line = "dataset 'arith' (type arithmetic): found only 7 distinct held-out instances of num_heldout=16: the instance space"
    run_dir = tmp_path / "run"
    for args in (["validate", "configs/quickstart.yaml"], ["train", "configs/quickstart.yaml", "--run-dir", str(run_dir)]):
        proc = subprocess.run([*CLI, *args, *sets], capture_output=True, text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and line in lines[0], proc.stderr[-2000:]
    assert not run_dir.exists()  # refused before the run directory, the store or any worker


@pytest.mark.slow
@pytest.mark.parametrize("ray", ["false", "true"])
def test_a_kv_memory_fraction_too_small_for_one_sequence_is_one_line_exit_2(tmp_path, ray):
    """Said by the engine as it starts, in-process or in a Ray worker's constructor (then as the worker's failure
    to start: no resume hint, nothing was lost)."""
    proc = subprocess.run([*CLI, "train", "configs/quickstart.yaml", "--run-dir", str(tmp_path / "run"), "--set",
                           "engine.kv_memory_fraction=1e-12", "--set", f"runtime.ray={ray}", "--set", "logging.wandb=false"],
                          capture_output=True, text=True, timeout=180)
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("rl train")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "engine.kv_memory_fraction=1e-12" in lines[0] and "fewer than one sequence of max_seq_len=160" in lines[0]
    assert "rl resume" not in lines[0]


def test_rl_eval_responses_to_a_path_that_cannot_be_written_is_one_line_exit_2(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "recipe.yaml").write_text((__import__("pathlib").Path("configs/quickstart.yaml")).read_text())
    (tmp_path / "file").write_text("")
    proc = subprocess.run([*CLI, "eval", str(run_dir), "--responses", str(tmp_path / "file" / "r.jsonl")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"rl eval: --responses {tmp_path / 'file' / 'r.jsonl'}: File exists"], proc.stderr  # its folder is a file


def test_help_still_prints_the_usage():
    proc = subprocess.run([*CLI, "eval", "-h"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--max-problems" in proc.stdout


def test_nested_aliases_and_huge_files_are_refused_before_anything_is_built(tmp_path):
    """A 400-byte "billion laughs" recipe expands to 4.9e8 nodes: counted in linear time, refused in one line."""
    import time

    bomb = tmp_path / "bomb.yaml"
    rows = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    bomb.write_text("\n".join(rows) + "\n")
    huge = tmp_path / "huge.yaml"
    huge.write_text("run: {name: x}\n" + "# padding\n" * 120_000)
    for path, needle in ((bomb, "recipe expands to 490329064 YAML nodes"), (huge, "characters; the limit is 1048576")):
        t0 = time.monotonic()
        proc = subprocess.run([*CLI, "validate", str(path)], capture_output=True, text=True, timeout=120)
        assert time.monotonic() - t0 < 30
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and needle in proc.stderr, proc.stderr


@pytest.mark.parametrize("args", [
    "traj ls {d}", "eval {d}", "export {d} --out {d}x", "merge {d} --out {d}x", "train {d}.yaml", "resume {d}",
    "reconfigure {d} --set mixture.a=1", "db upgrade {d}", "validate {d}.yaml", "models fetch no-such-model",
])
def test_every_subcommand_fails_with_one_line_under_its_own_prefix(tmp_path, args):
    argv = args.format(d=tmp_path / "missing").split()
    proc = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    prefix = "rl models fetch: " if argv[0] == "models" else f"rl {argv[0]}: "
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(prefix), proc.stderr


def test_a_live_patch_may_name_only_datasets_a_grpo_stage_draws_from(tmp_path):
    import yaml

    recipe = {"datasets": [{"type": "arithmetic", "name": "sft_only", "num_heldout": 8},
                           {"type": "arithmetic", "name": "rl", "max_digits": 3, "num_heldout": 8}],
              "stages": [{"type": "sft", "max_steps": 2, "datasets": ["sft_only"]},
                         {"type": "grpo", "max_steps": 2, "datasets": ["rl"]}], "logging": {"wandb": False}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))

    def err(patch: str) -> str:
        proc = subprocess.run([*CLI, "reconfigure", str(tmp_path), "--set", patch], capture_output=True, text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        return lines[0]
    assert err("mixture.sft_only=1") == ("rl reconfigure: bad patch: mixture names unknown datasets ['sft_only']; "
                                         "the datasets its GRPO/OPD stages draw from are ['rl']")
    assert "no job is running" in err("mixture.rl=2")  # a valid patch, refused only because nothing runs here
