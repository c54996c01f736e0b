"""`rl train` with tools end to end (issue #16): a tiny char-level model learns from demonstrations (SFT) to call
the python tool, then GRPO rollouts on Ray pause at its calls, run them in the node's sandbox server
(bubblewrap), append the outputs as their own tokens and continue; the store keeps each sample's turns with loss
mask 0 on tool tokens, `rl traj show` renders them, and the held-out evaluation serves calls too. The recipe names
no server: `rl train` starts the node's own (rl/runtime/sandbox_nodes.py) and none is left when it ends.

Repercussion (seed §5.1.3): a model taught to write a call that allocates 128 MiB has each such call killed by the
sandbox's memory limit (64 MiB); the samples end there, failed, with the reason in the store and in
`rollout/tool_failures/memory`, and under `tools.on_failure: leave_loss` they leave the trained batch; the job
goes on. One run covers both: half the demonstrations make that call."""

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from rl.runtime.sandbox_nodes import run_key, server_paths
from rl.store.trajectories import TrajectoryStore

pytestmark = [pytest.mark.integration, pytest.mark.slow]


ROOT = Path(__file__).resolve().parents[2]


def _rl(*args, cwd):  # the task module lives under tests/: the repository on the path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def _recipe(dataset_args: dict | None = None, **tools) -> dict:
    """SFT on the task's demonstrations of calling the tool, then two small GRPO steps; no sandbox.socket."""
    return {
        "run": {"name": "tools", "seed": 0, "num_threads": 1},
        "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                  "max_position_embeddings": 512, "ffn": {"type": "dense", "intermediate_size": 128}},
        "datasets": [{"type": "custom", "name": "sums", "task": "tests.tasks.tool_sums:ToolSums",
                      **({"args": dataset_args} if dataset_args else {})}],
        "engine": {"max_batch_size": 16, "max_seq_len": 400, "max_new_tokens": 64},
        "sandbox": {"limits": {"timeout_s": 5, "memory_mib": 64}},  # max_sandboxes: one per sample in flight
        "tools": {"format": "code", "max_turns": 2, "max_tool_output_tokens": 16, "timeout_s": 5, **tools},
        "runtime": {"ray": True, "num_workers": 1, "num_cpus": 2},
        "stages": [{"type": "sft", "max_steps": 60, "batch_size": 16, "optim": {"lr": 3e-3}},
                   {"type": "grpo", "max_steps": 2, "prompts_per_step": 2, "group_size": 4, "micro_batch_size": 8,
                    "dispatch": {"policy": "sample", "max_inflight": 8}}],
        "logging": {"wandb": False, "progress_bar": False},
    }


def _server_processes(state: Path) -> list[int]:
    """Live sandbox servers on the state directory `state` (by their command line)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0") if d.name.isdigit() else []
        except OSError:
            continue
        if b"sandbox_client" in argv and os.fsencode(state) in argv:
            found.append(int(d.name))
    return found


def _train(root: Path, recipe: dict) -> tuple[subprocess.CompletedProcess, Path]:
    """`rl train` of `recipe` in root/run; checks that it started the node's server and left none running."""
    (root / "tools.yaml").write_text(yaml.safe_dump(recipe))
    run_dir = root / "run"
    proc = _rl("train", str(root / "tools.yaml"), "--run-dir", str(run_dir), cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sock, state = server_paths(run_key(run_dir))
    assert f"sandbox: started the server at {sock}" in proc.stdout, proc.stdout[-2000:]
    assert _server_processes(state) == [] and not sock.exists()  # stopped with the job, its socket removed
    log = [json.loads(line) for line in (state / "commands.jsonl").read_text().splitlines()]
    assert [e["op"] for e in log if e["op"] in ("start", "stop")] == ["start", "stop"]
    # one sandbox for each sample the engine may hold (a sample keeps its sandbox to its end: fewer cap the rollout)
    want = recipe["sandbox"].get("max_sandboxes") or recipe["engine"]["max_batch_size"] * recipe["runtime"]["num_workers"]
    assert next(e for e in log if e["op"] == "start")["max_sandboxes"] == want
    assert any(e["op"] == "exec" for e in log)  # the rollouts' calls ran on it
    return proc, run_dir


@pytest.fixture
def root():
    if shutil.which("bwrap") is None and os.environ.get("CI") != "true":
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap; .ci/run does)")
    root = Path(tempfile.mkdtemp(prefix="asyncrl-tool-run-"))
    yield root
    state = server_paths(run_key(root / "run"))[1]
    shutil.rmtree(state, ignore_errors=True)  # the server's state and command log, and its output
    state.with_name(f"{state.name}.server.log").unlink(missing_ok=True)
    shutil.rmtree(root, ignore_errors=True)


