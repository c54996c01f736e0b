"""The import structure of the architecture (README, docs/architecture.md), checked on the source: which package
may import which, which part of `rl` may import which (arrows declared below, one way), and no import cycle
anywhere: between packages, between rl's parts, or between modules. Every import counts: at module level,
inside a function, or under `if TYPE_CHECKING:` (a type-only import is still a dependency; a cycle means a record
or protocol belongs lower down). Modules of ours are imported by name (importlib) only by the plugin loaders."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALLOWED = {
    "configbase": set(),
    "model": {"configbase"},
    "rollout": {"configbase", "model"},
    "teachers": {"configbase", "model"},
    "rewards": {"configbase"},
    "sandbox_client": {"configbase"},
    "rl": {"configbase", "model", "rollout", "teachers", "rewards", "sandbox_client"},
}
"""package -> the packages of ours it may import (besides itself)."""

RL_ARROWS = {
    "rl.types": set(),
    "rl.faults": set(),
    "rl.dispatch": set(),
    "rl.store": {"rl.types"},
    "rl.checkpoint": {"rl.faults", "rl.store"},
    "rl.config": {"rl.dispatch", "rl.checkpoint"},
    "rl.reconfigure": {"rl.checkpoint"},
    "rl.recipe_io": {"rl.config"},
    "rl.metrics": {"rl.config"},
    "rl.train": {"rl.types", "rl.config", "rl.checkpoint"},
    "rl.runtime": {"rl.config", "rl.faults", "rl.checkpoint", "rl.train"},
    "rl.algo": {"rl.types", "rl.faults", "rl.dispatch", "rl.store", "rl.checkpoint", "rl.config", "rl.reconfigure",
                "rl.recipe_io", "rl.metrics", "rl.train", "rl.runtime"},
    "rl.ui": {"rl.store", "rl.checkpoint", "rl.config"},
    "rl.cli": {"rl.types", "rl.store", "rl.checkpoint", "rl.config", "rl.reconfigure", "rl.recipe_io", "rl.runtime",
               "rl.algo", "rl.ui"},
}
"""rl's parts (a top-level module, or a sub-package with everything under it) -> the parts it may import. Read
bottom-up: records, fail points and dispatch import nothing; the store sits on the records; checkpoints on the
store; the recipe on dispatch and checkpoints (a teacher may be `RUN_DIR:STEP`); one optimizer step (train) on
the recipe; the runtime on train; the algorithms on all of it; the dashboard (read-only) on the store, the
checkpoints' run directories and the recipe; the command line on top."""

PLUGIN_LOADERS = {"rewards.config", "rewards.verifiers", "rewards.reward_functions", "rewards.dataset_io"}
"""The modules that import a user's module by name (a custom task, a `python:` verifier, an optional reader)."""

