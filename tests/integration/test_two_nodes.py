"""Two Ray nodes on distinct IP addresses (issue #17): the head in this network namespace at 10.78.0.1, a
second node in its own namespace at 10.78.0.2, joined by a veth pair, one CPU each, so the two policy workers
land one per node. `rl train` joins the cluster (`runtime.ray_address`) and trains data-parallel over gloo: the
process group must meet at rank 0's node address and each rank must speak from its node's interface; any
loopback address fails here (the namespaces have no shared loopback). Needs root and `ip netns` (skips
otherwise)."""

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]
NS, HOST_IF, NS_IF = "arl-node-b", "arl-va", "arl-vb"
HEAD, NODE, PORT = "10.78.0.1", "10.78.0.2", "6391"
RAY = [sys.executable, "-m", "ray.scripts.scripts"]


def _sh(*cmd: str, ns: bool = False, env=None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", "netns", "exec", NS, *cmd] if ns else list(cmd)
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=check)


def _stop_our_ray() -> None:
    """End the Ray processes of the two nodes, and only those (their command lines name the nodes' addresses; their
    workers exit with their raylet): `ray stop` ends every Ray on the machine, a job's in another test process among
    them (CI, 2026-12-04: a tool-use run's GCS gone mid-job)."""
    import psutil

    ours = [p for p in psutil.process_iter(["cmdline"])
            if any(HEAD in arg or NODE in arg for arg in (p.info["cmdline"] or ()))]
    for p in ours:
        p.terminate()
    _, alive = psutil.wait_procs(ours, timeout=15)
    for p in alive:
        p.kill()


@pytest.fixture
def two_nodes():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("simulating two nodes needs root and iproute2 (ip netns)")
    env = dict(os.environ, RAY_AUTH_MODE="disabled")  # two `ray start`s share no auth token
    _sh("ip", "netns", "del", NS, check=False)
    _sh("ip", "link", "del", HOST_IF, check=False)
    try:
        if _sh("ip", "netns", "add", NS, check=False).returncode != 0:
            pytest.skip("network namespaces are not permitted here")
        _sh("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
        _sh("ip", "link", "set", NS_IF, "netns", NS)
        _sh("ip", "addr", "add", f"{HEAD}/24", "dev", HOST_IF)
        _sh("ip", "link", "set", HOST_IF, "up")
        _sh("ip", "addr", "add", f"{NODE}/24", "dev", NS_IF, ns=True)
        _sh("ip", "link", "set", NS_IF, "up", ns=True)
        _sh("ip", "link", "set", "lo", "up", ns=True)
        _sh(*RAY, "start", "--head", f"--node-ip-address={HEAD}", f"--port={PORT}", "--num-cpus=1",
            "--include-dashboard=false", "--disable-usage-stats", env=env)
        _sh(*RAY, "start", f"--address={HEAD}:{PORT}", f"--node-ip-address={NODE}", "--num-cpus=1",
            "--disable-usage-stats", ns=True, env=env)
        yield env
    finally:
        _stop_our_ray()
        _sh("ip", "link", "del", HOST_IF, check=False)
        _sh("ip", "netns", "del", NS, check=False)


def test_two_workers_on_two_nodes_train_data_parallel(tmp_path, two_nodes):
    sets = ["runtime.ray=true", f"runtime.ray_address={HEAD}:{PORT}", "runtime.num_workers=2",
            "runtime.cpus_per_worker=1", "runtime.worker_timeout_s=60", "stages.0.max_steps=3"]
    proc = subprocess.run([*CLI, "train", "configs/tiny_grpo.yaml", "--run-dir", str(tmp_path / "run"),
                           *[a for s in sets for a in ("--set", s)]], capture_output=True, text=True, timeout=300,
                          env=two_nodes)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"policy on 2 Ray worker(s), 1 stages (nodes {HEAD}, {NODE})" in proc.stdout \
        or f"policy on 2 Ray worker(s), 1 stages (nodes {NODE}, {HEAD})" in proc.stdout, proc.stdout
    assert "stage 0 (grpo): 3 steps so far" in proc.stdout
