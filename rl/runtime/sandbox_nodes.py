"""The sandbox servers a job starts itself (issue #16, item 1; recipe `sandbox.socket: auto`, the default when the
recipe has tools): one sandbox_client server on every node the job's workers run on, owned by the job and stopped
when it ends, whichever way it ends.

- Placement: on Ray, a `NodeSandbox` actor pinned to each node that holds a policy or reward worker (Ray's
  `node:<ip>` resource) starts the server as its child process (`sandbox_client.LocalServer`); in-process
  (`runtime.ray: false`) and for `rl eval`, the driver starts it. Each worker is then told its node's socket
  (`use_sandbox`).
- Ending: `NodeSandboxes.stop` sends each server SIGTERM (its sandboxes closed, its socket file removed). A server
  also ends when its owner dies, even by SIGKILL: it gets SIGTERM (`die_with_parent`), or Ray kills it with the
  actor's other children; neither a failed start nor a job killed with -9 leaves a server running (bwrap ends a
  sandbox's processes with their server; what a killed server leaves on disk is reaped, below).
- Reaping: the state directory is stable per (run directory, node): `$TMPDIR/asyncrl-sandbox-<uid>/<key>`, the
  key a digest of the run directory's absolute path (and of the node's address for a node other than the
  driver's). Sandboxes a job killed with -9 left behind are reaped by the next server on that state directory,
  the one of `rl resume` (or of the next `rl train` in that run directory) on the same node, before it serves
  (sandbox_client/server.py). The run directory holds one job at a time (rl/checkpoint/run_dir.py), so two servers never
  want one state directory. It lives under the temporary directory rather than in the run directory: the
  sandbox uids of a root server must traverse to their work directories (a run directory under /root is out of
  their reach), and a Unix socket's path is at most 107 bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

from sandbox_client import LocalServer


START_TIMEOUT_S = 120.0
"""How long a node's server may take to be placed and to answer (its own start waits up to 30 s)."""


class SandboxStartError(RuntimeError):
    """A sandbox server the job needs did not start; the message is one line."""


def sandbox_root() -> Path:
    """`$TMPDIR/asyncrl-sandbox-<uid>`: this uid's directory of auto-started servers (made o+x, so that sandbox
    uids pass through it); refused when it is a link or another user's."""
    root = Path(tempfile.gettempdir()) / f"asyncrl-sandbox-{os.getuid()}"
    with contextlib.suppress(FileExistsError):  # a directory, or something planted there: checked below
        root.mkdir(mode=0o711)
    st = root.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise SandboxStartError(f"{root} is not a directory of uid {os.getuid()}: remove it, or set TMPDIR elsewhere")
    root.chmod(0o711)
    return root


def server_paths(run_key: str, node: str = "") -> tuple[Path, Path]:
    """(socket, state directory) of the auto-started server of the run `run_key` on `node` ("" for the driver's)."""
    digest = hashlib.blake2b(f"{run_key}\0{node}".encode(), digest_size=8).hexdigest()
    root = sandbox_root()
    return root / f"{digest}.sock", root / digest


def run_key(run_dir: str | Path | None) -> str:
    """What names a run's servers: its run directory's absolute path (stable across `rl resume`); without a run
    directory (a bench driving a Runtime), this process, whose servers nothing will reap."""
    return str(Path(run_dir).resolve()) if run_dir is not None else f"pid-{os.getpid()}"


