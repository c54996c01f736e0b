"""`rl sandbox serve` (rl/cli/commands.py -> sandbox_client/cli.py): a server started through the project's CLI answers
the client and stops cleanly on SIGTERM (exit 0); bad arguments are one line with exit 2."""

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from sandbox_client import SandboxClient

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]


def test_bad_arguments_are_one_line_exit_2():
    proc = subprocess.run([*CLI, "sandbox", "serve", "--socket", "s.sock", "--max-sandboxes", "x"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "rl sandbox serve: argument --max-sandboxes: invalid int value: 'x'"], proc.stderr


def test_rl_sandbox_serve_runs_code_and_stops_on_sigterm():
    if shutil.which("bwrap") is None and os.environ.get("CI") != "true":
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap; .ci/run does)")
    scratch = Path(tempfile.mkdtemp(prefix="asyncrl-sbx-cli-"))  # not under pytest's 0700 tmp: sandbox uids traverse it
    scratch.chmod(0o711)
    sock = scratch / "s.sock"
    server = subprocess.Popen([*CLI, "sandbox", "serve", "--socket", str(sock), "--max-sandboxes", "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            with socket.socket(socket.AF_UNIX) as s:
                if s.connect_ex(str(sock)) == 0:
                    break
            assert server.poll() is None and time.monotonic() < deadline, server.stderr.read() if server.poll() else ""
            time.sleep(0.05)

        async def run():
            async with await SandboxClient.connect(sock) as client:
                async with await client.create() as sb:
                    return await sb.exec(code="print(6 * 7)")

        result = asyncio.run(run())
        assert result.ok and result.stdout == b"42\n", result
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0
        assert "listening on" in server.stderr.read()
    finally:
        if server.poll() is None:
            server.kill()
        shutil.rmtree(scratch, ignore_errors=True)
