"""The execution handle verifiers get (`rewards.task.CodeRunner`, in `VerifyContext.code`), backed by a sandbox
server of `sandbox_client/` (issue #16, item 3): rewards/ never imports the client, rl/ hands it this.

Each `run` is one fresh sandbox (code written, `python3 -c` run, sandbox closed) on the node's server (the one at
`sandbox.socket`, or the one the job started: rl/runtime/sandbox_nodes.py), with the recipe's limits; a node at its admission limit is waited on with backoff (the
verdict waits, the job does not stop). The client is asynchronous; verifiers are called synchronously (in a
RewardWorker), so the runner owns one event loop on a thread of its own and one connection.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from rewards.task import ExecResult
from sandbox_client import ExecSpec, Limits, SandboxClient


class SandboxCodeRunner:
    def __init__(self, socket_path: str | Path, limits: Limits, *, admission_wait_s: float = 300.0):
        self.socket_path, self.limits, self.admission_wait_s = Path(socket_path), limits, admission_wait_s
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="sandbox-client", daemon=True).start()
        self._client: SandboxClient = self._call(SandboxClient.connect(self.socket_path))

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def run(self, code: str, *, stdin: str = "", timeout_s: float = 10.0) -> ExecResult:
        """`python3 -c code` in a fresh sandbox; a run killed (timeout, memory, CPU, processes, output cap) or
        refused has exit_code None and its reason in stderr's last line."""
        spec = ExecSpec(code=code, stdin=stdin.encode(), timeout_s=min(timeout_s, self.limits.timeout_s))
        r = self._call(self._client.run_batch([spec], self.limits, admission_wait_s=self.admission_wait_s))[0]
        stderr = r.stderr.decode(errors="replace")
        if r.reason != "ok":
            stderr += f"\nsandbox: {r.reason}"
        return ExecResult(r.exit_code if r.reason == "ok" else None, r.stdout.decode(errors="replace"), stderr,
                          timed_out=r.reason == "timeout")

    def close(self) -> None:
        self._call(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
