"""Payloads that betray foreign code by a canary file, for tests/integration/test_planted_payloads.py and
bench/abuse.py (issue #13)."""

from __future__ import annotations

from pathlib import Path


def pickle_payload(canary: Path) -> bytes:
    """A protocol-0 pickle that creates `canary` when unpickled (written by hand: no pickle module here)."""
    return f"c__builtin__\nopen\n(S'{canary}'\nS'w'\ntR.".encode()
