"""Every shipped recipe in configs/ loads and validates."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rl.recipe_io import load_recipe, recipe_to_yaml

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("**/*.yaml"))


def test_configs_exist():
    assert CONFIGS, "no recipes found in configs/"


def _with_stub_teachers(path: Path, tmp_path: Path) -> Path:
    """configs/opd.yaml names teacher checkpoints that a command builds (runs/opd-teachers, see its
    header); without them, validate it against stub checkpoints (config.json of each architecture)."""
    text = path.read_text()
    if "runs/smollm2-grpo" in text and not (path.parents[1] / "runs" / "smollm2-grpo").is_dir():
        # configs/smollm2_opd.yaml: its teacher is the run of configs/smollm2_grpo.yaml; stand in the start model
        data = yaml.safe_load(text)
        for stage in data["stages"]:
            for t in stage.get("teachers", {}).get("teachers", []):
                t["checkpoint"] = "smollm2-135m-instruct"
        out = tmp_path / path.name
        out.write_text(yaml.safe_dump(data))
        return out
    if "runs/opd-teachers" not in text or (path.parents[1] / "runs" / "opd-teachers").is_dir():
        return path
    from teachers.architectures import ARCHITECTURES

    data = yaml.safe_load(text)
    for stage in data["stages"]:
        for t in stage.get("teachers", {}).get("teachers", []):
            arch = next((a for a in ARCHITECTURES if f"-{a}" in t["name"]), "mqa")
            d = tmp_path / "teachers" / t["name"]
            d.mkdir(parents=True)
            (d / "config.json").write_text(ARCHITECTURES[arch].model_dump_json())
            t["checkpoint"] = str(d)
    out = tmp_path / path.name
    out.write_text(yaml.safe_dump(data))
    return out


def _with_listening_socket(path: Path, tmp_path: Path) -> Path:
    """A recipe naming a sandbox server's socket (configs/tool_arith.yaml) is validated against a socket file
    the test binds (validation checks that a socket is there; nothing connects)."""
    data = yaml.safe_load(path.read_text())
    if not (data.get("sandbox") or {}).get("socket"):
        return path
    import socket

    sock = tmp_path / "sandbox.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock))  # the socket file outlives the object
    data["sandbox"]["socket"] = str(sock)
    out = tmp_path / f"sock-{path.name}"
    out.write_text(yaml.safe_dump(data))
    return out


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_loads(path, tmp_path):
    recipe = load_recipe(_with_stub_teachers(_with_listening_socket(path, tmp_path), tmp_path))
    assert recipe.stages and recipe.datasets
    # What a run saves as its resolved recipe loads back to the same thing.
    (tmp_path / "resolved.yaml").write_text(recipe_to_yaml(recipe))
    assert load_recipe(tmp_path / "resolved.yaml") == recipe
