"""`rl traj` with integers a store column cannot hold (issue #40, class 7): one line on stderr and exit 2,
through the real CLI against a real SQLite store; a traceback (OverflowError from the driver) before."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rl.cli import main
from rl.store.trajectories import TrajectoryStore
from tests.unit.test_store import make_sample

CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]
PAST_64_BITS = "99999999999999999999"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("traj") / "run"
    store = TrajectoryStore.for_run_dir(run)
    store.add_samples([make_sample("s0")])
    store.close()
    return run


def test_an_integer_past_64_bits_is_one_line_exit_2_through_the_real_cli(run_dir):
    before = (run_dir / "trajectories.db").read_bytes()
    proc = subprocess.run([*CLI, "traj", "ls", str(run_dir), "--step", PAST_64_BITS], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"rl traj ls: argument --step: {PAST_64_BITS} is past the 64-bit integers a store holds\n"
    assert (run_dir / "trajectories.db").read_bytes() == before


@pytest.mark.parametrize("option", ["--step", "--effort", "--limit"])
@pytest.mark.parametrize("value", [PAST_64_BITS, "-" + PAST_64_BITS, str(2**63)])
def test_integers_past_64_bits_are_one_line_exit_2(run_dir, option, value, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["traj", "ls", str(run_dir), option, value])
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rl traj ls: argument {option}: "), lines


def test_the_widest_64_bit_integers_are_valid_filters(run_dir, capsys):
    for option, value in (("--step", 2**63 - 1), ("--effort", -(2**63)), ("--limit", 2**63 - 1)):
        assert main(["traj", "ls", str(run_dir), option, str(value)]) == 0
    capsys.readouterr()
    assert main(["traj", "show", str(run_dir), PAST_64_BITS]) == 2  # a sample id is text: not found, one line
    assert capsys.readouterr().err == f"rl traj: no sample '{PAST_64_BITS}' in {run_dir}\n"
