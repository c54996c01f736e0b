"""Start a sandbox server as a child process and wait until it answers: how a job (or a test, or a bench)
gets a server of its own on this node.

The wait ends when the server answering on the socket is this child (its `info` names the child's pid): a
socket that another server holds is never taken for ours, and a child that cannot start (another server
listens there, its state directory is in use) is a one-line error. The child removes only the socket file it
bound (server.py), so stopping or killing it never takes away another server's socket.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

from sandbox_client.protocol import ProtocolError, decode, encode

PR_SET_PDEATHSIG = 1


class LocalServer:
    """`python -m sandbox_client serve` in a child process; `stop()` ends it (SIGTERM: its sandboxes closed),
    `kill()` kills it with SIGKILL (its sandboxes left for the next server on the state directory to reap)."""

    def __init__(self, socket_path: str | Path, state_dir: str | Path, *, backend: str = "bwrap",
                 max_sandboxes: int = 32, start_timeout_s: float = 30.0, die_with_parent: bool = False,
                 warm_interpreter: bool = True):
        """`warm_interpreter`: the server forks a sandbox's `python3 -c` calls from a warm interpreter (warm.py).
        `die_with_parent`: the server gets SIGTERM (and closes its sandboxes) when the process that started it
        dies, even by SIGKILL (Linux PR_SET_PDEATHSIG; start it from a thread that lives as long as the process)."""
        self.socket_path, self.state_dir = Path(socket_path), Path(state_dir)
        self.log_path = self.state_dir.parent / f"{self.state_dir.name}.server.log"
        self.state_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sandbox_client", "serve", "--socket", str(self.socket_path), "--state-dir",
                 str(self.state_dir), "--backend", backend, "--max-sandboxes", str(max_sandboxes),
                 "--warm-interpreter" if warm_interpreter else "--no-warm-interpreter"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_die_with(os.getpid()) if die_with_parent else None)
        deadline = time.monotonic() + start_timeout_s
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                tail = self.log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
                raise RuntimeError(f"the sandbox server did not start: {tail[0]}")
            time.sleep(0.02)

    def _answers(self) -> bool:
        """Whether this child answers on the socket (not merely some server)."""
        return server_pid(self.socket_path) == self.proc.pid

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def server_pid(socket_path: str | Path, timeout_s: float = 2.0) -> int | None:
    """The pid of the server answering on `socket_path` (its `info`), or None when none answers."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(str(socket_path))
            s.sendall(encode({"id": 0, "op": "info"}))
            header = _read_exactly(s, 4)
            msg = decode(_read_exactly(s, struct.unpack(">I", header)[0]))
        except (OSError, ProtocolError, struct.error):
            return None
    result = msg.get("result") if msg.get("ok") else None
    return result.get("pid") if isinstance(result, dict) else None


def _read_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the server closed the connection")
        data += chunk
    return data


def _die_with(parent: int):
    """A preexec_fn: the child gets SIGTERM when `parent` dies; a parent gone already ends the child at once."""
    def arm() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)
    return arm
