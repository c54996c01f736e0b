"""Start a sandbox server as a child process and wait until it answers: how a job (or a test, or a bench)
gets a server of its own on this node."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


class LocalServer:
    """`python -m sandbox_client serve` in a child process; `stop()` ends it (SIGTERM: its sandboxes closed),
    `kill()` kills it with SIGKILL (its sandboxes left for the next server on the state directory to reap)."""

    def __init__(self, socket_path: str | Path, state_dir: str | Path, *, backend: str = "bwrap",
                 max_sandboxes: int = 32, start_timeout_s: float = 30.0):
        self.socket_path, self.state_dir = Path(socket_path), Path(state_dir)
        self.log_path = self.state_dir.parent / f"{self.state_dir.name}.server.log"
        self.state_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sandbox_client", "serve", "--socket", str(self.socket_path), "--state-dir",
                 str(self.state_dir), "--backend", backend, "--max-sandboxes", str(max_sandboxes)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + start_timeout_s
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                tail = self.log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
                raise RuntimeError(f"the sandbox server did not start: {tail[0]}")
            time.sleep(0.02)

    def _answers(self) -> bool:
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(str(self.socket_path))
            except OSError:
                return False
        return True

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
