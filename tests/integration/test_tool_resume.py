"""Preemption and kill -9 while tool calls run, then `rl resume` (issue #16; seed §5.1.3: rollouts suspended and
resumed across preemption, §5.2.3: in-flight state persistence): nothing is lost and no call's side effect is doubled.

A tiny char-level model learns from demonstrations (SFT) to call the python tool twice with `NOTE`, which appends a
line to the file `n` in the sample's work directory, sleeps, and prints the file; GRPO rollouts (greedy) run the
calls in the node's sandbox server (bubblewrap). The job (`rl train`, in-process runtime) is preempted (SIGTERM)
while second calls run: the checkpoint keeps each sample's work directory as its pending call found it. `rl resume`
restores the samples' new sandboxes and runs the calls again; that job is killed with -9 while those calls run, and
a second `rl resume` (from the same checkpoint) finishes the run. Every prompt is trained or accounted for in the
store, and every call's output shows exactly one line per call so far: never the dead runs' extra lines, never a
lost first line."""

import io
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import msgpack
import pytest
import yaml

from rl.checkpoint.format import CheckpointManager
from rl.store.trajectories import TrajectoryStore
from rollout.types import RolloutState
from sandbox_client import LocalServer
from tests.tasks.tool_notes import NOTE

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SFT_STEPS, GRPO_STEPS, PROMPTS, GROUP = 50, 1, 2, 4


