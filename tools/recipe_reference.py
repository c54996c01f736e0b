"""Write the recipe reference (docs/reference/recipe.md) from the config models' field docstrings.

    python tools/recipe_reference.py           # rewrite docs/reference/recipe.md
    python tools/recipe_reference.py --check   # exit 1, one line, when the committed file is stale

Walks every field of `rl.config.Recipe` and of every model nested in it (inside lists, dicts, Optional, and each
member of a discriminated union, listed under its `type`), then `rl.reconfigure.ReconfigPatch` (what
`rl reconfigure` accepts). Each field gets its dotted path, its type as a recipe writes it, its default, its
constraints and its docstring. A field's docstring is its documentation (configbase.StrictConfig sets
`use_attribute_docstrings`): tests/unit/test_docs.py fails on a field without one, and on a stale reference.
The output depends only on the code, never on the machine: byte-identical on every run.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "reference" / "recipe.md"
CONSTRAINTS = (("gt", "> {}"), ("ge", ">= {}"), ("lt", "< {}"), ("le", "<= {}"), ("multiple_of", "multiple of {}"),
               ("min_length", "length >= {}"), ("max_length", "length <= {}"), ("pattern", "{}"))
"""FieldInfo.metadata attributes, in the order they are shown."""


# ---------------------------------------------------------------------------------------------------------------
# Walking the models


def _strip(tp: Any) -> tuple[Any, list[Any]]:
    """(the type under any Annotated, the Annotated metadata: constraints, a discriminator's FieldInfo)."""
    meta: list[Any] = []
    while get_origin(tp) is Annotated:
        tp, *more = get_args(tp)
        meta += more
    return tp, meta


def _is_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def models_in(tp: Any) -> list[type[BaseModel]]:
    """The models a field's type holds: itself, or inside Optional, unions, lists, tuples and dict values."""
    tp, _ = _strip(tp)
    if _is_model(tp):
        return [tp]
    if get_origin(tp) is Literal:
        return []
    return [m for arg in get_args(tp) for m in models_in(arg)]


def reachable_models(*roots: type[BaseModel]) -> list[type[BaseModel]]:
    """Every model reachable from the roots through their fields, each once, in walk order."""
    seen: list[type[BaseModel]] = []
    todo = list(reversed(roots))
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.append(model)
        for info in model.model_fields.values():
            todo += reversed(models_in(info.annotation))
    return seen


def undocumented(*roots: type[BaseModel]) -> list[str]:
    """`Model.field` for every field without a docstring, over every model reachable from the roots."""
    return [f"{m.__name__}.{name}" for m in reachable_models(*roots) for name, info in m.model_fields.items()
            if not (info.description or "").strip()]


def _discriminator(tp: Any, info: FieldInfo | None = None) -> str | None:
    """The discriminator of a union of models: on the field, or on an Annotated anywhere inside its type."""
    if info is not None and isinstance(info.discriminator, str):
        return info.discriminator
    tp, meta = _strip(tp)
    for m in meta:
        if isinstance(m, FieldInfo) and isinstance(m.discriminator, str):
            return m.discriminator
    if get_origin(tp) is Literal:
        return None
    return next((d for arg in get_args(tp) if (d := _discriminator(arg))), None)


def _member_value(model: type[BaseModel], disc: str) -> str:
    (value,) = get_args(model.model_fields[disc].annotation)
    return str(value)


def _ordered_members(models: list[type[BaseModel]]) -> list[type[BaseModel]]:
    """Union members in declaration order, except that a member comes after any member it subclasses."""
    out: list[type[BaseModel]] = []
    for m in models:
        bases = [b for b in models if b is not m and issubclass(m, b) and b not in out]
        out += [b for b in bases if b not in out]
        if m not in out:
            out.append(m)
    return out


def _container_suffix(tp: Any) -> str:
    """`[]` for a list (or tuple) of models, `.<key>` for a dict of them, '' otherwise (Optional does not count)."""
    tp, _ = _strip(tp)
    if _is_union(tp):
        return next((s for arg in get_args(tp) if (s := _container_suffix(arg))), "")
    origin = get_origin(tp)
    if origin in (list, tuple) and any(models_in(a) for a in get_args(tp)):
        return "[]"
    if origin is dict and models_in(get_args(tp)[1]):
        return ".<key>"
    return ""


@dataclass
class Section:
    """One model at one path: its fields, and the union members (outer `type:` choices) it appears under."""

    path: str
    model: type[BaseModel]
    discriminator: str | None = None
    """The field that picks this model when it is one member of a union at `path` (`type`)."""
    member: str | None = None
    """This model's own value of that field."""
    under: list[tuple[str, str, str]] = field(default_factory=list)
    """(path, discriminator, value) of the enclosing union members this section is reached through."""


def sections(root: type[BaseModel], prefix: str = "") -> list[Section]:
    """Every (path, model, member) reachable from root, depth first in field order. A model reached again at the
    same path (one `dispatch` under both `grpo` and `opd` stages) is one section that lists where it appears."""
    found: dict[tuple[str, type[BaseModel]], Section] = {}

    def walk(model: type[BaseModel], path: str, disc: str | None, under: tuple[tuple[str, str, str], ...]) -> None:
        key = (path, model)
        if key not in found:
            found[key] = Section(path, model, disc, _member_value(model, disc) if disc else None)
        elif all(u in found[key].under for u in under):
            return  # seen, and under nothing new: its nested sections know already
        section = found[key]
        section.under += [u for u in under if u not in section.under]
        if disc:  # this member's nested models are under it
            under = (*under, (path, disc, section.member))
        for name, info in model.model_fields.items():
            inner = models_in(info.annotation)
            if not inner:
                continue
            sub = (f"{path}.{name}" if path else name) + _container_suffix(info.annotation)
            disc_of = _discriminator(info.annotation, info)
            for m in _ordered_members(inner) if disc_of else inner:
                walk(m, sub, disc_of, under)

    walk(root, prefix, None, ())
    return list(found.values())


# ---------------------------------------------------------------------------------------------------------------
# Rendering


_PLAIN = re.compile(r"[A-Za-z_][\w./-]*")
_YAML_WORDS = {"true", "false", "null", "yes", "no", "on", "off", "y", "n", "~"}


def yaml_value(v: Any) -> str:
    """A value in YAML flow style, as a recipe writes it: plain words unquoted, everything else JSON."""
    if isinstance(v, BaseModel):
        v = v.model_dump(mode="json")
    if isinstance(v, Path):
        v = str(v)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{yaml_value(k)}: {yaml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(yaml_value(x) for x in v) + "]"
    if isinstance(v, str) and _PLAIN.fullmatch(v) and v.lower() not in _YAML_WORDS:
        return v
    return json.dumps(v, ensure_ascii=False)


def type_name(tp: Any, *, top: bool = True) -> str:
    """A field's type as a recipe writes it: int, float, bool, str, path, list[...], {str: ...}, object."""
    tp, _ = _strip(tp)
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    if _is_model(tp):
        return "object"
    if isinstance(tp, type) and issubclass(tp, Path):
        return "path"
    if isinstance(tp, type) and tp in (bool, int, float, str):
        return tp.__name__
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        if top:  # the choices go to the constraints
            return type_name(type(args[0]), top=False)
        return " | ".join(yaml_value(a) for a in args)
    if _is_union(tp):
        if all(_is_model(_strip(a)[0]) for a in args):
            return "object"
        parts: list[str] = []
        plain = [a for a in args if a is not type(None)]
        only_literal = len(plain) == 1 and get_origin(_strip(plain[0])[0]) is Literal
        for a in args:
            name = type_name(a, top=top and only_literal)
            if name not in parts:
                parts.append(name)
        return " | ".join(parts)
    if origin in (list, set, frozenset) or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        item = type_name(args[0], top=False)
        if get_origin(_strip(args[0])[0]) is Literal:
            item = type_name(type(get_args(_strip(args[0])[0])[0]), top=False)
        return f"list[{item}]"
    if origin is tuple:
        return "[" + ", ".join(type_name(a, top=False) for a in args) + "]"
    if origin is dict:
        return "{" + f"{type_name(args[0], top=False)}: {type_name(args[1], top=False)}" + "}"
    raise TypeError(f"no YAML name for the type {tp!r}")


def _literal_choices(tp: Any) -> tuple[list[Any], bool] | None:
    """(choices, of the items) of a Literal field, also under Optional or as the items of a list/tuple."""
    tp, _ = _strip(tp)
    if get_origin(tp) is Literal:
        return list(get_args(tp)), False
    args = get_args(tp)
    if _is_union(tp):
        plain = [a for a in args if a is not type(None)]
        return _literal_choices(plain[0]) if len(plain) == 1 else None
    if get_origin(tp) in (list, tuple) and args:
        inner = _literal_choices(args[0])
        return (inner[0], True) if inner else None
    return None


def constraints(info: FieldInfo, disc: str | None, members: list[type[BaseModel]]) -> list[str]:
    """Bounds, lengths and patterns (FieldInfo.metadata), Literal choices, and a union's `type` choices."""
    out = []
    metas = [*info.metadata, *(m for m in _strip(info.annotation)[1] if not isinstance(m, FieldInfo))]
    for attr, fmt in CONSTRAINTS:
        for meta in metas:
            value = getattr(meta, attr, None)
            if value is not None:
                out.append(f"matches `{value}`" if attr == "pattern" else f"`{fmt.format(value)}`")
    choices = _literal_choices(info.annotation)
    if choices:
        values, items = choices
        words = ", ".join(f"`{yaml_value(v)}`" for v in values)
        out.append(("items " if items else "") + (f"only {words}" if len(values) == 1 else f"one of {words}"))
    if disc:
        out.append(f"`{disc}` one of " + ", ".join(f"`{_member_value(m, disc)}`" for m in members))
    return out


def default(info: FieldInfo, disc: str | None) -> str:
    """The default as YAML; a nested model's default shows only what differs from its own fields' defaults."""
    if info.is_required():
        return "required"
    value = info.default_factory() if info.default_factory is not None else info.default
    if isinstance(value, BaseModel):
        shown = value.model_dump(mode="json", exclude_defaults=True)
        value = {disc: getattr(value, disc), **shown} if disc else shown
    return f"default `{yaml_value(value)}`"


_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)


def prose(text: str) -> str:
    """A docstring as one Markdown paragraph: whitespace collapsed; outside code spans, characters Markdown would
    take as HTML or emphasis are escaped."""
    text = " ".join(text.split())
    out, pos = [], 0
    for m in _CODE_SPAN.finditer(text):
        out += [_escape(text[pos:m.start()]), m.group(0)]
        pos = m.end()
    out.append(_escape(text[pos:]))
    return "".join(out)


def _escape(text: str) -> str:
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return re.sub(r"([*_\[\]`\\])", r"\\\1", text)


def _heading(s: Section) -> str:
    name = f"`{s.path}`" if s.path else "Top level"
    if s.member:
        name += f", `{s.discriminator}: {s.member}`"
    return f"### {name} ({s.model.__name__})"


def render_section(s: Section) -> list[str]:
    lines = [_heading(s), ""]
    if s.under:
        kinds: dict[tuple[str, str], list[str]] = {}
        for path, disc, member in s.under:
            kinds.setdefault((path, disc), []).append(f"`{member}`")
        lines += ["In " + "; ".join(f"`{p}` of {d} {', '.join(ms)}" for (p, d), ms in kinds.items()) + ".", ""]
    doc = (s.model.__doc__ or "").strip()
    if doc and doc != (BaseModel.__doc__ or "").strip():
        lines += [prose(doc), ""]
    names = list(s.model.model_fields)
    if s.discriminator:  # the discriminator first
        names = [s.discriminator, *[n for n in names if n != s.discriminator]]
    for name in names:
        info = s.model.model_fields[name]
        path = f"{s.path}.{name}" if s.path else name
        inner = models_in(info.annotation)
        disc = _discriminator(info.annotation, info) if inner else None
        members = _ordered_members(inner) if disc else []
        meta = [f"`{type_name(info.annotation)}`", default(info, disc), *constraints(info, disc, members)]
        lines += [f"#### `{path}`", "", " · ".join(meta), "", prose(info.description or "") or "*(no docstring)*", ""]
    return lines


def render() -> str:
    from rl.config import Recipe
    from rl.reconfigure import ReconfigPatch

    lines = [
        "# Recipe reference",
        "",
        "<!-- Generated by tools/recipe_reference.py from the config models' field docstrings: do not edit by hand;",
        "     run `python tools/recipe_reference.py` (tests/unit/test_docs.py fails when this file is stale). -->",
        "",
        "Every field a recipe may set: its dotted path (`[]` marks an item of a list), its type as YAML writes it, its",
        "default, its constraints and what it does. A path written `stages[]` is `stages.0`, `stages.1`, ... on the",
        "command line (`--set stages.1.optim.lr=3e-5`). Where a field holds one of several kinds of object, its `type`",
        "picks the kind, and each kind's fields are listed under its own heading (`stages[]`, `type: grpo`). A nested",
        "object's default shows only what differs from its own fields' defaults (`{}`: all of them).",
        "",
        "## Recipe (`rl train`, `rl validate`)",
        "",
    ]
    for s in sections(Recipe):
        lines += render_section(s)
    lines += [
        "## Live patch (`rl reconfigure`)",
        "",
        "What `rl reconfigure RUN_DIR patch.yaml` (or `--set`) accepts while a GRPO or OPD stage runs "
        "(rl/reconfigure.py).",
        "",
    ]
    for s in sections(ReconfigPatch):
        lines += render_section(s)
    while lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the committed reference is stale")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run `python tools/recipe_reference.py`", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
