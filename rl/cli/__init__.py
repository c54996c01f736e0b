"""The `rl` command (`main`) and its sub-commands, one module each: commands (validate, train, resume,
reconfigure, sandbox), traj, eval, db, merge, models, export. Errors are one line and a non-zero exit
(README, exit codes)."""

import sys


def main(argv: list[str] | None = None) -> int:
    """The `rl` entry point. The command line's modules are imported here, not when this package is: a SIGINT
    (Ctrl-C) during those imports is the same one line and exit 130 as one while the command starts."""
    try:
        from rl.cli.commands import main as run
    except KeyboardInterrupt:
        print("rl: interrupted (SIGINT)", file=sys.stderr)
        return 130
    return run(argv)


__all__ = ["main"]
