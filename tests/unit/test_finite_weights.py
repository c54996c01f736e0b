"""A model whose weights are NaN or infinite is refused where weights are loaded (issue 40, class 3): a run whose
`run.init_checkpoint` or `model.init` held NaN trained NaN with exit 0. Both loaders (`read_weights`, behind
`load_weights_into`, `load_checkpoint` and every resume; `load_pretrained_into`, behind `model.init` and sharded
resumes) check each floating-point tensor as it is read and raise CheckpointFormatError naming the file and the
tensor; `rl train` says it in one line and exits 2 before any step."""

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.checkpoint import write_weights
from model.pretrained import load_checkpoint, load_weights_into, read_weights
from model.decoder import Decoder
from model.formats import CheckpointFormatError
from model.pretrained import load_pretrained_into
from rl.cli import main
from rl.recipe_io import load_recipe

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_grpo.yaml"
BAD = "model.layers.0.mlp.up_proj.weight"


def _checkpoint(tmp_path: Path, value: float | None, name: str = BAD) -> tuple[Decoder, Path]:
    """A checkpoint directory of the tiny recipe's model, with `value` planted at one element of tensor `name`."""
    torch.manual_seed(0)
    model = Decoder(load_recipe(TINY).model)
    out = tmp_path / "ckpt"
    out.mkdir()
    write_weights(model, out)
    if value is not None:
        state = load_file(str(out / "model.safetensors"))
        assert name in state, sorted(state)
        state[name].view(-1)[3] = value
        save_file(state, str(out / "model.safetensors"))
    return model, out


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_every_loader_refuses_a_non_finite_tensor_naming_it(tmp_path, value):
    model, ckpt = _checkpoint(tmp_path, value)
    fresh = Decoder(model.config)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    for load in (lambda: read_weights(model.config, ckpt), lambda: load_weights_into(fresh, ckpt),
                 lambda: load_checkpoint(ckpt), lambda: load_pretrained_into(fresh, ckpt)):
        with pytest.raises(CheckpointFormatError, match=rf"model\.safetensors: tensor {BAD} holds non-finite values"):
            load()
    assert all(v.isfinite().all() for v in fresh.state_dict().values())  # nothing NaN was copied in
    assert fresh.state_dict().keys() == before.keys()


def test_finite_weights_load_as_before(tmp_path):
    model, ckpt = _checkpoint(tmp_path, None)
    fresh = Decoder(model.config)
    load_weights_into(fresh, ckpt)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
    fresh = Decoder(model.config)
    load_pretrained_into(fresh, ckpt)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("field", ["run.init_checkpoint", "model.init"])
def test_rl_train_from_nan_weights_is_one_line_exit_2_before_any_step(tmp_path, capsys, field):
    _, ckpt = _checkpoint(tmp_path, math.nan)
    run = tmp_path / "run"
    code = main(["train", str(TINY), "--run-dir", str(run), "--set", f"{field}={ckpt}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, (code, err)
    assert err[0].startswith("rl train: ") and f"tensor {BAD} holds non-finite values" in err[0], err[0]
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