def test_grpo_rollouts_call_tools_in_the_sandbox_and_killed_calls_leave_the_loss(root):
    """Half the demonstrations call for 128 MiB: the model samples both calls. Calls that run are appended (loss
    mask 0) and rendered; calls the memory limit kills end their samples, which leave the trained batch."""
    recipe = _recipe({"hog": 0.5}, on_failure="leave_loss")
    recipe["stages"][0]["max_steps"] = 100
    _, run_dir = _train(root, recipe)
    with sqlite3.connect(run_dir / "trajectories.db") as db:  # the samples of the groups the two steps took
        ids = [r[0] for r in db.execute("select s.sample_id from samples s join prompts p on p.run_id = s.run_id and "
                                        "p.prompt_id = s.prompt_id where p.outcome = 'trained'")]
    store = TrajectoryStore.for_run_dir(run_dir)
    batch = [(store.get_sample(i), store.sample_train_step(i)) for i in ids]
    store.close()
    assert len(batch) == 2 * 2 * 4
    failed = [s for s, _ in batch if s.failure is not None]
    called = [s for s, step in batch if s.failure is None and s.turns]
    assert failed, "no call was killed"
    assert called, "no rollout's call ran"
    for s, step in batch:
        if s.failure is None:
            assert step is not None
            continue
        # ended at the call the memory limit killed, nothing appended; stored, but it left the loss: untrained
        assert (s.failure, s.finish_reason, s.turns[-1].kind, s.turns[-1].status) == ("memory", "tool_failure", "tool", "error")
        assert s.turns[-1].start == s.turns[-1].end == s.num_response_tokens and step is None
    for s in called:
        tools = [t for t in s.turns if t.kind == "tool"]
        assert tools and tools[0].tool == "python" and tools[0].status in ("ok", "error", "timeout")
        assert s.turns[0].kind == "model" and s.turns[0].text.startswith("```python")
        mask = s.loss_mask_T()
        assert all(mask[t.start:t.end] == (0,) * (t.end - t.start) for t in tools) and sum(mask) < len(mask)
    ok = [t for s in called for t in s.turns if t.kind == "tool" and t.status == "ok"]
    assert ok and all(t.text.strip().lstrip("-").isdigit() for t in ok)  # what print(a+b) printed
    with ThreadPoolExecutor(max_workers=2) as pool:  # three independent reads of the finished run
        show, ls, show_failed = pool.map(lambda args: _rl("traj", *args, cwd=root), [
            ("show", str(run_dir), called[0].sample_id), ("ls", str(run_dir), "--failure", "memory", "--limit", "100"),
            ("show", str(run_dir), failed[0].sample_id)])
    assert show.returncode == 0 and "python" in show.stdout, show.stderr[-1000:]
    assert ls.returncode == 0 and all(s.sample_id in ls.stdout for s in failed), ls.stderr[-1000:]
    assert "finish_reason tool_failure   failure memory (repercussion)" in show_failed.stdout, show_failed.stderr[-1000:]
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in logged if "rollout/tool_failures" in m]
    assert len(steps) == 2 and sum(m["rollout/tool_failures/memory"] for m in steps) == len(failed)
    assert sum(m["rollout/tool_failures"] for m in steps) == sum(m["rollout/left_out"] for m in steps) == len(failed)
    # what holds samples off the engine: each step's calls a sample and their seconds, from the samples' tool turns
    assert all(m["rollout/tool_calls_per_sample"] > 0 and 0 < m["rollout/tool_call_s_mean"] <= m["rollout/tool_call_s_max"]
               for m in steps)