def _rl(*args, cwd) -> subprocess.Popen:  # the task module lives under tests/: the repository on the path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("ASYNCRL_FAULT", None)
    return subprocess.Popen([sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())", *args],
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _signal_during_a_second_call(proc: subprocess.Popen, work: Path, sig: int, after: float = 0.0) -> str:
    """Send `sig` once some sample's second call (started after `after`, Unix time) has written its line and sleeps:
    its work directory on the server holds `n` with two lines. Returns the job's stdout."""
    def second_call() -> bool:
        for f in work.glob("*/n"):
            try:
                if f.stat().st_mtime > after and f.read_bytes() == b"x\nx\n":
                    return True
            except FileNotFoundError:  # its sandbox was closed meanwhile
                pass
        return False

    deadline = time.monotonic() + 240
    while not second_call():
        assert proc.poll() is None, f"the job ended first: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, "no second call"
        time.sleep(0.02)
    proc.send_signal(sig)
    return proc.communicate(timeout=120)[0]


def _wait_for_checkpoint(proc: subprocess.Popen, run_dir: Path) -> Path:
    deadline = time.monotonic() + 240
    while not (done := CheckpointManager(run_dir / "checkpoints").complete()):
        assert proc.poll() is None, f"the job ended first: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, "no checkpoint"
        time.sleep(0.02)
    return done[0]


def _lines_before_pending_call(ckpt: Path) -> dict[str, int]:
    """Samples the checkpoint holds paused at a call, with files: sample id -> lines of `n` as the call found it."""
    out = {}
    for blob in msgpack.unpackb((ckpt / "inflight-w0.msgpack").read_bytes()):
        st = RolloutState.from_bytes(blob)
        if st.paused and st.workdir is not None:
            with tarfile.open(fileobj=io.BytesIO(st.workdir["archive"]), mode="r:gz") as tar:
                out[st.request.sample_id] = tar.extractfile("./n").read().count(b"\n")
    return out


def test_preempted_and_killed_during_tool_calls_resume_loses_nothing_and_doubles_no_side_effect():
    if shutil.which("bwrap") is None and os.environ.get("CI") != "true":
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap; .ci/run does)")
    root = Path(tempfile.mkdtemp(prefix="asyncrl-tool-resume-"))  # not under pytest's 0700 tmp: sandbox uids traverse it
    root.chmod(0o711)
    server = LocalServer(root / "s.sock", root / "state", max_sandboxes=16)
    try:
        recipe = {
            "run": {"name": "notes", "seed": 0, "num_threads": 1},
            "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                      "max_position_embeddings": 512, "ffn": {"type": "dense", "intermediate_size": 128}},
            "datasets": [{"type": "custom", "name": "notes", "task": "tests.tasks.tool_notes:ToolNotes"}],
            # greedy: every sample writes NOTE exactly (the demonstrations' two calls, then the answer)
            "engine": {"max_batch_size": 16, "max_seq_len": 512, "max_new_tokens": 200, "sampling": {"temperature": 0}},
            "sandbox": {"socket": str(root / "s.sock"), "limits": {"timeout_s": 5}},
            "tools": {"format": "code", "max_turns": 2, "max_tool_output_tokens": 16, "timeout_s": 5},
            "runtime": {"ray": False},
            "eval": {"max_problems": 1},
            "stages": [{"type": "sft", "max_steps": SFT_STEPS, "batch_size": 8, "optim": {"lr": 3e-3}},
                       {"type": "grpo", "max_steps": GRPO_STEPS, "prompts_per_step": PROMPTS, "group_size": GROUP,
                        "micro_batch_size": 8, "dispatch": {"policy": "sample", "max_inflight": 8}}],
            "checkpoint": {"every_steps": 0, "keep_last": 2},  # stage ends and the preemption only
            "logging": {"wandb": False, "progress_bar": False},
        }
        (root / "notes.yaml").write_text(yaml.safe_dump(recipe))
        run_dir = root / "run"
        work = root / "state" / "work"
        job = _rl("train", str(root / "notes.yaml"), "--run-dir", str(run_dir), cwd=root)
        sft_end = _wait_for_checkpoint(job, run_dir)  # SFT's held-out evaluation calls tools too: not those
        _signal_during_a_second_call(job, work, signal.SIGTERM, after=sft_end.stat().st_mtime)
        assert job.returncode == 3, job.stderr.read()[-2000:]  # preempted, with a checkpoint
        ckpt = CheckpointManager(run_dir / "checkpoints").latest()
        kept = _lines_before_pending_call(ckpt)
        assert kept and set(kept.values()) == {1}, kept  # paused at their second call, the first call's line kept

        started = time.time()  # the resumed calls run again on restored files; kill -9 the job while they run
        job = _rl("resume", str(run_dir), cwd=root)
        out = _signal_during_a_second_call(job, work, signal.SIGKILL, after=started)
        assert job.returncode == -signal.SIGKILL and f"resume: {ckpt.name}" in out

        job = _rl("resume", str(run_dir), cwd=root)
        out, err = job.communicate(timeout=300)
        assert job.returncode == 0, err[-3000:]
        assert f"resume: {ckpt.name}" in out  # the same checkpoint again

        store = TrajectoryStore.for_run_dir(run_dir)
        audit = store.audit()
        assert len(store.restarts()) == 2
        assert audit["trained"] == GRPO_STEPS * PROMPTS * GROUP, audit
        assert audit["trained_twice"] == 0 and audit["link_mismatch"] == 0 and audit["prompts_open"] == 0, audit
        samples = [store.get_sample(r.sample_id) for r in store.query(limit=1000)]
        store.close()
        by_id = {s.sample_id: s for s in samples}
        assert set(kept) <= set(by_id)  # the samples resumed at their pending call were all finished and stored
        for sid in kept:  # the call that was running at the preemption, and again at the kill, ran on the files it
            # had found each time and counted once: one line per call
            calls = [t for t in by_id[sid].turns if t.kind == "tool"]
            assert [t.call.strip() for t in calls] == [NOTE, NOTE], by_id[sid].turns
            assert [t.text for t in calls] == ["x", "x\nx"]
        for s in samples:  # every other sample whose calls are exactly NOTE too
            calls = [t for t in s.turns if t.kind == "tool"]
            if calls and all(t.call.strip() == NOTE and t.status == "ok" for t in calls):
                assert [t.text for t in calls] == ["\n".join(["x"] * (i + 1)) for i in range(len(calls))], s.turns
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
