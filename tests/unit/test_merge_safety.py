"""`rl merge` never destroys what it does not own and never writes a meaningless model (issue 40, classes 1, 3, 7):
`--out` must be absent or an empty directory (a run directory, even a source of the merge, a non-empty folder,
a link or `.` are refused in one line and left byte for byte), weights must be finite with a positive finite
sum, and a Hugging Face directory (what `rl export` writes) or a damaged source is one line, never a traceback."""

import hashlib
import os

import pytest
import torch
from safetensors.torch import load_file

from model.checkpoint import save_checkpoint
from model.decoder import Decoder
from rl.cli.commands import main
from tests.conftest import debug_config


def _ckpt(path, seed: int):
    torch.manual_seed(seed)
    return save_checkpoint(Decoder(debug_config(moe=False)), path)


def tree_digest(root) -> dict[str, str]:
    """Every entry under `root` (links as their target text, not followed) -> digest of its bytes."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = "link:" + os.readlink(p)
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    out[rel] = hashlib.blake2b(f.read(), digest_size=16).hexdigest()
            else:
                out[rel] = "dir"
    return out


def _one_line_refusal(capsys, *texts):
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("rl merge: "), err
    assert all(t in err for t in texts), err
    assert "Traceback" not in err


def test_out_a_run_directory_that_is_a_source_is_refused_and_left_intact(tmp_path, capsys):
    from model.checkpoint import write_weights
    from rl.checkpoint.format import CheckpointManager, save_tree

    run = tmp_path / "run"
    mgr = CheckpointManager(run / "checkpoints", warn=lambda m: None)
    tmp = mgr.begin(4)
    torch.manual_seed(0)
    write_weights(Decoder(debug_config(moe=False)), tmp)
    save_tree({"torch_rng": torch.get_rng_state()}, tmp)
    mgr.commit(tmp, 4, {"global_step": 4})
    for name, text in (("recipe.yaml", "run: {name: x}\n"), ("metrics.jsonl", '{"step": 1}\n'),
                       ("trajectories.db", "not really sqlite")):
        (run / name).write_text(text)
    other = _ckpt(tmp_path / "b", 1)
    before = tree_digest(tmp_path)
    assert main(["merge", str(run), str(other), "--out", str(run)]) == 2
    _one_line_refusal(capsys, "--out", "not an empty directory")
    assert tree_digest(tmp_path) == before


def test_out_an_existing_folder_with_files_is_refused_and_its_files_kept(tmp_path, capsys):
    a, b = _ckpt(tmp_path / "a", 0), _ckpt(tmp_path / "b", 1)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    before = tree_digest(tmp_path)
    assert main(["merge", str(a), str(b), "--out", str(out)]) == 2
    _one_line_refusal(capsys, str(out), "not an empty directory")
    assert tree_digest(tmp_path) == before


def test_out_an_older_merge_is_refused_too(tmp_path, capsys):
    """An earlier merge's directory is a directory this command did not create: never replaced."""
    a, b = _ckpt(tmp_path / "a", 0), _ckpt(tmp_path / "b", 1)
    assert main(["merge", str(a), str(b), "--out", str(tmp_path / "m")]) == 0
    before = tree_digest(tmp_path)
    assert main(["merge", str(a), str(b), "--weights", "1", "0", "--out", str(tmp_path / "m")]) == 2
    _one_line_refusal(capsys, "not an empty directory")
    assert tree_digest(tmp_path) == before


def test_out_an_empty_folder_is_filled_and_a_users_tmp_sibling_is_left_alone(tmp_path, capsys):
    a, b = _ckpt(tmp_path / "a", 0), _ckpt(tmp_path / "b", 1)
    out = tmp_path / "m"
    out.mkdir()
    users = tmp_path / "m.tmp"  # the old writer's fixed temporary name: it deleted a folder of this name
    users.mkdir()
    (users / "data").write_text("mine")
    assert main(["merge", str(a), str(b), "--out", str(out)]) == 0
    assert load_file(str(out / "model.safetensors")).keys() == load_file(str(a / "model.safetensors")).keys()
    assert (users / "data").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "m", "m.tmp"]  # no temporary left behind


