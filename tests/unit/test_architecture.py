"""The import structure of README's "Architecture" section, checked on the source: which package may
import which (arrows point one way), and no import cycle between packages or between the modules of one.
Imports inside functions count (a function-local import is still a dependency); imports under
`if TYPE_CHECKING:` do not (they never run)."""

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


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in ALLOWED:
        for path in sorted((ROOT / pkg).rglob("*.py")) if (ROOT / pkg).is_dir() else []:
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(path: Path, module: str) -> set[str]:
    """Modules of ours that `module` imports anywhere but under `if TYPE_CHECKING:`."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = module.split(".")[: -node.level] if not path.name == "__init__.py" else module.split(".")[: len(module.split(".")) - node.level + 1]
                base = ".".join([*pkg, base] if base else pkg)
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: {i for i in _imports(p, m) if i in mods and i != m} for m, p in mods.items()}


def test_packages_import_only_what_the_architecture_allows():
    bad = []
    for mod, deps in _graph().items():
        pkg = mod.split(".")[0]
        bad += [f"{mod} -> {d}" for d in sorted(deps) if d.split(".")[0] not in ALLOWED[pkg] | {pkg}]
    assert not bad, "imports against the architecture (README, Architecture):\n" + "\n".join(bad)


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


def test_no_import_cycle_between_modules_or_packages():
    graph = _graph()
    assert not _cycles(graph), f"module import cycles: {_cycles(graph)}"
    packages: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        packages.setdefault(mod.split(".")[0], set()).update(d.split(".")[0] for d in deps if d.split(".")[0] != mod.split(".")[0])
    assert not _cycles(packages), f"package import cycles: {_cycles(packages)}"


def test_the_check_sees_cycles_and_function_local_imports(tmp_path):
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import rl.x\n"
                 "def g():\n    from rewards.task import Task\n    import model.decoder\n")
    assert {"rewards.task", "rewards.task.Task", "model.decoder"} <= _imports(f, "rl.m") and "rl.x" not in _imports(f, "rl.m")
