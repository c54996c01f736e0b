"""`python -m sandbox_client serve ...` (and, once rl/cli/commands.py wires it, `rl sandbox serve ...`): run a sandbox
server in the foreground until SIGTERM or SIGINT.

    python -m sandbox_client serve --socket /run/asyncrl/sandbox.sock --max-sandboxes 32 --backend bwrap
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from sandbox_client.backends import BACKENDS
from sandbox_client.records import SandboxError
from sandbox_client.server import SandboxServer, ServerError


class _OneLineParser(argparse.ArgumentParser):
    """Usage errors in one line and exit 2, like every expected failure of `rl` (README "Exit codes")."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message.splitlines()[0]}\n")


def serve_parser(prog: str = "python -m sandbox_client serve") -> argparse.ArgumentParser:
    ap = _OneLineParser(prog=prog, description="Run a sandbox server on this node.")
    ap.add_argument("--socket", required=True, help="the Unix socket to listen on")
    ap.add_argument("--state-dir", default=None,
                    help="sandboxes' work directories, records and the command log (default: SOCKET.state)")
    ap.add_argument("--max-sandboxes", type=int, default=32, help="admission limit: open sandboxes at once")
    ap.add_argument("--backend", choices=sorted(BACKENDS), default="bwrap",
                    help="bwrap: namespaces + cgroups (strong); process: rlimits only (weak)")
    ap.add_argument("--uid-base", type=int, default=None,
                    help="first host uid of the sandboxes under a root server (default: derived from the state dir)")
    ap.add_argument("--warm-interpreter", action=argparse.BooleanOptionalAction, default=True,
                    help="a sandbox's python3 -c calls fork from a warm interpreter of its own (default: on)")
    return ap


def serve(argv: list[str], prog: str = "python -m sandbox_client serve") -> int:
    """Parse `serve`'s arguments and serve; 0 after a clean stop, 2 with one line when it cannot start."""
    a = serve_parser(prog).parse_args(argv)

    async def run() -> None:
        server = SandboxServer(a.state_dir or f"{a.socket}.state", a.socket, backend=a.backend,
                               max_sandboxes=a.max_sandboxes, uid_base=a.uid_base,
                               warm_interpreter=a.warm_interpreter)
        await server.start()
        await server.serve_forever()

    try:
        asyncio.run(run())
    except (ServerError, SandboxError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "serve":
        print("usage: python -m sandbox_client serve --socket PATH [--max-sandboxes N] [--backend bwrap|process]",
              file=sys.stderr)
        return 2
    return serve(argv[1:])