class NodeSandbox:
    """The sandbox server of one node, a child process of this object's process (a thin Ray actor shell over
    `LocalServer`; also used in-process)."""

    def __init__(self, run_key: str, node: str, backend: str, max_sandboxes: int, warm_interpreter: bool = True):
        self.args = (run_key, node, backend, max_sandboxes, warm_interpreter)
        self.server: LocalServer | None = None

    def start(self) -> dict[str, str]:
        """{"socket": path, "state": its state directory} once the server answers, or {"error": one line} (a value,
        so that the line crosses Ray as is)."""
        key, node, backend, max_sandboxes, warm_interpreter = self.args
        try:
            sock, state = server_paths(key, node)
            self.server = LocalServer(sock, state, backend=backend, max_sandboxes=max_sandboxes, die_with_parent=True,
                                      warm_interpreter=warm_interpreter)
        except (RuntimeError, OSError) as e:
            line = str(e).splitlines()[0] if str(e) else type(e).__name__
            return {"error": line.removeprefix("the sandbox server did not start: ")}
        return {"socket": str(self.server.socket_path), "state": str(self.server.state_dir)}

    def stop(self) -> int | None:
        """SIGTERM: the server closes its sandboxes and removes its socket file; its exit status."""
        return None if self.server is None else self.server.stop()

    def pid(self) -> int | None:
        return None if self.server is None else self.server.pid


class NodeSandboxes:
    """The job's sandbox servers, one per node: `start` where the workers are, `stop` them all."""

    def __init__(self, key: str, backend: str, max_sandboxes: int, *, remote: bool, say=print,
                 warm_interpreter: bool = True):
        """`key`: what names the servers' state directories (`run_key`); `warm_interpreter`: recipe
        `sandbox.warm_interpreter`."""
        self.key, self.backend, self.max_sandboxes, self.remote, self.say = key, backend, max_sandboxes, remote, say
        self.warm_interpreter = warm_interpreter
        self.owners: dict[str, object] = {}  # node address -> NodeSandbox (in-process) or its Ray actor handle
        self.sockets: dict[str, str] = {}

    def start(self, nodes: Iterable[str], driver_node: str | None = None) -> dict[str, str]:
        """A server on each of `nodes` (Ray node addresses; in-process: the one node ""): {node: socket}."""
        pending, labels = {}, {}
        actor = None
        if self.remote:
            import ray

            actor = ray.remote(num_cpus=0, max_restarts=0)(NodeSandbox)
        for node in sorted(set(nodes)):
            label = labels[node] = "" if node == driver_node else node
            if actor is not None:  # pinned to the node by its `node:<address>` resource
                owner = actor.options(resources={f"node:{node}": 0.001}).remote(self.key, label, self.backend,
                                                                                self.max_sandboxes, self.warm_interpreter)
                pending[node] = owner.start.remote()
            else:
                owner = NodeSandbox(self.key, label, self.backend, self.max_sandboxes, self.warm_interpreter)
                pending[node] = owner.start()
            self.owners[node] = owner
        for node, answer in pending.items():
            where = f" of node {labels[node]}" if labels[node] else ""
            if actor is not None:
                answer = _answer(answer, START_TIMEOUT_S)
            if "error" in answer:
                raise SandboxStartError(f"the sandbox server{where} did not start: {answer['error']}")
            self.sockets[node] = answer["socket"]
            self.say(f"sandbox: started the server{where} at {answer['socket']} (backend {self.backend}, at most "
                     f"{self.max_sandboxes} sandboxes; state and command log in {answer['state']})")
        return dict(self.sockets)

    def pids(self) -> list[int]:
        """The servers' pids (on their nodes)."""
        if self.remote:
            import ray

            return [p for p in ray.get([o.pid.remote() for o in self.owners.values()]) if p is not None]
        return [p for o in self.owners.values() if (p := o.pid()) is not None]

    def stop(self) -> None:
        """Stop every server (SIGTERM; one whose owner died got it already) and end the owners."""
        owners, self.owners = self.owners, {}
        if not self.remote:
            for o in owners.values():
                o.stop()
            return
        import ray
        from ray.exceptions import GetTimeoutError, RayError

        for o in owners.values():
            try:
                ray.get(o.stop.remote(), timeout=60)
            except (RayError, GetTimeoutError):
                pass  # the owner is gone: its server had SIGTERM when it died
            ray.kill(o)


def _answer(ref, timeout_s: float) -> dict[str, str]:
    """A `NodeSandbox.start` answer from Ray, or {"error": why} when its actor died or was never placed."""
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        return {"error": f"no answer within {timeout_s:g} s (is the node still in the cluster?)"}
    except RayError as e:
        return {"error": f"its owner died ({type(e).__name__})"}
