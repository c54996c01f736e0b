"""`rl merge`: weights (1, 0) reproduce the first checkpoint exactly, (0.5, 0.5) is the parameter average,
weights are normalised (and said so), run directories resolve to their newest (or a given step's)
checkpoint, and checkpoints of other architectures or vocabularies are refused with one line."""

import pytest
import torch
from safetensors.torch import load_file

from model.checkpoint import save_checkpoint
from model.decoder import Decoder
from rl.cli import main
from tests.conftest import debug_config


def _ckpt(path, seed: int, **kw):
    torch.manual_seed(seed)
    return save_checkpoint(Decoder(debug_config(moe=True, **kw)), path)


def test_weights_one_zero_reproduce_the_first_and_halves_average(tmp_path, capsys):
    a, b = _ckpt(tmp_path / "a", 0), _ckpt(tmp_path / "b", 1)
    assert main(["merge", str(a), str(b), "--weights", "1", "0", "--out", str(tmp_path / "first")]) == 0
    sa, sb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    first = load_file(str(tmp_path / "first" / "model.safetensors"))
    assert first.keys() == sa.keys() and all(torch.equal(first[k], sa[k]) for k in sa)
    assert main(["merge", str(a), str(b), "--weights", "2", "2", "--out", str(tmp_path / "avg")]) == 0
    assert "weights normalised to sum 1: 0.5, 0.5" in capsys.readouterr().out
    avg = load_file(str(tmp_path / "avg" / "model.safetensors"))
    for k in sa:  # Σ w_i θ_i in float64 (exact for halves of float32 values), rounded once: bit-identical on any machine
        torch.testing.assert_close(avg[k], ((sa[k].double() + sb[k].double()) / 2).to(sa[k].dtype), rtol=0, atol=0)
    assert not torch.equal(avg["model.embed_tokens.weight"], sa["model.embed_tokens.weight"])


def test_a_run_directory_resolves_to_its_newest_or_a_given_steps_checkpoint(tmp_path):
    from rl.checkpoint.format import CheckpointManager
    from rl.cli.merge import resolve_source
    from tests.unit.test_checkpoint import _write

    mgr = CheckpointManager(tmp_path / "run" / "checkpoints", warn=lambda m: None)
    four, eight = _write(mgr, 4), _write(mgr, 8)
    assert resolve_source(str(tmp_path / "run")) == eight
    assert resolve_source(f"{tmp_path / 'run'}:4") == four


def test_runs_of_one_model_at_different_lengths_merge_at_the_longest(tmp_path):
    """max_position_embeddings is how long a recipe runs, not a weight (issue #43's specialists: 1024 and 512): the
    merge is the average, saved at the longest, and a checkpoint of either length loads into a model of the other."""
    import json

    from model.pretrained import read_weights
    from model.config import ModelConfig

    a = _ckpt(tmp_path / "a", 0, max_position_embeddings=256)
    b = _ckpt(tmp_path / "b", 1, max_position_embeddings=128)
    assert main(["merge", str(a), str(b), "--out", str(tmp_path / "m")]) == 0
    merged = ModelConfig.model_validate_json((tmp_path / "m" / "config.json").read_text())
    assert merged.max_position_embeddings == 256
    sb = load_file(str(b / "model.safetensors"))
    state = read_weights(merged.model_copy(update={"max_position_embeddings": 64}), b)  # b at another length
    assert all(torch.equal(state[k], sb[k]) for k in sb)
    other = json.loads((a / "config.json").read_text()) | {"num_layers": 1}  # a real difference still refuses
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="different model config"):
        read_weights(ModelConfig.model_validate(other).model_copy(update={"num_layers": 2}), tmp_path / "c")


@pytest.mark.parametrize("other, message", [
    (dict(hidden_size=96, head_dim=24), "has another architecture than"),
    (dict(vocab_size=120), "has vocab_size=120 but"),
])
def test_other_architectures_or_vocabularies_are_refused_in_one_line(tmp_path, capsys, other, message):
    a, b = _ckpt(tmp_path / "a", 0), _ckpt(tmp_path / "b", 1, **other)
    assert main(["merge", str(a), str(b), "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "m").exists()


def test_bad_sources_and_weights_are_one_line(tmp_path, capsys):
    a = _ckpt(tmp_path / "a", 0)
    for argv, message in ((["merge", str(tmp_path / "nope"), "--out", "x"], "neither a model directory"),
                          (["merge", str(a), str(a), "--weights", "1", "--out", "x"], "gives 1 weights for 2 sources"),
                          (["merge", str(a), str(a), "--weights", "0", "0", "--out", "x"], "not all 0")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
