"""The `rl` command (`main`) and its sub-commands, one module each: main (validate, train, resume,
reconfigure, sandbox), traj, eval, db, merge, models, export. Errors are one line and a non-zero exit
(README, exit codes)."""

from rl.cli.main import main

__all__ = ["main"]
