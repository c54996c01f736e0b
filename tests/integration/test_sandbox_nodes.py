"""The sandbox servers a job starts itself (rl/runtime/sandbox_nodes.py, sandbox_client/launch.py), with real servers
(bubblewrap): a server killed with -9 leaves its sandboxes to the next server of the same run directory, which
reaps them; a server dies with the process that started it; a server never takes or removes another's socket."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rl.runtime.sandbox_nodes import NodeSandboxes, run_key, server_paths
from sandbox_client import Limits, LocalServer, SandboxClient, SandboxError
from sandbox_client.launch import server_pid

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def scratch():
    if shutil.which("bwrap") is None and os.environ.get("CI") != "true":
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap; .ci/run does)")
    d = Path(tempfile.mkdtemp(prefix="asyncrl-sbx-nodes-"))  # not under pytest's 0700 tmp: sandbox uids traverse it
    d.chmod(0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z":
                return True  # exited, not yet reaped by its (dead) parent's successor
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False


def test_a_server_killed_with_9_is_reaped_by_the_next_server_of_its_run(scratch):
    key = run_key(scratch / "run")
    first = NodeSandboxes(key, "bwrap", 4, remote=False, say=lambda _: None)
    sock = Path(first.start([""], driver_node="")[""])
    assert (sock, Path(first.owners[""].server.state_dir)) == server_paths(key)  # stable: the run directory's
    (pid,) = first.pids()

    async def leave_one_running() -> str:
        client = await SandboxClient.connect(sock)
        sb = await client.create(Limits(timeout_s=300))
        running = asyncio.create_task(sb.exec("sleep 300", timeout=300))
        await asyncio.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(SandboxError):
            await running
        await client.close()
        return sb.host_work_dir

    work = Path(asyncio.run(leave_one_running()))
    first.stop()
    state = server_paths(key)[1]
    try:
        assert work.exists() and list((state / "live").iterdir())  # left behind by the kill
        again = NodeSandboxes(key, "bwrap", 4, remote=False, say=lambda _: None)
        again.start([""], driver_node="")
        again.stop()
        assert not work.exists() and not list((state / "live").iterdir())
        ops = [json.loads(line)["op"] for line in (state / "commands.jsonl").read_text().splitlines()]
        assert ops.count("reap") == 1 and ops.index("reap") > ops.index("start")
    finally:
        shutil.rmtree(state, ignore_errors=True)
        state.with_name(f"{state.name}.server.log").unlink(missing_ok=True)


def test_a_server_dies_with_the_process_that_started_it(scratch):
    code = ("import sys, time\nfrom sandbox_client import LocalServer\n"
            "s = LocalServer(sys.argv[1], sys.argv[2], die_with_parent=True)\nprint(s.pid, flush=True)\ntime.sleep(300)\n")
    owner = subprocess.Popen([sys.executable, "-c", code, str(scratch / "s.sock"), str(scratch / "state")],
                             stdout=subprocess.PIPE, text=True)
    try:
        pid = int(owner.stdout.readline())
        assert server_pid(scratch / "s.sock") == pid
        owner.kill()  # SIGKILL: no chance to stop its server
        owner.wait()
        assert _gone(pid, 30), "the server outlived its owner"
        assert not (scratch / "s.sock").exists()  # it had SIGTERM: a clean stop
    finally:
        if owner.poll() is None:
            owner.kill()


def test_a_server_never_takes_or_removes_another_servers_socket(scratch):
    sock = scratch / "s.sock"
    a = LocalServer(sock, scratch / "a")
    b = None
    try:
        with pytest.raises(RuntimeError, match="did not start: .*another server already listens on"):
            LocalServer(sock, scratch / "b")  # a answers there: never taken for the new one
        assert server_pid(sock) == a.pid
        sock.rename(scratch / "moved.sock")  # a's socket file moved away, and another server takes the path
        b = LocalServer(sock, scratch / "b")
        assert a.stop() == 0
        assert server_pid(sock) == b.pid  # a removed no socket but its own (gone from the path)
        assert (scratch / "moved.sock").exists()
        assert b.stop() == 0 and not sock.exists()
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_a_server_that_cannot_start_is_one_line_and_exit_2(scratch):
    """The directory of the job's servers is a link someone planted: `rl train` stops before any stage with one line
    naming it (exit 2), and follows no link."""
    recipe = {"model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
                        "ffn": {"type": "dense", "intermediate_size": 64}},
              "datasets": [{"type": "custom", "name": "sums", "task": "tests.tasks.tool_sums:ToolSums"}],
              "engine": {"max_seq_len": 400, "max_new_tokens": 32}, "tools": {"format": "code"},
              "runtime": {"ray": False}, "stages": [{"type": "sft", "max_steps": 1}],
              "logging": {"wandb": False, "progress_bar": False}}
    (scratch / "r.yaml").write_text(json.dumps(recipe))
    planted = scratch / f"asyncrl-sandbox-{os.getuid()}"
    planted.symlink_to(scratch / "elsewhere")
    env = {**os.environ, "TMPDIR": str(scratch), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())", "train",
                           str(scratch / "r.yaml"), "--run-dir", str(scratch / "run")],
                          capture_output=True, text=True, timeout=300, env=env, cwd=scratch)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"rl train: the sandbox server did not start: {planted} is not a directory of uid {os.getuid()}: remove it, "
        "or set TMPDIR elsewhere"]
    assert not (scratch / "elsewhere").exists()
