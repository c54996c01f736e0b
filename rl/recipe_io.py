"""Recipe files in and out: YAML -> `--set` overrides -> `Recipe`, with every failure as one line.

`load_recipe` raises only `RecipeError`, whose text is a single compiler-style line naming the file,
the line (or the `--set` override) and the dotted field path, e.g.

    configs/x.yaml:12: stages.1.optim.lr: Input should be greater than 0 (got -0.001)

so `rl validate` and `rl train` can print it and exit without a traceback. Like the config modules,
this one imports neither torch nor ray.
"""

from __future__ import annotations

import copy
import difflib
import re
import types
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from rl.config import Recipe

KeyPath = tuple  # str keys and int list indices, e.g. ("stages", 1, "optim", "lr")


class RecipeError(Exception):
    """A recipe that cannot be loaded; `str(err)` is one line: `<where>: <field path>: <what>`."""

    def __init__(self, where: str, message: str, field: str = "") -> None:
        self.where = where
        """File, `file:line`, `file:line:col` or `--set a.b=c`: where the bad input came from."""
        self.field = field
        """Dotted field path (`stages.1.optim.lr`), empty when the error is not about one field."""
        self.message = _one_line(message)
        """What is wrong."""
        super().__init__(": ".join(part for part in (where, field, self.message) if part))


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


# ---------------------------------------------------------------------------------------------------------------
# YAML in


class _RecipeLoader(yaml.SafeLoader):
    """SafeLoader that also reads exponent floats without a dot (`1e-4`), as YAML 1.2 does.

    PyYAML follows YAML 1.1, where `lr: 1e-4` is the *string* "1e-4"; pydantic would coerce it, but a
    `--set` value or a dumped recipe should not depend on that.
    """


_RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml_error(where: str, err: yaml.YAMLError) -> RecipeError:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    if mark is not None:
        where = f"{where}:{mark.line + 1}:{mark.column + 1}"
    problem = getattr(err, "problem", None) or getattr(err, "context", None) or str(err)
    return RecipeError(where, f"YAML syntax error: {problem}")


def load_recipe_dict(path: str | Path) -> tuple[dict, dict[KeyPath, int]]:
    """Parse a recipe file into a plain dict and a map from key path to 1-based line number.

    Mapping keys map to the line of the key, list items to the line where the item starts. Duplicate
    keys are an error (plain YAML silently keeps the last one, hiding the first).
    """
    where = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(where, "recipe file not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise RecipeError(where, f"cannot read recipe file ({type(err).__name__}: {err})") from None

    if len(text) > MAX_RECIPE_CHARS:
        raise RecipeError(where, f"recipe file has {len(text)} characters; the limit is {MAX_RECIPE_CHARS}")
    loader = _RecipeLoader(text)
    try:
        root = loader.get_single_node()
        if root is not None and (n := _expanded_size(root, {})) > MAX_RECIPE_NODES:
            raise RecipeError(where, f"recipe expands to {n} YAML nodes (aliases of aliases?); the limit is {MAX_RECIPE_NODES}")
        data = loader.construct_document(root) if root is not None else None
        if not isinstance(data, dict):
            raise RecipeError(where, "recipe must be a YAML mapping")
        lines: dict[KeyPath, int] = {}
        _index_lines(loader, root, (), lines, where)
    except yaml.YAMLError as err:
        raise _yaml_error(where, err) from None
    finally:
        loader.dispose()
    return data, lines


MAX_RECIPE_CHARS = 1 << 20
"""A recipe is a page of YAML; a file beyond this is refused before parsing."""
MAX_RECIPE_NODES = 100_000
"""Nodes of the recipe with every alias expanded: nested aliases ("billion laughs") grow exponentially in
what validation walks, so they are counted, in time linear in the file, before anything is built."""


def _expanded_size(node: yaml.Node, memo: dict[int, int]) -> int:
    """Nodes under `node` with aliases expanded (each distinct node counted once per reference)."""
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = 1  # a recursive alias counts once (SafeLoader refuses to construct it anyway)
    children = [c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode) else (
        node.value if isinstance(node, yaml.SequenceNode) else [])
    memo[id(node)] = 1 + sum(_expanded_size(c, memo) for c in children)
    return memo[id(node)]


def _index_lines(loader: yaml.SafeLoader, node: yaml.Node, prefix: KeyPath, lines: dict[KeyPath, int],
                 where: str) -> None:
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[prefix + (i,)] = item.start_mark.line + 1
            _index_lines(loader, item, prefix + (i,), lines, where)
    elif isinstance(node, yaml.MappingNode):
        merged: list[yaml.Node] = []
        seen: set = set()
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                merged.extend(value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node])
                continue
            key = loader.construct_object(key_node, deep=True)
            path = prefix + (key,)
            if key in seen:
                raise RecipeError(f"{where}:{key_node.start_mark.line + 1}", "duplicate key",
                                  ".".join(map(str, path)))
            seen.add(key)
            lines[path] = key_node.start_mark.line + 1
            _index_lines(loader, value_node, path, lines, where)
        # `<<: *anchor` keys count where the anchor defines them, unless overridden here.
        for merged_node in merged:
            sub: dict[KeyPath, int] = {}
            _index_lines(loader, merged_node, prefix, sub, where)
            for path, line in sub.items():
                lines.setdefault(path, line)