@pytest.mark.parametrize("kind", ["link", "dot", "file"])
def test_out_a_link_the_current_directory_or_a_file_is_refused(tmp_path, capsys, monkeypatch, kind):
    a, b = _ckpt(tmp_path / "a", 0), _ckpt(tmp_path / "b", 1)
    (tmp_path / "empty").mkdir()
    if kind == "link":
        (tmp_path / "out").symlink_to(tmp_path / "empty")
        out = str(tmp_path / "out")
    elif kind == "file":
        (tmp_path / "out").write_text("a file")
        out = str(tmp_path / "out")
    else:
        monkeypatch.chdir(tmp_path / "empty")
        out = "."
    before = tree_digest(tmp_path)
    assert main(["merge", str(a), str(b), "--out", out]) == 2
    _one_line_refusal(capsys, "--out")
    assert tree_digest(tmp_path) == before


@pytest.mark.parametrize("weights", [["nan", "1"], ["inf", "1"], ["1", "1e400"], ["1e308", "1e308"], ["0", "0"],
                                     ["-1", "2"]])
def test_weights_that_are_not_finite_or_whose_sum_is_not_positive_and_finite_are_refused(tmp_path, capsys, weights):
    a, b = _ckpt(tmp_path / "a", 0), _ckpt(tmp_path / "b", 1)
    try:  # a number that is not finite is argparse's usage error (SystemExit 2); the others cmd_merge's
        code = main(["merge", str(a), str(b), "--weights", *weights, "--out", str(tmp_path / "m")])
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--weights" in err and "Traceback" not in err, err
    assert not (tmp_path / "m").exists()


def test_huge_but_finite_weights_are_normalised_not_overflowed(tmp_path, capsys):
    a, b = _ckpt(tmp_path / "a", 0), _ckpt(tmp_path / "b", 1)
    assert main(["merge", str(a), str(b), "--weights", "1e307", "1e307", "--out", str(tmp_path / "m")]) == 0
    sa, sb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    m = load_file(str(tmp_path / "m" / "model.safetensors"))
    for k in sa:
        torch.testing.assert_close(m[k], ((sa[k].double() + sb[k].double()) / 2).to(sa[k].dtype), rtol=0, atol=0)


def test_a_hugging_face_directory_merges_and_a_damaged_source_is_one_line(tmp_path, capsys):
    """What `rl export` writes is a source like any other (read through the declared conversion): the old code took
    its config.json for ours and died in a traceback."""
    from model.pretrained import export_checkpoint

    a = _ckpt(tmp_path / "a", 0)
    hf = export_checkpoint(a, tmp_path / "hf")
    assert main(["merge", str(a), str(hf), "--out", str(tmp_path / "m")]) == 0
    sa, m = load_file(str(a / "model.safetensors")), load_file(str(tmp_path / "m" / "model.safetensors"))
    assert m.keys() == sa.keys() and all(torch.equal(m[k], sa[k]) for k in sa)  # (θ + θ) / 2 = θ, exactly
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    (bad / "model.safetensors").write_bytes(b"\0" * 16)
    assert main(["merge", str(a), str(bad), "--out", str(tmp_path / "m2")]) == 2
    _one_line_refusal(capsys, str(bad))
    torn = _ckpt(tmp_path / "torn", 1)
    (torn / "model.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0{}")  # a header that names no tensor
    assert main(["merge", str(a), str(torn), "--out", str(tmp_path / "m2")]) == 2
    _one_line_refusal(capsys, str(torn))
    assert not (tmp_path / "m2").exists()


def test_a_source_whose_weights_are_not_finite_is_refused(tmp_path, capsys):
    from safetensors.torch import save_file

    a, b = _ckpt(tmp_path / "a", 0), _ckpt(tmp_path / "b", 1)
    state = load_file(str(b / "model.safetensors"))
    state["model.embed_tokens.weight"][3, 5] = float("nan")
    save_file(state, str(b / "model.safetensors"))
    assert main(["merge", str(a), str(b), "--weights", "1", "0", "--out", str(tmp_path / "m")]) == 2
    _one_line_refusal(capsys, str(b), "model.embed_tokens.weight", "non-finite")
    assert not (tmp_path / "m").exists()
