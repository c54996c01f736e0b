"""`rl validate` of recipes whose `model.init` is a bad checkpoint, and `rl export` of a run's checkpoint
(issue #14, items 1 and 4): bad input is one line and exit 2; a good export loads in transformers with
no missing or unexpected keys and gives the checkpoint's logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from model.checkpoint import write_weights  # noqa: E402
from model.pretrained import build_decoder  # noqa: E402
from rl.checkpoint.format import CheckpointManager, save_tree  # noqa: E402
from rl.cli import main  # noqa: E402
from rl.recipe_io import load_recipe, recipe_to_yaml  # noqa: E402
from tests.hf_tiny import make_hf, write_gguf  # noqa: E402

RECIPE = """run: {{name: t}}
model: {{init: {init}{extra}}}
datasets: [{{type: arithmetic}}]
engine: {{max_batch_size: 8, max_seq_len: 64, max_new_tokens: 8}}
runtime: {{ray: false}}
stages: [{{type: sft}}]
"""


def _recipe(tmp_path: Path, init: Path, extra: str = "") -> Path:
    path = tmp_path / f"recipe-{init.name}.yaml"
    path.write_text(RECIPE.format(init=init, extra=extra))
    return path


def _run(argv, capsys) -> tuple[int, str, str]:
    capsys.readouterr()  # drop what came before (transformers' progress bars)
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A tiny Qwen3 saved by transformers, with the char tokenizer's vocabulary size (99) so that the
    recipes below validate, and a tokenizer file for the export to copy along."""
    d = tmp_path_factory.mktemp("init") / "qwen3"
    make_hf("qwen3", d, seed=2, vocab_size=99)
    (d / "tokenizer.json").write_text('{"stand-in": true}')
    return d


def test_validate_accepts_a_matching_recipe(tmp_path, qwen3_dir, capsys):
    code, out, _ = _run(["validate", _recipe(tmp_path, qwen3_dir, ", num_heads: 4")], capsys)
    assert code == 0 and out.startswith("ok:")


def test_validate_refuses_bad_init_in_one_line(tmp_path, qwen3_dir, capsys):
    sharded = tmp_path / "sharded"
    make_hf("qwen3", sharded, vocab_size=99, max_shard_size="40KB")
    lost = sorted(sharded.glob("model-*.safetensors"))[2]
    lost.unlink()
    iq = write_gguf(make_hf("llama", rope_scaling=None, vocab_size=99, hidden_size=256, intermediate_size=256, head_dim=64),
                    tmp_path / "iq.gguf", "IQ2_XXS")
    cases = [(_recipe(tmp_path, sharded), f"{lost}: missing shard (listed in model.safetensors.index.json)"),
             (_recipe(tmp_path, iq), "has quantisation type IQ2_XXS; asyncrl dequantises"),
             (_recipe(tmp_path, qwen3_dir, ", head_dim: 16"), "has head_dim=32 but the recipe says head_dim=16"),
             (_recipe(tmp_path, tmp_path / "nowhere"), "nowhere: no such file or directory")]
    for recipe, needle in cases:
        code, _, err = _run(["validate", recipe], capsys)
        assert code == 2 and needle in err and err.count("\n") == 1, err
    code, _, err = _run(["validate", _recipe(tmp_path, qwen3_dir), "--set", "model.num_layers=3"], capsys)
    assert code == 2 and "num_layers=3 exceeds the 2 of init" in err


def _run_dir(tmp_path: Path, recipe_path: Path, model, steps=(3, 5)) -> Path:
    """A run directory as the driver leaves it: the resolved recipe and verified checkpoints."""
    run = tmp_path / "run"
    run.mkdir()
    recipe = load_recipe(recipe_path)
    (run / "recipe.yaml").write_text(recipe_to_yaml(recipe))
    mgr = CheckpointManager(run / "checkpoints", warn=lambda m: None)
    for step in steps:
        with torch.no_grad():  # "training" moved the weights
            model.lm_head.weight.add_(0.01)
        tmp = mgr.begin(step)
        write_weights(model, tmp)
        save_tree({}, tmp)
        mgr.commit(tmp, step, {})
    return run


def test_export_a_run_checkpoint(tmp_path, qwen3_dir, capsys):
    from transformers import AutoModelForCausalLM

    recipe_path = _recipe(tmp_path, qwen3_dir)
    model = build_decoder(load_recipe(recipe_path).model).eval()
    run = _run_dir(tmp_path, recipe_path, model)
    code, out, err = _run(["export", run, "--out", tmp_path / "hf"], capsys)
    assert code == 0 and "step-00000005-000" in out, err
    back, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    x = torch.tensor([[1, 5, 17, 40, 3, 98, 2]])
    with torch.no_grad():
        assert (model(x)[0] - back.eval()(x).logits).abs().max() <= 1e-5  # the newest checkpoint, step 5
    assert json.loads((tmp_path / "hf" / "tokenizer.json").read_text()) == {"stand-in": True}
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)  # the run's (char) tokenizer
    code, _, _ = _run(["export", run, "--step", 3, "--out", tmp_path / "hf3"], capsys)
    back3 = AutoModelForCausalLM.from_pretrained(tmp_path / "hf3", dtype=torch.float32)
    assert code == 0 and torch.allclose(back3.lm_head.weight + 0.01, back.lm_head.weight)


def test_export_bad_input_is_one_line(tmp_path, qwen3_dir, capsys):
    from tests.conftest import debug_config

    recipe_path = _recipe(tmp_path, qwen3_dir)
    run = _run_dir(tmp_path, recipe_path, build_decoder(load_recipe(recipe_path).model))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    moe = tmp_path / "moe"
    moe.mkdir()
    write_weights(build_decoder(debug_config(moe=True)), moe)  # shared experts: no HF architecture
    cases = [(["export", tmp_path, "--out", tmp_path / "o1"], "is not a run directory (no recipe.yaml)"),
             (["export", run, "--step", 4, "--out", tmp_path / "o2"], "no verified checkpoint of step 4 under"),
             (["export", run, "--out", tmp_path / "full"], "exists and is not an empty directory"),
             (["export", run, "--checkpoint", moe, "--out", tmp_path / "o3"],
              "an MoE model exports as qwen3_moe only: qk_norm on, no attention bias, no shared experts")]
    for argv, needle in cases:
        code, _, err = _run(argv, capsys)
        assert code == 2 and needle in err and err.count("\n") == 1, err
    assert not (tmp_path / "o3").exists() and not list(tmp_path.glob("*.tmp-export"))
