"""`rl train` with tools end to end (issue #16): a tiny char-level model learns from demonstrations (SFT) to call
the python tool, then GRPO rollouts on Ray pause at its calls, run them in the node's sandbox server
(bubblewrap), append the outputs as their own tokens and continue; the store keeps each sample's turns with loss
mask 0 on tool tokens, `rl traj show` renders them, and the held-out evaluation serves calls too."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from rl.store import TrajectoryStore
from sandbox_client import LocalServer

pytestmark = pytest.mark.integration


ROOT = Path(__file__).resolve().parents[2]


def _rl(*args, cwd):  # the task module lives under tests/: the repository on the path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def test_grpo_rollouts_call_tools_in_the_sandbox():
    if shutil.which("bwrap") is None and os.environ.get("CI") != "true":
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap; .ci/run does)")
    root = Path(tempfile.mkdtemp(prefix="asyncrl-tool-run-"))
    root.chmod(0o711)
    server = LocalServer(root / "s.sock", root / "state", max_sandboxes=8)
    try:
        recipe = {
            "run": {"name": "tools", "seed": 0},
            "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                      "max_position_embeddings": 512, "ffn": {"type": "dense", "intermediate_size": 128}},
            "datasets": [{"type": "custom", "name": "sums", "task": "tests.tasks.tool_sums:ToolSums"}],
            "engine": {"max_batch_size": 16, "max_seq_len": 400, "max_new_tokens": 64},
            "sandbox": {"socket": str(root / "s.sock"), "limits": {"timeout_s": 5}},
            "tools": {"format": "code", "max_turns": 2, "max_tool_output_tokens": 16, "timeout_s": 5},
            "runtime": {"ray": True, "num_workers": 1, "num_cpus": 2},
            "stages": [{"type": "sft", "max_steps": 60, "batch_size": 16, "optim": {"lr": 3e-3}},
                       {"type": "grpo", "max_steps": 2, "prompts_per_step": 2, "group_size": 4, "micro_batch_size": 8,
                        "dispatch": {"policy": "sample", "max_inflight": 8}}],
            "logging": {"wandb": False, "progress_bar": False},
        }
        (root / "tools.yaml").write_text(yaml.safe_dump(recipe))
        proc = _rl("train", str(root / "tools.yaml"), "--run-dir", str(root / "run"), cwd=root)
        assert proc.returncode == 0, proc.stderr[-3000:]
        store = TrajectoryStore.for_run_dir(root / "run")
        samples = [store.get_sample(r.sample_id) for r in store.query(limit=100) if r.train_step is not None]
        store.close()
        assert len(samples) == 2 * 2 * 4
        called = [s for s in samples if s.turns]
        assert called, "no rollout called the tool"
        for s in called:
            tools = [t for t in s.turns if t.kind == "tool"]
            assert tools and tools[0].tool == "python" and tools[0].status in ("ok", "error", "timeout")
            assert s.turns[0].kind == "model" and s.turns[0].text.startswith("```python")
            mask = s.loss_mask_T()
            assert all(mask[t.start:t.end] == (0,) * (t.end - t.start) for t in tools) and sum(mask) < len(mask)
        ok = [t for s in called for t in s.turns if t.kind == "tool" and t.status == "ok"]
        assert ok and all(t.text.strip().lstrip("-").isdigit() for t in ok)  # what print(a+b) printed
        show = _rl("traj", "show", str(root / "run"), called[0].sample_id, cwd=root)
        assert show.returncode == 0 and "python" in show.stdout, show.stderr[-1000:]
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