MAX_MODULES = 12
"""Modules (besides __init__) one of rl's sub-packages may hold, and `rl/` itself at most 8."""


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in ALLOWED:
        for path in sorted((ROOT / pkg).rglob("*.py")) if (ROOT / pkg).is_dir() else []:
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, module: str) -> set[str]:
    """Modules of ours (and names in them) that `module` imports anywhere: module level, functions, TYPE_CHECKING."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parts = module.split(".")
                pkg = parts[: len(parts) - node.level + (path.name == "__init__.py")]
                base = ".".join([*pkg, base] if base else pkg)
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: {i for i in _imports(p, m) if i in mods and i != m} for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def _rl_part(module: str) -> str | None:
    """The part of rl a module belongs to (RL_ARROWS' keys); None for `rl` itself (its __init__)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "rl" and len(parts) > 1 else None


def test_packages_import_only_what_the_architecture_allows():
    bad = []
    for mod, deps in _graph().items():
        pkg = mod.split(".")[0]
        bad += [f"{mod} -> {d}" for d in sorted(deps) if d.split(".")[0] not in ALLOWED[pkg] | {pkg}]
    assert not bad, "imports against the architecture:\n" + "\n".join(bad)


def test_no_import_cycle_between_modules_or_packages():
    graph = _graph()
    assert not _cycles(graph), f"module import cycles: {_cycles(graph)}"
    packages: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        packages.setdefault(mod.split(".")[0], set()).update(d.split(".")[0] for d in deps if d.split(".")[0] != mod.split(".")[0])
    assert not _cycles(packages), f"package import cycles: {_cycles(packages)}"


def test_rl_parts_import_along_the_declared_arrows_only():
    assert not _cycles(RL_ARROWS), f"the declared arrows have a cycle: {_cycles(RL_ARROWS)}"
    found: dict[str, set[str]] = {}
    for mod, deps in _graph().items():
        part = _rl_part(mod)
        if part is None:
            continue
        assert part in RL_ARROWS, f"{mod}: {part} is not a declared part of rl (RL_ARROWS)"
        for d in deps:
            if _rl_part(d) not in (None, part):
                found.setdefault(part, set()).add(_rl_part(d))
    undeclared = sorted(f"{p} -> {d}" for p, ds in found.items() for d in ds if d not in RL_ARROWS[p])
    assert not undeclared, "imports between rl's parts that RL_ARROWS does not declare:\n" + "\n".join(undeclared)
    unused = sorted(f"{p} -> {d}" for p, ds in RL_ARROWS.items() for d in ds if d not in found.get(p, set()))
    assert not unused, "declared arrows no import uses (drop them from RL_ARROWS):\n" + "\n".join(unused)
    assert not _cycles(found)


def test_rl_is_a_few_modules_and_small_sub_packages():
    top = [p.name for p in (ROOT / "rl").glob("*.py")]
    assert len(top) <= 8, f"rl/ holds {len(top)} modules; a concern with several files gets a sub-package: {sorted(top)}"
    for sub in sorted(p for p in (ROOT / "rl").iterdir() if (p / "__init__.py").is_file()):
        mods = [p.name for p in sub.glob("*.py") if p.name != "__init__.py"]
        assert len(mods) <= MAX_MODULES, f"rl/{sub.name}/ holds {len(mods)} modules (at most {MAX_MODULES}): split it"
        assert ast.get_docstring(ast.parse((sub / "__init__.py").read_text())), f"rl/{sub.name}/__init__.py: say what it offers"


def test_no_private_name_is_imported_from_another_module():
    mods = _modules()
    bad = []
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "") in mods:
                bad += [f"{mod}: from {node.module} import {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def _by_name_imports(path: Path) -> list[int]:
    """Lines that import a module by name at run time (importlib.import_module, __import__)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("import_module", "__import__"):
                lines.append(node.lineno)
    return lines


def test_modules_are_imported_by_name_only_in_the_plugin_loaders():
    bad = [f"{mod}:{line}" for mod, path in _modules().items() if mod not in PLUGIN_LOADERS
           for line in _by_name_imports(path)]
    assert not bad, "imports by name outside the plugin loaders (an import the checks above cannot see):\n" + "\n".join(bad)


def test_the_checks_see_cycles_type_only_and_function_local_imports(tmp_path):
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import rl.x\n"
                 "def g():\n    from rewards.task import Task\n    import model.decoder\n"
                 "    import importlib\n    return importlib.import_module('rl.algo')\n")
    assert {"rewards.task", "rewards.task.Task", "model.decoder", "rl.x"} <= _imports(f, "rl.m")
    assert _by_name_imports(f) == [8]
    init = tmp_path / "__init__.py"
    init.write_text("from .main import main\nfrom . import db\n")
    assert {"rl.cli.main", "rl.cli.main.main", "rl.cli.db"} <= _imports(init, "rl.cli")
    assert _rl_part("rl.algo.job") == "rl.algo" and _rl_part("rl.config") == "rl.config" and _rl_part("rl") is None
