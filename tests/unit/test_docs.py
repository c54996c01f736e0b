"""The documentation: the generated recipe reference (docs/reference/recipe.md, tools/recipe_reference.py) is current
and covers every field, every config field has a docstring, and README.md and docs/ stay short, keep the exit-code
table and point only at files, modules and commands that exist. Seconds: no torch, no subprocess."""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path
from typing import Annotated, Literal, Optional, Union, get_args

from pydantic import Field

from configbase import StrictConfig
from rl.config import Recipe, Stage
from rl.reconfigure import ReconfigPatch

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").rglob("*.md"))
TOP = ("configbase", "model", "rollout", "rewards", "teachers", "sandbox_client", "rl", "configs", "bench", "tools",
       "tests", "docs")
"""Top-level folders of the repository: a path written in the docs that starts with one of them must exist."""


def _generator():
    spec = importlib.util.spec_from_file_location("recipe_reference", ROOT / "tools" / "recipe_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


REF = _generator()


def test_the_committed_reference_is_current():
    committed = (ROOT / "docs" / "reference" / "recipe.md").read_text(encoding="utf-8")
    assert committed == REF.render(), "docs/reference/recipe.md is stale: run `python tools/recipe_reference.py`"
    assert REF.render() == REF.render()  # deterministic within a run; across machines the committed file decides
    assert REF.main(["--check"]) == 0


def test_every_config_field_has_a_docstring():
    missing = REF.undocumented(Recipe, ReconfigPatch)
    assert not missing, "fields without a docstring (add one under the field):\n" + "\n".join(missing)


def test_the_reference_lists_every_top_level_field_and_every_stage_type():
    text = (ROOT / "docs" / "reference" / "recipe.md").read_text(encoding="utf-8")
    absent = [name for name in Recipe.model_fields if f"#### `{name}`\n" not in text]
    assert not absent, f"Recipe fields missing from the reference: {absent}"
    union, _ = get_args(Stage)
    types = [get_args(member.model_fields["type"].annotation)[0] for member in get_args(union)]
    assert sorted(types) == ["grpo", "opd", "sft"]
    for t in types:
        assert f"### `stages[]`, `type: {t}`" in text, f"stage type {t!r} missing from the reference"
        member = next(m for m in get_args(union) if m.model_fields["type"].annotation == Literal[t])
        absent = [f for f in member.model_fields if f"#### `stages[].{f}`\n" not in text]
        assert not absent, f"fields of the {t} stage missing from the reference: {absent}"
    for name in ReconfigPatch.model_fields:
        assert f"#### `{name}`\n" in text.split("## Live patch")[1], f"ReconfigPatch.{name} missing from the reference"


class _Leaf(StrictConfig):
    documented: int = 0
    """Has one."""
    bare: int = 0


class _Other(StrictConfig):
    type: Literal["other"] = "other"
    """Discriminator."""
    limit: float = Field(1.0, gt=0)


class _Kind(StrictConfig):
    type: Literal["kind"] = "kind"
    """Discriminator."""
    leaves: list[_Leaf] = Field(default_factory=list)
    """Leaves."""


class _Root(StrictConfig):
    """A throwaway root: its undocumented fields sit in a list, an Optional and a union member."""

    items: list[Annotated[Union[_Kind, _Other], Field(discriminator="type")]] = Field(default_factory=list)
    """Items."""
    maybe: Optional[_Leaf] = None
    """Maybe."""
    untold: str = ""


def test_the_walker_finds_fields_without_a_docstring():
    assert sorted(REF.undocumented(_Root)) == ["_Leaf.bare", "_Other.limit", "_Root.untold"]
    paths = [(s.path, s.member) for s in REF.sections(_Root)]  # a list's items, each union member, an Optional
    assert paths == [("", None), ("items[]", "kind"), ("items[].leaves[]", None), ("items[]", "other"), ("maybe", None)]


def test_the_readme_is_short_and_keeps_the_exit_codes():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 260, f"README.md has {len(lines)} lines (at most 260): move material to docs/"
    table = _exit_table(README)
    assert [row.split("|")[1].strip() for row in table] == ["0", "1", "2", "3", "4"], "README.md: the exit-code table"
    assert table == _exit_table(ROOT / "docs" / "resume.md"), "the exit-code tables of README.md and docs/resume.md differ"


def _exit_table(path: Path) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    start = lines.index("| code | meaning | what a scheduler does |")
    return [line for line in lines[start + 2:] if line.startswith("|")][:5]


def test_the_readme_lists_every_rl_command():
    from rl.cli.commands import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    listed = set(re.findall(r"^\| `rl (\w+)", README.read_text(encoding="utf-8"), re.M))
    assert listed == set(sub.choices), f"README's command table: {sorted(listed)} against `rl --help`: {sorted(sub.choices)}"


def _prose(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def test_relative_links_point_at_files_that_exist():
    broken = []
    for path in [README, *DOCS]:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(path)):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (path.parent / target.split("#")[0]).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def _expand(path: str) -> list[str]:
    """`a_{x,y}.jsonl` -> [a_x.jsonl, a_y.jsonl]."""
    m = re.search(r"\{([^{}]*)\}", path)
    return [p for alt in m.group(1).split(",") for p in _expand(path[:m.start()] + alt + path[m.end():])] if m else [path]


def test_repository_paths_and_modules_written_in_the_docs_exist():
    """Files (`rl/algo/async_grpo.py`, `configs/data/word_problems_*.jsonl`) and folders (`rl/store/migrations/`) of
    the repository, and `python -m` modules of ours; metric names such as `rollout/tool_failures/<reason>` are not
    paths."""
    missing = []
    pattern = re.compile(rf"(?<![\w./$-])((?:{'|'.join(TOP)})/[\w./*{{}},-]*)(<?)")
    for path in [README, *DOCS]:
        text = re.sub(r"https?://\S+", "", _prose(path))
        text = re.sub(r"\\([_*\[\]`\\])", r"\1", text)  # the reference's Markdown escapes
        for found, angle in pattern.findall(text):
            found = found.rstrip(".,")
            if found.count("}") > found.count("{"):
                found = found.rstrip("}")
            if angle or not (found.endswith("/") or re.search(r"\.(py|ya?ml|jsonl?|md|toml|txt)$", found)):
                continue  # a metric name (rl/entropy), not a path
            for one in _expand(found):
                if not (list(ROOT.glob(one)) if "*" in one else (ROOT / one).exists()):
                    missing.append(f"{path.relative_to(ROOT)}: {one}")
        for module in re.findall(r"python -m ([\w.]+)", text):
            if module.split(".")[0] not in TOP:  # pytest, pip, ...
                continue
            base = ROOT.joinpath(*module.split("."))
            if not (base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()):
                missing.append(f"{path.relative_to(ROOT)}: python -m {module}")
    assert not missing, "paths or modules the docs name that do not exist:\n" + "\n".join(missing)
