"""No float a user gives may be NaN or infinite (issue 40, class 3): `--set stages.0.optim.lr=inf` validated and
trained NaN from step 4 into all-NaN checkpoints; `rl reconfigure RUN --set mixture.add=nan` answered "applied" and
killed the job. Every float of every config (`configbase.StrictConfig`, `allow_inf_nan=False`) and of every command
line (`configbase.finite_float`) refuses them.

The first test walks the config models reachable from the recipe and the live patch programmatically, so a float
field added later is covered without touching this file: each float position (a plain field, a union member, a
dict's values, a list's or tuple's items) gets NaN, inf and 1e999 (YAML's overflow to inf) in turn."""

import math
import subprocess
import sys
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import pytest
from pydantic import BaseModel, ValidationError

from configbase import StrictConfig
from rl.config import Recipe
from rl.reconfigure import ReconfigError, ReconfigPatch, parse_patch
from rl.recipe_io import RecipeError, load_recipe

CLI = [sys.executable, "-c", "from rl.cli import main; raise SystemExit(main())"]
NON_FINITE = [math.nan, math.inf, -math.inf, float("1e999")]
TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_grpo.yaml"


def _strip(tp: Any) -> Any:
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    return tp


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def bad_values(tp: Any, x: float) -> list[Any]:
    """Values of type `tp` with `x` at one float position each (none: `tp` holds no float outside a model)."""
    tp = _strip(tp)
    origin, args = get_origin(tp), [_strip(a) for a in get_args(tp)]
    if tp is float:
        return [x]
    if origin in (Union, types.UnionType):
        return [v for a in args for v in bad_values(a, x)]
    if origin in (list, set, frozenset) or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        return [[v] for v in bad_values(args[0], x)]
    if origin is tuple:
        return [[v if j == i else 0.5 for j in range(len(args))] for i, a in enumerate(args) for v in bad_values(a, x)]
    if origin is dict:
        return [{"k": v} for v in bad_values(args[1], x)]
    return []


def models_in(tp: Any) -> list[type[BaseModel]]:
    tp = _strip(tp)
    if _is_model(tp):
        return [tp]
    if get_origin(tp) is Literal:
        return []
    return [m for a in get_args(tp) for m in models_in(a)]


def reachable(*roots: type[BaseModel]) -> list[type[BaseModel]]:
    seen, todo = [], list(roots)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.append(m)
            todo += [n for info in m.model_fields.values() for n in models_in(info.annotation)]
    return seen


def float_fields() -> list[tuple[type[BaseModel], str]]:
    return [(m, name) for m in reachable(Recipe, ReconfigPatch) for name, info in m.model_fields.items()
            if bad_values(info.annotation, math.nan)]


def test_the_walk_finds_the_floats_it_must():
    """The walk reaches union members, dict values, tuples and optional floats deep in the recipe (a walk that found
    nothing would pass the test below vacuously)."""
    found = {f"{m.__name__}.{name}" for m, name in float_fields()}
    assert {"OptimConfig.lr", "OptimConfig.betas", "DispatchConfig.mixture", "ReconfigPatch.mixture",
            "SFTStage.max_minutes", "ModelConfig.rope_theta", "SamplingConfig.temperature"} <= found, sorted(found)
    assert len(found) >= 50


def test_every_model_reachable_from_the_recipe_is_a_strict_config():
    """allow_inf_nan lives on StrictConfig: a plain pydantic model in the recipe would accept NaN again."""
    assert [m for m in reachable(Recipe, ReconfigPatch) if not issubclass(m, StrictConfig)] == []


@pytest.mark.parametrize("x", NON_FINITE, ids=["nan", "inf", "-inf", "1e999"])
def test_every_float_of_every_config_refuses_non_finite_numbers(x):
    missed = []
    for model, name in float_fields():
        info = model.model_fields[name]
        key = info.alias or name
        for value in bad_values(info.annotation, x):
            try:
                model.model_validate({key: value})
            except ValidationError as e:
                if any(err["type"] == "finite_number" and err["loc"][:1] == (key,) for err in e.errors()):
                    continue
            missed.append(f"{model.__name__}.{name}={value!r}")
    assert missed == []


