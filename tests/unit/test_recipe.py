"""Recipe loading: one-line `RecipeError`s that name the file, line and field; `--set` overrides; round trip."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Annotated, Union, get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel

from rl.config import GRPOStage, Recipe, SFTStage
from rl.recipe_io import RecipeError, apply_overrides, load_recipe, load_recipe_dict, recipe_to_yaml

REPO = Path(__file__).resolve().parents[2]

GOOD = """\
run:
  name: t
  seed: 0
model:
  hidden_size: 64
  num_layers: 2
  num_heads: 2
  num_kv_heads: 1
  head_dim: 32
  ffn:
    type: moe
    num_experts: 4
    num_experts_per_tok: 2
datasets:
  - type: arithmetic
    name: arith
    max_digits: 3
stages:
  - type: sft
    max_steps: 10
    batch_size: 8
  - type: grpo
    max_steps: 5
    optim:
      lr: 1.0e-4
logging:
  wandb: false
"""


def line_of(text: str, needle: str) -> int:
    """1-based line of the one line of `text` that contains `needle`."""
    hits = [i for i, line in enumerate(text.splitlines(), 1) if needle in line]
    assert len(hits) == 1, (needle, hits)
    return hits[0]


def edit(old: str, new: str, text: str = GOOD) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Work in tmp_path so messages carry the short relative name `r.yaml`."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def error_of(text: str, overrides: list[str] = ()) -> str:
    Path("r.yaml").write_text(text)
    with pytest.raises(RecipeError) as info:
        load_recipe("r.yaml", overrides)
    msg = str(info.value)
    assert "\n" not in msg and "\r" not in msg, msg
    assert "Traceback" not in msg and "validation error" not in msg, msg  # not pydantic's own multi-line text
    return msg


# ---------------------------------------------------------------------------------------------------------------
# Good recipe


def test_good_recipe_loads(in_tmp):
    Path("r.yaml").write_text(GOOD)
    recipe = load_recipe("r.yaml")
    assert isinstance(recipe, Recipe)
    assert [type(s) for s in recipe.stages] == [SFTStage, GRPOStage]
    assert recipe.stages[1].optim.lr == pytest.approx(1e-4)
    assert recipe.model.is_moe


def test_line_map(in_tmp):
    Path("r.yaml").write_text(GOOD)
    data, lines = load_recipe_dict("r.yaml")
    assert data["stages"][1]["optim"]["lr"] == pytest.approx(1e-4)
    assert lines[("run",)] == 1
    assert lines[("run", "seed")] == 3
    assert lines[("stages", 0)] == line_of(GOOD, "- type: sft")
    assert lines[("stages", 1, "optim", "lr")] == line_of(GOOD, "lr: 1.0e-4")
    assert lines[("datasets", 0, "max_digits")] == line_of(GOOD, "max_digits")


def test_exponent_floats_without_dot_are_floats(in_tmp):
    """PyYAML (YAML 1.1) reads `1e-4` as a string; recipes read it as YAML 1.2 does."""
    Path("r.yaml").write_text(edit("lr: 1.0e-4", "lr: 3e-4"))
    data, _ = load_recipe_dict("r.yaml")
    assert data["stages"][1]["optim"]["lr"] == 3e-4 and isinstance(data["stages"][1]["optim"]["lr"], float)


# ---------------------------------------------------------------------------------------------------------------
# Bad recipes: one line, field path, line number


def test_unknown_top_level_key(in_tmp):
    text = GOOD + "trainer:\n  lr: 1\n"
    assert error_of(text) == f"r.yaml:{line_of(text, 'trainer:')}: trainer: unknown key (not a field of Recipe)"


def test_unknown_nested_key_suggests_the_field(in_tmp):
    text = edit("  seed: 0", "  sede: 0")
    assert error_of(text) == "r.yaml:3: run.sede: unknown key (not a field of RunConfig; did you mean 'seed'?)"


def test_unknown_key_inside_tagged_union_member(in_tmp):
    text = edit("      lr: 1.0e-4", "      lr: 1.0e-4\n      momentum: 0.9")
    assert error_of(text) == f"r.yaml:{line_of(text, 'momentum')}: stages.1.optim.momentum: unknown key (not a field of OptimConfig)"
    text = edit("    max_digits: 3", "    max_digits: 3\n    foo: 1")
    assert error_of(text) == f"r.yaml:{line_of(text, 'foo')}: datasets.0.foo: unknown key (not a field of ArithmeticConfig)"


def test_wrong_type(in_tmp):
    text = edit("hidden_size: 64", "hidden_size: big")
    assert error_of(text) == (f"r.yaml:{line_of(text, 'hidden_size')}: model.hidden_size: "
                              "Input should be a valid integer, unable to parse string as an integer (got 'big')")


def test_wrong_type_of_a_section(in_tmp):
    text = edit("logging:\n  wandb: false\n", "logging: 5\n")
    msg = error_of(text)
    assert msg.startswith(f"r.yaml:{line_of(text, 'logging')}: logging: ") and msg.endswith("(got 5)")


def test_missing_required_field(in_tmp):
    text = edit("datasets:\n  - type: arithmetic\n    name: arith\n    max_digits: 3\n", "")
    assert error_of(text) == "r.yaml: datasets: missing required field"


def test_out_of_range_value(in_tmp):
    text = edit("    batch_size: 8", "    batch_size: -4")
    assert error_of(text) == f"r.yaml:{line_of(text, 'batch_size')}: stages.0.batch_size: Input should be greater than 0 (got -4)"
    text = edit("lr: 1.0e-4", "lr: -0.001")
    assert error_of(text) == f"r.yaml:{line_of(text, 'lr:')}: stages.1.optim.lr: Input should be greater than 0 (got -0.001)"


def test_long_input_is_truncated(in_tmp):
    text = edit("hidden_size: 64", "hidden_size: " + "x" * 200)
    msg = error_of(text)
    got = msg[msg.index("(got ") + 5: -1]
    assert len(got) == 60 and got.endswith("...")


def test_model_validator_error_points_at_its_section(in_tmp):
    text = edit("num_experts_per_tok: 2", "num_experts_per_tok: 5")
    assert error_of(text) == (f"r.yaml:{line_of(text, 'ffn:')}: model.ffn: "
                              "Value error, num_experts_per_tok=5 exceeds num_experts=4")


def test_root_validator_error_has_no_field(in_tmp):
    text = edit("hidden_size: 64", "hidden_size: 64\n  vocab_size: 5")
    assert error_of(text) == "r.yaml: Value error, model.vocab_size=5 but the char tokenizer has 99 ids"


def test_more_errors_are_counted(in_tmp):
    text = edit("hidden_size: 64", "hidden_size: -1\n  num_layers_: 2")
    assert error_of(text).endswith("Input should be greater than 0 (got -1) (+1 more error)")


def test_nonexistent_checkpoint(in_tmp):
    text = edit("  seed: 0", "  seed: 0\n  init_checkpoint: no/such/ckpt")
    msg = error_of(text)
    assert msg.startswith(f"r.yaml:{line_of(text, 'init_checkpoint')}: run.init_checkpoint: ")
    assert "no/such/ckpt" in msg and "does not exist" in msg


def _fake_checkpoint(directory: Path, model_config) -> None:
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(b"")
    (directory / "config.json").write_text(model_config.model_dump_json())


def test_existing_checkpoint_is_accepted(in_tmp):
    Path("r.yaml").write_text(GOOD)
    _fake_checkpoint(in_tmp / "ckpt", load_recipe("r.yaml").model)
    Path("r.yaml").write_text(edit("  seed: 0", "  seed: 0\n  init_checkpoint: ckpt"))
    assert load_recipe("r.yaml").run.init_checkpoint == Path("ckpt")


def test_checkpoint_of_another_shape_is_refused(in_tmp):
    Path("r.yaml").write_text(GOOD)
    other = load_recipe("r.yaml").model.model_copy(update={"hidden_size": 32})
    _fake_checkpoint(in_tmp / "ckpt", other)
    msg = error_of(edit("  seed: 0", "  seed: 0\n  init_checkpoint: ckpt"))
    assert "run.init_checkpoint 'ckpt' was saved with a different model (differs in: hidden_size)" in msg


def test_bad_union_tag_points_at_type(in_tmp):
    text = edit("type: grpo", "type: bogus")
    assert error_of(text) == (f"r.yaml:{line_of(text, 'bogus')}: stages.1.type: Input tag 'bogus' found using 'type' "
                              "does not match any of the expected tags: 'sft', 'opd', 'grpo'")


def test_missing_union_tag(in_tmp):
    text = edit("  - type: grpo\n    max_steps: 5", "  - max_steps: 5")
    assert error_of(text) == f"r.yaml:{line_of(text, '- max_steps: 5')}: stages.1.type: missing required field (it selects the variant)"


def test_yaml_syntax_error(in_tmp):
    text = "run:\n  name: t\n  a: b: c\n"
    assert error_of(text) == "r.yaml:3:7: YAML syntax error: mapping values are not allowed here"


def test_yaml_syntax_error_unclosed_flow(in_tmp):
    assert error_of("run: {name: t\n").startswith("r.yaml:2:1: YAML syntax error: ")


def test_duplicate_key(in_tmp):
    text = edit("  seed: 0", "  seed: 0\n  seed: 1")
    assert error_of(text) == "r.yaml:4: run.seed: duplicate key"


@pytest.mark.parametrize("text", ["", "- 1\n- 2\n", "just a string\n"])
def test_top_level_not_a_mapping(in_tmp, text):
    assert error_of(text) == "r.yaml: recipe must be a YAML mapping"


def test_file_not_found(in_tmp):
    with pytest.raises(RecipeError) as info:
        load_recipe("configs/nope.yaml")
    assert str(info.value) == "configs/nope.yaml: recipe file not found"


def test_directory_instead_of_file(in_tmp):
    with pytest.raises(RecipeError) as info:
        load_recipe(in_tmp)
    assert str(info.value).startswith(f"{in_tmp}: cannot read recipe file") and "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# Overrides


def test_override_values_are_typed():
    data = apply_overrides({}, ["a.f=1e-4", "a.g=3.5", "a.i=7", "a.b=true", "a.l=[1, 2]", "a.d={x: 1}",
                                "a.s=hello", "a.q='1e-4'", "a.n="])
    assert data == {"a": {"f": 1e-4, "g": 3.5, "i": 7, "b": True, "l": [1, 2], "d": {"x": 1}, "s": "hello",
                          "q": "1e-4", "n": None}}
    assert isinstance(data["a"]["f"], float)


def test_override_list_index_later_wins_and_copies():
    data = {"stages": [{"type": "sft"}, {"type": "grpo", "optim": {"lr": 1.0}}]}
    out = apply_overrides(data, ["stages.1.optim.lr=3e-4", "stages.0.batch_size=4", "stages.1.optim.lr=5e-5"])
    assert out["stages"][1]["optim"]["lr"] == 5e-5
    assert out["stages"][0] == {"type": "sft", "batch_size": 4}
    assert data == {"stages": [{"type": "sft"}, {"type": "grpo", "optim": {"lr": 1.0}}]}  # input untouched


def test_override_creates_missing_sections():
    assert apply_overrides({"run": {"name": "x"}}, ["eval.max_problems=8", "run.seed=3"]) == {
        "run": {"name": "x", "seed": 3}, "eval": {"max_problems": 8}}


def test_overrides_reach_the_recipe(in_tmp):
    Path("r.yaml").write_text(GOOD)
    recipe = load_recipe("r.yaml", ["stages.1.optim.lr=3e-4", "run.seed=7", "model.ffn={type: dense}",
                                    "stages.1.optim.lr=2e-5"])
    assert recipe.stages[1].optim.lr == 2e-5 and recipe.run.seed == 7 and not recipe.model.is_moe


@pytest.mark.parametrize("override, expected", [
    ("trainer", "--set trainer: override must look like a.b.c=value"),
    ("=1", "--set =1: empty key in override path ''"),
    ("a..b=1", "--set a..b=1: empty key in override path 'a..b'"),
    ("stages.5.optim.lr=1", "--set stages.5.optim.lr=1: index 5 out of range (stages has 2 items)"),
    ("stages.x=1", "--set stages.x=1: stages is a list; index it with a number, not 'x'"),
    ("run.name.x=1", "--set run.name.x=1: run.name is not a mapping (got 't')"),
])
def test_bad_override(in_tmp, override, expected):
    assert error_of(GOOD, [override]) == expected


def test_bad_override_value_yaml(in_tmp):
    assert error_of(GOOD, ["run.name=[1,"]).startswith("--set run.name=[1,: value is not valid YAML: ")


def test_override_with_unknown_key(in_tmp):
    assert error_of(GOOD, ["trainer.lr=1"]) == "r.yaml: --set trainer.lr=1: trainer: unknown key (not a field of Recipe)"
    assert error_of(GOOD, ["run.nam=x"]) == (
        "r.yaml: --set run.nam=x: run.nam: unknown key (not a field of RunConfig; did you mean 'name'?)")


def test_override_with_bad_value_names_the_override(in_tmp):
    assert error_of(GOOD, ["stages.1.optim.lr=3e-4", "stages.1.optim.lr=-1"]) == (
        "r.yaml: --set stages.1.optim.lr=-1: stages.1.optim.lr: Input should be greater than 0 (got -1)")


def test_file_error_is_not_blamed_on_an_unrelated_override(in_tmp):
    text = edit("  seed: 0", "  sede: 0")
    assert error_of(text, ["run.seed=1"]).startswith("r.yaml:3: run.sede: unknown key")


# ---------------------------------------------------------------------------------------------------------------
# Round trip and documentation


def test_round_trip(in_tmp):
    Path("r.yaml").write_text(GOOD)
    recipe = load_recipe("r.yaml", ["stages.1.optim.lr=3e-5", "run.name=rt"])
    dumped = recipe_to_yaml(recipe)
    assert isinstance(yaml.safe_load(dumped), dict)
    Path("resolved.yaml").write_text(dumped)
    assert load_recipe("resolved.yaml") == recipe
    assert recipe_to_yaml(load_recipe("resolved.yaml")) == dumped


def _models_in(tp) -> list[type[BaseModel]]:
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    if get_origin(tp) in (Union, types.UnionType, list, tuple, dict, set, frozenset):
        return [m for arg in get_args(tp) for m in _models_in(arg)]
    return []


def _reachable_models() -> list[type[BaseModel]]:
    seen: list[type[BaseModel]] = []
    todo = [Recipe]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.append(model)
        for field in model.model_fields.values():
            todo.extend(_models_in(field.annotation))
    return seen


def test_every_config_field_is_documented():
    models = _reachable_models()
    names = {m.__name__ for m in models}
    assert {"Recipe", "RunConfig", "ModelConfig", "DenseFFNConfig", "MoEFFNConfig", "ArithmeticConfig",
            "EngineConfig", "SamplingConfig", "SFTStage", "GRPOStage", "OptimConfig"} <= names
    undocumented = [f"{m.__name__}.{name}" for m in models for name, field in m.model_fields.items()
                    if not (field.description or "").strip()]
    assert not undocumented, f"fields without a docstring: {undocumented}"


def test_config_modules_do_not_import_torch():
    code = "import rl.config, rl.recipe_io, sys; assert 'torch' not in sys.modules, 'torch imported'"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------------------------------------------------
# Through the real console entry point (needs rl/cli/commands.py)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())", *argv],
                          cwd=cwd, env=_env(), capture_output=True, text=True, timeout=120)


@pytest.mark.integration
def test_cli_validate_good_recipe(tmp_path):
    (tmp_path / "r.yaml").write_text(GOOD)
    proc = run_cli("validate", "r.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok: r.yaml (2 stages")


@pytest.mark.integration
@pytest.mark.parametrize("text, extra, expected", [
    (GOOD + "trainer:\n  lr: 1\n", [], f"r.yaml:{GOOD.count(chr(10)) + 1}: trainer: unknown key"),
    (edit("    batch_size: 8", "    batch_size: -4"), [],
     f"r.yaml:{line_of(GOOD, 'batch_size')}: stages.0.batch_size: Input should be greater than 0"),
    (edit("type: grpo", "type: bogus"), [], f"r.yaml:{line_of(GOOD, 'type: grpo')}: stages.1.type: Input tag 'bogus'"),
    ("run:\n  name: t\n  a: b: c\n", [], "r.yaml:3:7: YAML syntax error"),
    (GOOD, ["--set", "trainer.lr=1"], "r.yaml: --set trainer.lr=1: trainer: unknown key"),
    (GOOD, ["--set", "stages.1.optim.lr"], "--set stages.1.optim.lr: override must look like a.b.c=value"),
    (None, [], "r.yaml: recipe file not found"),
], ids=["unknown-key", "out-of-range", "bad-tag", "yaml-syntax", "set-unknown-key", "set-malformed", "not-found"])
def test_cli_validate_bad_recipe_is_one_line(tmp_path, text, extra, expected):
    if text is not None:
        (tmp_path / "r.yaml").write_text(text)
    proc = run_cli("validate", "r.yaml", *extra, cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and proc.stderr.endswith("\n"), proc.stderr
    assert expected in lines[0]


def test_chunked_prefill_of_a_csa2_model_is_refused(in_tmp):
    text = edit("  head_dim: 32\n", "  head_dim: 32\n  sparse_attention: {compress_ratio: 4, topk: 8, window: 8}\n")
    assert load_recipe_text_ok(text)  # the sparse model alone is a valid recipe
    msg = error_of(text, ["engine.prefill_chunk_tokens=64"])
    assert "engine.prefill_chunk_tokens" in msg and "CSA2" in msg, msg


def load_recipe_text_ok(text: str) -> bool:
    Path("r.yaml").write_text(text)
    return load_recipe("r.yaml").model.is_sparse


@pytest.mark.parametrize("overrides, expected", [
    (["stages.0.datasets=[nope]"], "stages.0.datasets names unknown datasets ['nope']; datasets are ['arith']"),
    (["eval.datasets=[arith, other]"], "eval.datasets names unknown datasets ['other']; datasets are ['arith']"),
    (["stages.1.datasets=[]"], "stages.1.datasets"),
])
def test_stage_and_eval_datasets_must_name_recipe_datasets(in_tmp, overrides, expected):
    assert expected in error_of(GOOD, overrides)


def test_a_stage_uses_its_own_datasets_and_its_dispatch_may_name_only_those(in_tmp):
    two = edit("    max_digits: 3\n", "    max_digits: 3\n  - type: arithmetic\n    name: big\n    max_digits: 5\n")
    Path("r.yaml").write_text(two)
    recipe = load_recipe("r.yaml", ["stages.1.datasets=[big]", "eval.datasets=[arith]"])
    assert [recipe.stage_datasets(s) for s in recipe.stages] == [["arith", "big"], ["big"]]
    assert recipe.eval_datasets() == ["arith"]
    assert load_recipe("r.yaml").eval_datasets() == ["arith", "big"]
    msg = error_of(two, ["stages.1.datasets=[big]", "stages.1.dispatch.mixture={arith: 1.0}"])
    assert "stages.1.dispatch names unknown datasets ['arith']; the stage's datasets are ['big']" in msg


def test_the_effort_cold_start_refuses_a_file_dataset_without_a_direct_demonstration():
    data, _ = load_recipe_dict(Path(__file__).resolve().parents[2] / "configs/pipeline/word_problems_effort.yaml")
    recipe = Recipe.model_validate(data)
    assert recipe.stages[0].effort_cold_start and recipe.datasets[0].direct_demonstration
    del data["datasets"][0]["direct_demonstration"]
    with pytest.raises(ValueError, match=r"stages\.0\.effort_cold_start: file datasets \['wp'\] name no direct_demonstration"):
        Recipe.model_validate(data)
    data["stages"][0]["effort_cold_start"] = False
    Recipe.model_validate(data)
