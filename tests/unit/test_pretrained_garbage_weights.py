"""`run.init_checkpoint` pointing at garbage weights (issue 40, class 7): a tensor of the wrong shape, of an integer
dtype, missing, or a truncated safetensors file is one CheckpointFormatError line naming the file (and the tensor),
never a multi-line RuntimeError, a SafetensorError or integers silently cast into the weights; `rl train` exits 2."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.checkpoint import write_weights
from model.decoder import Decoder
from model.formats import CheckpointFormatError
from rl.cli import main
from rl.recipe_io import load_recipe
from rl.runtime.worker import build_policy

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_grpo.yaml"
NAME = "model.layers.0.mlp.up_proj.weight"


def _garbage(tmp_path: Path, kind: str) -> Path:
    torch.manual_seed(0)
    out = tmp_path / "ckpt"
    out.mkdir()
    write_weights(Decoder(load_recipe(TINY).model), out)
    f = out / "model.safetensors"
    state = load_file(str(f))
    if kind == "shape":
        state[NAME] = torch.zeros(3, 5)
    elif kind == "dtype":
        state[NAME] = (state[NAME] * 100).to(torch.int32)
    elif kind == "missing":
        del state[NAME]
    save_file(state, str(f))
    if kind == "truncated":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return out


@pytest.mark.parametrize("kind, message", [
    ("shape", f"tensor {NAME} has shape (3, 5)"),
    ("dtype", f"tensor {NAME} is int32, not floating point"),
    ("missing", f"no tensor for {NAME}"),
    ("truncated", "not a readable safetensors file"),
])
def test_garbage_init_checkpoint_is_one_line(tmp_path, kind, message):
    ckpt = _garbage(tmp_path, kind)
    recipe = load_recipe(TINY, [f"run.init_checkpoint={ckpt}"])
    with pytest.raises(CheckpointFormatError) as e:
        build_policy(recipe)
    assert message in str(e.value) and str(ckpt) in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_rl_train_from_garbage_weights_exits_2_in_one_line(tmp_path, capsys):
    ckpt = _garbage(tmp_path, "shape")
    code = main(["train", str(TINY), "--run-dir", str(tmp_path / "run"), "--set", f"run.init_checkpoint={ckpt}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"tensor {NAME} has shape (3, 5)" in err[0], (code, err)
