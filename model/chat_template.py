"""Chat templates rendered the way transformers renders them, with jinja2 alone (no transformers).

A checkpoint's chat template is untrusted code, so it runs in jinja2's immutable sandbox (jinja2 >= 3.1.6,
the release transformers also requires for its sandbox fixes). The environment matches transformers'
`render_jinja_template`: `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a
`{% generation %}` block (rendered as its body), `raise_exception(msg)`, `strftime_now(fmt)`, a `tojson`
that does not escape HTML, a `dict` and a `namespace` that refuse underscore names; the template sees
`messages`, `tools` (None), `documents` (None), `add_generation_prompt` and the tokenizer's named special
tokens (`bos_token`, `eos_token`, `unk_token`, `pad_token`) as strings. A template that fails to compile
or raises is one line (ChatTemplateError, a ValueError).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks assistant text for masks; here it renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    def __init__(*args, **kwargs):  # jinja's own signature trick, so `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes on a namespace ({name!r})")


class _Dict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


class ChatTemplateError(ValueError):
    """A chat template that does not compile, raises, or reaches for what the sandbox forbids (one line)."""


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(), namespace=_Namespace)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {_one_line(e)}") from None


def render_chat_template(source: str, messages: Sequence[Mapping[str, object]], *, add_generation_prompt: bool,
                         special_tokens: Mapping[str, str]) -> str:
    """The conversation rendered as transformers' `apply_chat_template(..., tokenize=False)` renders it."""
    template = compile_chat_template(source)
    # transformers drops None-valued keys (some templates print "None" for them) and passes plain data only
    chat = [{str(k): v for k, v in m.items() if v is not None} for m in messages]
    try:
        return template.render(messages=chat, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
                               **special_tokens)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template: {_one_line(e)}") from None


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__