@pytest.mark.parametrize("text", ["nan", ".nan", "inf", "-.inf", "1e999"])
def test_a_non_finite_set_is_refused_by_the_recipe_loader_naming_the_field(text):
    with pytest.raises(RecipeError, match=r"stages\.0\.optim\.lr.*finite"):
        load_recipe(TINY, [f"stages.0.optim.lr={text}"])


@pytest.mark.parametrize("override", ["stages.0.optim.lr=inf", "stages.0.optim.betas=[.nan, 0.99]",
                                      "engine.sampling.temperature=1e999", "stages.0.dispatch.mixture={add: .nan}"])
def test_rl_validate_refuses_a_non_finite_set_in_one_line_exit_2(override):
    proc = subprocess.run([*CLI, "validate", str(TINY), "--set", override], capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-2000:])
    assert lines[0].startswith("rl validate: recipe error: ") and "finite" in lines[0], lines[0]
    assert override.partition("=")[0].partition("={")[0] in lines[0], lines[0]


@pytest.mark.parametrize("patch", ["mixture: {add: .nan}", "mixture: {add: .inf}", "mixture: {add: 1e999}"])
def test_a_patch_with_a_non_finite_weight_is_refused(patch):
    with pytest.raises(ReconfigError, match=r"mixture\.add: .*finite"):
        parse_patch(patch)
    with pytest.raises(ReconfigError, match=r"mixture\.add: .*finite"):
        parse_patch("", source="--set", overrides=[f"mixture.add={patch.split(': ')[-1].strip('}')}"])


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "recipe.yaml").write_bytes(TINY.read_bytes())
    return run


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("args, needle", [
    (["--set", "mixture.add=nan"], "rl reconfigure: bad patch: --set: mixture.add: Input should be a finite number"),
    (["--set", "mixture.add=1e999"], "rl reconfigure: bad patch: --set: mixture.add: Input should be a finite number"),
    (["--set", "mixture.add=1", "--wait", "nan"], "rl reconfigure: argument --wait: not a finite number: 'nan'"),
    (["--set", "mixture.add=1", "--wait", "inf"], "rl reconfigure: argument --wait: not a finite number: 'inf'"),
])
def test_rl_reconfigure_refuses_non_finite_numbers_before_anything_is_written(tmp_path, args, needle):
    """The CLI refuses the patch itself (it used to answer "applied" and the job died on random.choices): one line,
    exit 2, the run directory byte for byte as it was (no control/ inbox, no patch queued)."""
    run = _run_dir(tmp_path)
    before = _tree(tmp_path)
    proc = subprocess.run([*CLI, "reconfigure", str(run), *args], capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], (proc.returncode, proc.stderr[-2000:])
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("args, needle", [
    (["traj", "ls", "RUN", "--min-reward", "nan"], "rl traj ls: argument --min-reward: not a finite number: 'nan'"),
    (["traj", "ls", "RUN", "--max-reward", "inf"], "rl traj ls: argument --max-reward: not a finite number: 'inf'"),
])
def test_float_arguments_of_the_cli_refuse_non_finite_numbers(tmp_path, args, needle):
    args = [str(tmp_path) if a == "RUN" else a for a in args]
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], (proc.returncode, proc.stderr[-2000:])


def test_no_command_line_float_of_rl_is_a_plain_float():
    """Every float argument of the `rl` CLI (and its helper scripts) is `finite_float`: argparse's `type=float` takes
    'nan' and 'inf'. Source-level, so a new option is covered."""
    root = Path(__file__).resolve().parents[2] / "rl"
    plain = [f"{p.relative_to(root.parent)}:{i}" for p in sorted(root.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if "type=float" in line.replace(" ", "")]
    assert plain == []
