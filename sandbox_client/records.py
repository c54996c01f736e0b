"""The records that cross the client/server boundary: a sandbox's `Limits`, one command's `ExecResult`, the
`ExecSpec` of a batch item, and the errors a caller can act on.

Every record turns into a msgpack-able dict and back (`to_wire` / `from_wire`), so the server's JSONL log and
a caller's store keep exactly what the client saw.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import Field

from configbase import StrictConfig

MIB = 1 << 20

Reason = Literal["ok", "timeout", "memory", "cpu", "processes", "output_truncated", "crashed", "refused"]
"""Why an exec ended: `ok` (the command ran to its own end, whatever its exit code), a limit that stopped it
(`timeout` wall clock, `memory`, `cpu` time, `processes` count, `output_truncated`: the output passed its cap
and the command was killed), `crashed` (killed by a signal no limit sent), or `refused` (no sandbox was
admitted before the batch's deadline; the command never ran)."""
REASONS: tuple[str, ...] = Reason.__args__


class Limits(StrictConfig):
    """What one sandbox may use. The strong backend enforces memory, processes and CPU time per sandbox through
    cgroups, with rlimits per process as a second line; the process backend has the rlimits only."""

    memory_mib: int = Field(256, ge=16, le=1 << 20)
    """Memory of all the sandbox's processes together (RAM, /tmp's tmpfs included; no swap), MiB."""
    cpu_s: float = Field(10.0, gt=0, le=24 * 3600)
    """CPU seconds one exec may use, summed over its processes."""
    max_processes: int = Field(64, ge=4, le=1 << 16)
    """Processes (and threads) the sandbox may hold at once, its init and bwrap's monitor included."""
    timeout_s: float = Field(30.0, gt=0, le=24 * 3600)
    """Wall-clock seconds of one exec unless the exec names its own; then the whole process tree is killed."""
    output_bytes: int = Field(MIB, ge=1024, le=64 * MIB)
    """Bytes kept of each of stdout and stderr (and the largest file `read_file` returns); past it the exec is
    killed with reason `output_truncated`."""
    file_mib: int = Field(64, ge=1, le=1 << 20)
    """Largest file one process may write (RLIMIT_FSIZE), MiB. The work directory's total is `disk_mib`."""
    disk_mib: int = Field(128, ge=1, le=1 << 20)
    """What the work directory may hold in all, MiB: it is a tmpfs of this size (sandbox_client/quota.py), so a
    write past it fails inside the sandbox with ENOSPC and never fills the host's disk. Its files are RAM charged
    to `memory_mib`: keep it below that, or a writer is OOM-killed (reason `memory`) before it sees ENOSPC."""
    disk_inodes: int = Field(16384, ge=16, le=1 << 24)
    """Files, directories and links the work directory may hold in all (the tmpfs's inodes); past it, ENOSPC."""
    snapshot_mib: int = Field(16, ge=1, le=192)
    """Largest archive (gzip'd tar) of the work directory that `snapshot` returns, MiB; a larger work directory
    cannot be snapshot (a one-line error). Multi-turn rollouts keep one per in-flight sample in checkpoints."""


@dataclass(frozen=True)
class ExecResult:
    """One command run in a sandbox, as the server saw it: what ran, what it printed, how it ended."""

    sandbox_id: str
    command: tuple[str, ...]
    """The argv run inside the sandbox (a string command becomes `sh -c`, code becomes `python3 -c`)."""
    stdout: bytes
    stderr: bytes
    exit_code: int | None
    """None when a signal ended the command (`signal` says which)."""
    signal: int | None
    reason: Reason
    duration_s: float
    """From the spawn to the end of the output."""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    cpu_s: float | None = None
    """CPU seconds the sandbox used during the exec (None where no cgroup measures it)."""
    started_at: float = 0.0
    """Unix time of the spawn."""

    @property
    def ok(self) -> bool:
        """The command ran to its end and exited 0."""
        return self.reason == "ok" and self.exit_code == 0

    @property
    def stdout_text(self) -> str:
        return self.stdout.decode(errors="replace")

    @property
    def stderr_text(self) -> str:
        return self.stderr.decode(errors="replace")

    def to_wire(self) -> dict[str, Any]:
        d = asdict(self)
        d["command"] = list(self.command)
        return d

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "ExecResult":
        return cls(**{**d, "command": tuple(d["command"])})


@dataclass(frozen=True)
class ExecSpec:
    """One item of a batch: a command (argv, or a string for `sh -c`) or Python code, its stdin, files to
    write into the work directory first, and a timeout (None: the sandbox's `timeout_s`)."""

    command: str | Sequence[str] | None = None
    code: str | None = None
    stdin: bytes | str = b""
    timeout_s: float | None = None
    files: Mapping[str, bytes | str] = field(default_factory=dict)


def command_argv(command: str | Sequence[str] | None, code: str | None) -> list[str]:
    """The argv to run inside a sandbox for exactly one of `command` and `code`."""
    if (command is None) == (code is None):
        raise ValueError("give exactly one of command and code")
    if code is not None:
        return ["python3", "-c", code]
    if isinstance(command, str):
        return ["/bin/sh", "-c", command]
    argv = list(command)
    if not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError("command must be a string or a non-empty list of strings")
    return argv


class SandboxError(RuntimeError):
    """A request the sandbox server could not carry out; the message is one line."""

    retryable = False


class AdmissionRefused(SandboxError):
    """The node already holds its maximum of sandboxes: retry later (the server never queues a create)."""

    retryable = True
