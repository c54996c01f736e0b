"""Isolated code execution for rollouts and verifiers: an async client (`SandboxClient`, `Sandbox`) and the local
sandbox server of one node (server.py, started with `python -m sandbox_client serve` or `LocalServer`).

Isolation is the server's job, through one of two backends (backends.py): `bwrap` (strong: Linux namespaces,
cgroups, an unprivileged uid, no network, a read-only minimal root) and `process` (weak: rlimits only). This
package imports nothing of asyncrl but configbase.
"""

from sandbox_client.client import Sandbox, SandboxClient
from sandbox_client.launch import LocalServer
from sandbox_client.records import REASONS, AdmissionRefused, ExecResult, ExecSpec, Limits, SandboxError

__all__ = ["REASONS", "AdmissionRefused", "ExecResult", "ExecSpec", "Limits", "LocalServer", "Sandbox",
           "SandboxClient", "SandboxError"]
