"""The async client of a sandbox server (server.py): one Unix-socket connection carries any number of requests
at once, so a batch of execs runs concurrently over it.

    async with await SandboxClient.connect("/run/asyncrl/sandbox.sock") as client:
        async with await client.create(Limits(memory_mib=128)) as sb:
            r = await sb.exec(code="print(6 * 7)", timeout=5)
            r.stdout, r.reason            # b"42\\n", "ok"
        results = await client.run_batch([ExecSpec(code=c) for c in snippets])   # a fresh sandbox each

Errors are `SandboxError` (one line); `AdmissionRefused` (retryable) when the node is full. A command that
fails inside the sandbox is no error: its `ExecResult` says how it ended.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
from collections.abc import Sequence
from typing import Any

from sandbox_client.protocol import ProtocolError, encode, read_frame
from sandbox_client.records import AdmissionRefused, ExecResult, ExecSpec, Limits, SandboxError, command_argv

ANSWER_SLACK_S = 30.0
"""How long past an exec's own timeout the client waits for the server's answer before giving up."""


class SandboxClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader, self._writer = reader, writer
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._listener = asyncio.create_task(self._listen())

    @classmethod
    async def connect(cls, socket_path: str | os.PathLike, *, timeout_s: float = 10.0) -> "SandboxClient":
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(socket_path), limit=1 << 20),
                                                    timeout_s)
        except (OSError, asyncio.TimeoutError) as e:
            raise SandboxError(f"cannot reach the sandbox server at {socket_path} ({e or 'timed out'})") from None
        return cls(reader, writer)

    async def _listen(self) -> None:
        error: Exception = SandboxError("the sandbox server closed the connection")
        last_word = None  # an error frame without an id: why the server is closing this connection
        try:
            while (msg := await read_frame(self._reader)) is not None:
                if msg.get("id") is None and msg.get("ok") is False:
                    last_word = (msg.get("error") or {}).get("message")
                    continue
                future = self._pending.pop(msg.get("id"), None)
                if future is not None and not future.done():
                    future.set_result(msg)
        except (ProtocolError, ConnectionError) as e:
            error = SandboxError(f"the connection to the sandbox server broke ({e})")
        if last_word:
            error = SandboxError(f"the sandbox server closed the connection: {last_word}")
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()

    async def call(self, op: str, wait_s: float | None = None, **args: Any) -> dict[str, Any]:
        """One request; its result, or the server's error raised as `SandboxError` / `AdmissionRefused`."""
        if self._listener.done():
            raise SandboxError("the connection to the sandbox server is closed")
        rid = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        try:
            self._writer.write(encode({"id": rid, "op": op, **args}))
            await self._writer.drain()
            msg = await asyncio.wait_for(future, wait_s)
        except asyncio.TimeoutError:
            raise SandboxError(f"the sandbox server did not answer {op} within {wait_s:.0f} s") from None
        except ConnectionError as e:
            raise SandboxError(f"the connection to the sandbox server broke ({e})") from None
        finally:
            self._pending.pop(rid, None)
        if msg["ok"]:
            return msg["result"]
        error = msg["error"]
        raise (AdmissionRefused if error["kind"] == "admission" else SandboxError)(error["message"])

    async def info(self) -> dict[str, Any]:
        """The server's backend, whether it is strong, its admission limit, how many sandboxes are open, and whether
        it has cgroups and capped work directories (`disk_quota`)."""
        return await self.call("info", wait_s=ANSWER_SLACK_S)

    async def create(self, limits: Limits | None = None, *, warm: bool = True) -> "Sandbox":
        """A new sandbox; `AdmissionRefused` at once when the node is full. Cancelled while the server answers, the
        sandbox it then creates is closed at once (never left holding an admission slot until the connection ends).
        `warm`: its Python calls may fork from a warm interpreter (sandbox_client/warm.py, where the server has it on);
        False for a sandbox of one call, which a spawn serves for less than an interpreter started to fork once."""
        limits = limits or Limits()
        request = asyncio.ensure_future(self.call("create", wait_s=ANSWER_SLACK_S, limits=limits.model_dump(),
                                                  warm=warm))
        try:
            info = await asyncio.shield(request)
        except asyncio.CancelledError:
            request.add_done_callback(self._close_unclaimed)
            raise
        return Sandbox(self, info)

    def _close_unclaimed(self, request: asyncio.Future) -> None:
        """A create whose caller was cancelled: close what it created."""
        if request.cancelled() or request.exception() is not None or self._listener.done():
            return
        orphan = asyncio.ensure_future(self.call("close", wait_s=ANSWER_SLACK_S, sandbox_id=request.result()["sandbox_id"]))
        orphan.add_done_callback(lambda f: f.cancelled() or f.exception())  # nothing to report to anyone

    async def create_waiting(self, limits: Limits | None = None, *, wait_s: float = 60.0, warm: bool = True) -> "Sandbox":
        """`create`, retried with jittered exponential backoff while the node is full, up to `wait_s`."""
        loop = asyncio.get_running_loop()
        deadline, delay = loop.time() + wait_s, 0.01
        while True:
            try:
                return await self.create(limits, warm=warm)
            except AdmissionRefused:
                if loop.time() + delay > deadline:
                    raise
            await asyncio.sleep(delay * random.uniform(0.5, 1.5))
            delay = min(delay * 2, 1.0)

    async def run_batch(self, specs: Sequence[ExecSpec], limits: Limits | None = None, *, concurrency: int = 32,
                        admission_wait_s: float = 60.0) -> list[ExecResult]:
        """Each spec in a fresh sandbox (files written, command run, sandbox closed), `concurrency` at a time;
        results in order. A spec that got no sandbox within `admission_wait_s` gets reason `refused`."""
        gate = asyncio.Semaphore(concurrency)

        async def one(spec: ExecSpec) -> ExecResult:
            argv = command_argv(spec.command, spec.code)
            async with gate:
                try:
                    # one command per sandbox: a spawn costs less than a warm interpreter started to fork once
                    sb = await self.create_waiting(limits, wait_s=admission_wait_s, warm=False)
                except AdmissionRefused as e:
                    return ExecResult(sandbox_id="", command=tuple(argv), stdout=b"", stderr=str(e).encode(),
                                      exit_code=None, signal=None, reason="refused", duration_s=0.0)
                async with sb:
                    for path, data in spec.files.items():
                        await sb.write_file(path, data)
                    return await sb.exec(argv, stdin=spec.stdin, timeout=spec.timeout_s)

        return list(await asyncio.gather(*(one(s) for s in specs)))

    async def close(self) -> None:
        """End the connection; the server closes every sandbox this connection created and left open."""
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except ConnectionError:
            pass
        await self._listener

    async def __aenter__(self) -> "SandboxClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class Sandbox:
    """One sandbox on the server: a private work directory that persists across `exec`s."""

    def __init__(self, client: SandboxClient, info: dict[str, Any]):
        self.client = client
        self.id: str = info["sandbox_id"]
        self.backend: str = info["backend"]
        self.strong: bool = info["strong"]
        self.limits = Limits.model_validate(info["limits"])
        self.host_uid: int | None = info["host_uid"]
        """The uid its processes have on the host (None: the server's own, when it does not run as root)."""
        self.host_work_dir: str = info["work_dir"]
        """The work directory's path on the server's machine (read it there only as an observer; a non-root server
        keeps it in a mount namespace of its own, seen from outside at /proc/<server pid>/root<path>: quota.py)."""
        self.workdir: str = info["workdir_inside"]
        """The work directory as the sandboxed code sees it (/work with bwrap)."""

    async def exec(self, command: str | Sequence[str] | None = None, *, code: str | None = None,
                   stdin: bytes | str = b"", timeout: float | None = None) -> ExecResult:
        """Run `command` (an argv, or a string for `sh -c`) or Python `code` (`python3 -c`) in the work directory;
        `timeout` in seconds (None: the sandbox's `timeout_s`)."""
        argv = command_argv(command, code)
        wait = (timeout or self.limits.timeout_s) + ANSWER_SLACK_S
        result = await self.client.call("exec", wait_s=wait, sandbox_id=self.id, argv=argv, stdin=_bytes(stdin),
                                        timeout_s=timeout)
        return ExecResult.from_wire(result)

    async def write_file(self, path: str, data: bytes | str) -> None:
        """Write a file (its parent directories made); a relative path is relative to the work directory."""
        await self.client.call("write_file", wait_s=self.limits.timeout_s + ANSWER_SLACK_S, sandbox_id=self.id,
                               path=path, data=_bytes(data))

    async def read_file(self, path: str) -> bytes:
        """A file's bytes (up to the sandbox's `output_bytes`; a larger file is an error)."""
        result = await self.client.call("read_file", wait_s=self.limits.timeout_s + ANSWER_SLACK_S,
                                        sandbox_id=self.id, path=path)
        return result["data"]

    async def snapshot(self) -> bytes:
        """The work directory's whole content as a gzip'd tar (taken inside the sandbox; b"" when it is empty); a
        `SandboxError` when the archive passes `limits.snapshot_mib`. Take it while no exec runs, or it may catch files
        half-written."""
        result = await self.client.call("snapshot", wait_s=self.limits.timeout_s + ANSWER_SLACK_S, sandbox_id=self.id)
        return result["data"]

    async def restore(self, archive: bytes) -> None:
        """Make the work directory what `snapshot` returned (its present content is removed first; b"": empty)."""
        await self.client.call("restore", wait_s=self.limits.timeout_s + ANSWER_SLACK_S, sandbox_id=self.id,
                               data=_bytes(archive))

    async def close(self) -> None:
        """Kill everything still running in the sandbox and remove it with its work directory."""
        await self.client.call("close", wait_s=ANSWER_SLACK_S, sandbox_id=self.id)

    async def __aenter__(self) -> "Sandbox":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _bytes(data: bytes | str) -> bytes:
    return data.encode() if isinstance(data, str) else bytes(data)
