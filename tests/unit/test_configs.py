"""Every shipped recipe in configs/ loads and validates."""

from __future__ import annotations

from pathlib import Path

import pytest

from rl.recipe_io import load_recipe, recipe_to_yaml

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_configs_exist():
    assert CONFIGS, "no recipes found in configs/"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_loads(path, tmp_path):
    recipe = load_recipe(path)
    assert recipe.stages and recipe.datasets
    # What a run saves as its resolved recipe loads back to the same thing.
    (tmp_path / "resolved.yaml").write_text(recipe_to_yaml(recipe))
    assert load_recipe(tmp_path / "resolved.yaml") == recipe