# ---------------------------------------------------------------------------------------------------------------
# --set overrides


def _parse_override(override: str) -> tuple[KeyPath, Any]:
    where = f"--set {override}"
    if "=" not in override:
        raise RecipeError(where, "override must look like a.b.c=value")
    key, _, raw = override.partition("=")
    parts = key.strip().split(".")
    if not key.strip() or any(not p for p in parts):
        raise RecipeError(where, f"empty key in override path {key!r}")
    try:
        value = yaml.load(raw, Loader=_RecipeLoader)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err)
        raise RecipeError(where, f"value is not valid YAML: {problem}") from None
    path = tuple(int(p) if re.fullmatch(r"[0-9]+", p) else p for p in parts)
    return path, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides in order (later wins) to a copy of `data`.

    The value is read as a YAML scalar or flow collection (`1e-4` float, `true` bool, `[1, 2]` list,
    `{a: 1}` dict, nothing: null). Numeric path components index into lists (`stages.1.optim.lr=3e-4`);
    missing intermediate mappings are created, so an unknown key reaches validation and is reported there.
    """
    return _apply_overrides(data, overrides)[0]


def _apply_overrides(data: dict, overrides: list[str]) -> tuple[dict, list[tuple[KeyPath, str]]]:
    """`apply_overrides`, also returning each override's key path as pydantic spells it (str keys, int indices)."""
    out = copy.deepcopy(data)
    applied: list[tuple[KeyPath, str]] = []
    for override in overrides:
        where = f"--set {override}"
        path, value = _parse_override(override)
        node: Any = out
        resolved: list = []
        for depth, part in enumerate(path):
            here = ".".join(map(str, resolved)) or "the recipe"
            if isinstance(node, list):
                if not isinstance(part, int):
                    raise RecipeError(where, f"{here} is a list; index it with a number, not {part!r}")
                if part >= len(node):
                    raise RecipeError(where, f"index {part} out of range ({here} has {len(node)} items)")
            else:
                part = str(part)  # recipe mappings have string keys, even `0`
                if depth < len(path) - 1 and not isinstance(node.get(part), (dict, list)):
                    if node.get(part) is not None:
                        raise RecipeError(where, f"{here + '.' if resolved else ''}{part} is not a mapping "
                                                 f"(got {_short_repr(node[part])})")
                    node[part] = {}
            resolved.append(part)
            if depth == len(path) - 1:
                node[part] = value
            else:
                node = node[part]
        applied.append((tuple(resolved), override))
    return out, applied


# ---------------------------------------------------------------------------------------------------------------
# Validation errors -> one line


_SCALARS = (str, int, float, bool, type(None))
_OWN_TEXT = {"missing", "extra_forbidden", "value_error", "assertion_error", "union_tag_invalid",
             "union_tag_not_found"}


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _clean_loc(loc: tuple, data: Any) -> KeyPath:
    """Drop the tags pydantic inserts into `loc` for discriminated unions (`stages.1.grpo.optim` -> `stages.1.optim`)."""
    out: list = []
    node = data
    for el in loc:
        if isinstance(node, dict) and isinstance(el, str) and el not in node and node.get("type") == el:
            continue  # the union tag, not a key
        out.append(el)
        if isinstance(node, dict) and el in node:
            node = node[el]
        elif isinstance(node, list) and isinstance(el, int) and 0 <= el < len(node):
            node = node[el]
        else:
            node = None
    return tuple(out)


