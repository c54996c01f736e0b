"""A real bubblewrap sandbox server in a scratch directory for tests (skipped where bubblewrap is missing, except
under CI=true, where that fails)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sandbox_client import LocalServer


@contextmanager
def bwrap_server(prefix: str, max_sandboxes: int = 4) -> Iterator[tuple[LocalServer, Path]]:
    """The server and its socket; stopped and its scratch directory removed on exit."""
    if shutil.which("bwrap") is None and os.environ.get("CI") != "true":
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap; .ci/run does)")
    scratch = Path(tempfile.mkdtemp(prefix=prefix))
    scratch.chmod(0o711)  # sandbox uids traverse it to their work directories
    srv = LocalServer(scratch / "s.sock", scratch / "state", max_sandboxes=max_sandboxes)
    try:
        yield srv, scratch / "s.sock"
    finally:
        srv.stop()
        shutil.rmtree(scratch, ignore_errors=True)
