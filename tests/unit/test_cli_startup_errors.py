"""Failures of the `rl` command before a job runs are one line (issue #40, class 7): Ctrl-C (SIGINT) while the
command starts (importing, parsing, validating: before a job's own handlers) exits 130, as a second SIGINT to a
running job does (exit 3 is a preemption that wrote a checkpoint); `rl eval --checkpoint` of a checkpoint whose
vocabulary is not the run's is refused. Real processes, real checkpoint files."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl.cli import main

CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]
ROOT = Path(__file__).resolve().parents[2]
LEGACY_RUN = ROOT / "tests" / "fixtures" / "run-52ad3d6"
"""A finished run (char tokenizer, vocab 99) with checkpoints: what `rl eval` reads."""


@pytest.mark.parametrize("delay", [0.3, 0.8, 1.5])
def test_sigint_while_the_command_starts_is_one_line_and_exit_130(delay):
    proc = subprocess.Popen([*CLI, "validate", "configs/quickstart.yaml"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    if proc.returncode == 0:  # it finished first: nothing to check
        assert out.startswith("ok: ")
        return
    assert proc.returncode == 130, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("rl") and "interrupted (SIGINT)" in err


def test_a_keyboard_interrupt_inside_a_command_is_one_line_exit_130(monkeypatch, capsys):
    import rl.cli.commands as cli_main

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "cmd_validate", interrupted)
    assert main(["validate", "configs/quickstart.yaml"]) == 130
    assert capsys.readouterr().err == "rl validate: interrupted (SIGINT)\n"


def test_an_error_raised_while_unwinding_from_sigint_is_the_interrupt(monkeypatch, capsys):
    """Cleanup that meets a module whose import the interrupt cut short (seen: numpy without `multiply`) raises
    another error on the way out: still the user's Ctrl-C, one line, 130. An error without an interrupt is a bug."""
    import rl.cli.commands as cli_main

    def cut_short(args):
        try:
            raise KeyboardInterrupt
        finally:
            raise AttributeError("module 'numpy' has no attribute 'multiply'")

    monkeypatch.setattr(cli_main, "cmd_validate", cut_short)
    assert main(["validate", "configs/quickstart.yaml"]) == 130
    assert capsys.readouterr().err == "rl validate: interrupted (SIGINT)\n"

    def bug(args):
        raise AttributeError("a bug")

    monkeypatch.setattr(cli_main, "cmd_validate", bug)
    with pytest.raises(AttributeError, match="a bug"):
        main(["validate", "configs/quickstart.yaml"])


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(LEGACY_RUN, run)
    return run


@pytest.mark.parametrize("vocab", [64, 300])
def test_eval_of_a_checkpoint_of_another_vocabulary_is_one_line_exit_2(run_dir, tmp_path, vocab):
    import torch

    from model.checkpoint import load_config, save_checkpoint
    from model.decoder import Decoder

    config = load_config(run_dir / "checkpoints" / "step-00000008-000").model_copy(update={"vocab_size": vocab})
    torch.manual_seed(0)
    other = save_checkpoint(Decoder(config), tmp_path / "other")
    proc = subprocess.run([*CLI, "eval", str(run_dir), "--checkpoint", str(other), "--max-problems", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (f"rl eval: checkpoint {other} has a vocabulary of {vocab} ids, the run's model has 99 "
                           f"(model.vocab_size): it was trained with another tokenizer\n")
    assert proc.stdout == ""


@pytest.mark.parametrize("damage", ["config.json", "model.safetensors"])
def test_eval_of_a_damaged_checkpoint_is_one_line_exit_2(run_dir, damage):
    ckpt = run_dir / "checkpoints" / "step-00000008-000"
    (ckpt / damage).write_bytes(b"\x00garbage")
    proc = subprocess.run([*CLI, "eval", str(run_dir), "--checkpoint", str(ckpt), "--max-problems", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rl eval: checkpoint {ckpt}: ") and damage in lines[0], proc.stderr