def _strip_annotated(tp: Any) -> Any:
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    return tp


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _step_type(tp: Any, el: Any) -> Any:
    """The annotation one raw pydantic `loc` element below `tp` (None when it cannot be told)."""
    tp = _strip_annotated(tp)
    origin = get_origin(tp)
    if _is_model(tp):
        field = tp.model_fields.get(el) if isinstance(el, str) else None
        if field is None and "type" in tp.model_fields and tp.model_fields["type"].default == el:
            return tp  # the tag of a one-member discriminated union, which pydantic collapses to its member
        return field.annotation if field else None
    if origin in (Union, types.UnionType):
        members = [_strip_annotated(m) for m in get_args(tp) if m is not type(None)]
        for m in members:  # a discriminated union: el is the tag of one member
            if _is_model(m) and "type" in m.model_fields and m.model_fields["type"].default == el:
                return m
        steps = [s for s in (_step_type(m, el) for m in members) if s is not None]
        return steps[0] if len(steps) == 1 else None
    if origin in (list, tuple, set, frozenset) and isinstance(el, int):
        args = [a for a in get_args(tp) if a is not Ellipsis]
        return args[min(el, len(args) - 1)] if args else None
    return None


def _owner_at(raw_loc: tuple) -> type[BaseModel] | None:
    """The config model that holds the field at pydantic `loc` + (field,), for naming it in messages."""
    tp: Any = Recipe
    for el in raw_loc:
        tp = _step_type(tp, el)
        if tp is None:
            return None
    tp = _strip_annotated(tp)
    return tp if _is_model(tp) else None


def _message(error: dict, path: KeyPath) -> tuple[KeyPath, str]:
    kind = error["type"]
    if kind == "missing":
        return path, "missing required field"
    if kind == "extra_forbidden":
        owner = _owner_at(tuple(error["loc"])[:-1])
        if owner is None:
            return path, "unknown key (extra inputs are not permitted)"
        hint = difflib.get_close_matches(str(path[-1]), list(owner.model_fields), n=1)
        did_you_mean = f"; did you mean {hint[0]!r}?" if hint else ""
        return path, f"unknown key (not a field of {owner.__name__}{did_you_mean})"
    if kind in ("union_tag_invalid", "union_tag_not_found"):  # blame the `type:` key, so the line points at it
        discriminator = str((error.get("ctx") or {}).get("discriminator", "")).strip("'")
        if discriminator.isidentifier():
            path = path + (discriminator,)
            if kind == "union_tag_not_found" and isinstance(error.get("input"), dict):
                return path, "missing required field (it selects the variant)"
    msg = error["msg"]
    if kind not in _OWN_TEXT and isinstance(error.get("input"), _SCALARS):
        msg += f" (got {_short_repr(error['input'])})"
    return path, msg


def _blamed_override(path: KeyPath, set_paths: list[tuple[KeyPath, str]], lines: dict[KeyPath, int]) -> str | None:
    """The last override that wrote `path` or created the missing section that holds it."""
    for set_path, override in reversed(set_paths):
        if path[: len(set_path)] == set_path:
            return override
        if path and set_path[: len(path)] == path and path not in lines:
            return override
    return None


def _to_recipe_error(err: ValidationError, data: dict, source: str, lines: dict[KeyPath, int],
                     set_paths: list[tuple[KeyPath, str]]) -> RecipeError:
    errors = err.errors(include_url=False)
    first = errors[0]
    path, msg = _message(first, _clean_loc(tuple(first["loc"]), data))
    if len(errors) > 1:
        msg += f" (+{len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    where = source
    override = _blamed_override(path, set_paths, lines)
    if override is not None:
        where = f"{source}: --set {override}"
    else:
        for depth in range(len(path), 0, -1):
            if path[:depth] in lines:
                where = f"{source}:{lines[path[:depth]]}"
                break
    return RecipeError(where, msg, ".".join(map(str, path)))


def load_recipe(path: str | Path, overrides: list[str] = ()) -> Recipe:
    """Load, override and validate a recipe; every failure is a `RecipeError` with a one-line message."""
    data, lines = load_recipe_dict(path)
    data, set_paths = _apply_overrides(data, list(overrides))
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise _to_recipe_error(err, data, str(path), lines, set_paths) from None


# ---------------------------------------------------------------------------------------------------------------
# YAML out


def recipe_to_yaml(recipe: Recipe) -> str:
    """The fully resolved recipe (every default filled in) as YAML, for the run directory."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, default_flow_style=False)


def recipe_from_yaml(text: str) -> Recipe:
    """Inverse of `recipe_to_yaml` (a run directory's or a checkpoint's resolved recipe)."""
    return Recipe.model_validate(yaml.safe_load(text))
