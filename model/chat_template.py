"""Chat templates rendered the way transformers renders them, with jinja2 alone (no transformers).

A checkpoint's chat template is untrusted code, so it runs in jinja2's immutable sandbox (jinja2 >= 3.1.6,
the release transformers also requires for its sandbox fixes). The environment matches transformers'
`render_jinja_template`: `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a
`{% generation %}` block (rendered as its body), `raise_exception(msg)`, `strftime_now(fmt)`, a `tojson`
that does not escape HTML, a `dict` and a `namespace` that refuse underscore names; the template sees
`messages`, `tools` (None), `documents` (None), `add_generation_prompt` and the tokenizer's named special
tokens (`bos_token`, `eos_token`, `unk_token`, `pad_token`) as strings. A template that fails to compile
or raises is one line (ChatTemplateError, a ValueError).

Budgets (issue 40): the sandbox keeps a template away from Python's internals, not from the host's memory and
time, so every render also runs under
- a size budget, `SIZE_BUDGET` characters (or items, or digits) for any value it builds and for its output:
  the operations that multiply sizes in one C call (`*`, `**`, `+`, `%`, `~`, str.format / `format` widths,
  center / ljust / rjust / zfill / expandtabs / indent widths, replace, join) are checked against the size
  their result would have *before* they run, as is every number passed to a call or filter, and the output
  is counted as it streams;
- a time budget, `TIME_BUDGET_S` seconds of wall clock per render: a watchdog thread raises in the rendering
  thread when it is over (loops that print nothing, deep macro trees), which works in any thread, unlike
  SIGALRM;
- Python's recursion limit: a macro that calls itself forever is one line too.
Each ends in one ChatTemplateError line ("... over its size budget", "... over its time budget", "... recurses
too deeply"). Real templates use none of this headroom: they render in milliseconds to a few KiB.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import json
import re
import string
import threading
import time
import types
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache, wraps

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

SIZE_BUDGET = 2**24
"""Most characters (list items, integer digits) any value a template builds, or its whole output, may have."""
TIME_BUDGET_S = 2.0
"""Most seconds one render may take."""


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


class _OverBudget(jinja2.exceptions.SecurityError):
    """A value or the output would pass SIZE_BUDGET (raised before the operation that would build it runs)."""


def _over(what: str, size: int) -> _OverBudget:
    return _OverBudget(f"{what} of {size:,} characters would put the template over its size budget of {SIZE_BUDGET:,}")


def _size(x, limit: int = SIZE_BUDGET) -> int:
    """Characters `str(x)` would have, without building it, for strings and (nested) lists, tuples and dicts;
    counting stops past `limit`. Other values: the length of their str (they are small: numbers, None, ...)."""
    if isinstance(x, str):
        return len(x)
    if isinstance(x, (list, tuple, dict)):
        total = 2
        for item in (itertools.chain.from_iterable(x.items()) if isinstance(x, dict) else x):
            total += _size(item, limit - total) + 2
            if total > limit:
                break
        return total
    if isinstance(x, int) and not isinstance(x, bool) and x.bit_length() > 4 * SIZE_BUDGET:
        return SIZE_BUDGET + 1  # a number this long is not printed to find out
    return len(str(x))


def _check(what: str, size: int) -> None:
    if size > SIZE_BUDGET:
        raise _over(what, size)


def _check_numbers(what: str, args, kwargs) -> None:
    """A number argument past the budget is a size request (center(3e9), slice(3e9), ...): refused up front."""
    for a in itertools.chain(args, kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > SIZE_BUDGET:
            raise _over(f"{what} with the number {a}", abs(a))


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d*)(?:\.(\d*))?")
_DIGITS = re.compile(r"\d+")


def _check_percent(fmt: str, values) -> None:
    """`fmt % values`: the widths and precisions written in `fmt` and the values' own sizes."""
    widths = sum(int(w or 0) + int(p or 0) for w, p in _PERCENT_SPEC.findall(fmt))
    values = values if isinstance(values, tuple) else (values,)
    _check_numbers("a % format", values, {})
    _check("a % format", len(fmt) + widths + sum(_size(v) for v in values))


def _check_format(fmt: str, args, kwargs) -> None:
    """str.format: the widths written in its replacement fields' specs (nested ones come from the checked args)."""
    _check_numbers("str.format", args, kwargs)
    total = len(fmt) + sum(_size(v) for v in itertools.chain(args, kwargs.values()))
    try:
        for _, field, spec, _ in string.Formatter().parse(fmt):
            if field is not None and spec:
                total += sum(int(d) for d in _DIGITS.findall(spec))
    except ValueError:
        pass  # malformed: str.format raises its own error
    _check("str.format", total)


def _check_replace(s, old, new, count=-1) -> None:
    s, old, new = str(s), str(old), str(new)
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    _check("replace", len(s) + n * max(len(new) - len(old), 0))


def _check_join(sep, items: list) -> None:
    _check("join", sum(_size(v) for v in items) + max(len(items) - 1, 0) * _size(sep))


def _check_binop(operator: str, left, right) -> None:
    if operator == "*":
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
            _check(f"{type(seq).__name__} * {n}", len(seq) * max(n, 0))
        elif isinstance(left, int) and isinstance(right, int):
            _check("a product", (left.bit_length() + right.bit_length()) // 3)
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            # digits of left ** right: right · log10|left|, from the bit length (an upper bound within a factor ~1)
            _check("a power", right * left.bit_length() * 3 // 10 + 1)
    elif operator == "+":
        if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            _check("a sum", len(left) + len(right))
    elif operator == "%" and isinstance(left, str):
        _check_percent(left, right)


_SIZED_STR_METHODS = {"center", "ljust", "rjust", "zfill", "expandtabs", "replace", "join"}


def _sized_method(value):
    """A str method that can build a string far larger than its inputs, wrapped with its size check."""
    if not (isinstance(value, types.BuiltinMethodType) and isinstance(value.__self__, str)
            and value.__name__ in _SIZED_STR_METHODS):
        return None
    s, name = value.__self__, value.__name__

    @wraps(value)
    def checked(*args, **kwargs):
        if name == "join":
            items = list(args[0]) if args else []
            _check_join(s, items)
            return value(items, *args[1:], **kwargs)
        if name == "replace":
            _check_replace(s, *args, **kwargs)
        else:
            _check_numbers(f"str.{name}", args, kwargs)
            if name == "expandtabs":
                _check("str.expandtabs", len(s) + s.count("\t") * int(args[0] if args else kwargs.get("tabsize", 8)))
        return value(*args, **kwargs)

    return checked


def _checked_filter(name: str, f):
    """A filter that refuses size requests past the budget before it runs (`format`, `join`, `replace`, `indent`
    by what they would build; every filter by its number arguments)."""
    pass_arg = getattr(f, "jinja_pass_arg", None)

    @wraps(f)
    def checked(*args, **kwargs):
        user = args[1:] if pass_arg is not None else args  # the context / environment argument is jinja's
        if name == "format" and user:
            fmt_args = user[1:] or (kwargs,)
            _check_percent(str(user[0]), fmt_args[0] if kwargs else tuple(fmt_args))
        elif name == "join" and user:
            items = list(user[0])
            _check_join(user[1] if len(user) > 1 else kwargs.get("d", ""), items)
            args = (*args[: len(args) - len(user)], items, *user[1:])
        elif name == "replace" and len(user) >= 3:
            _check_replace(*user[:4])
        elif name == "indent" and user:
            width = user[1] if len(user) > 1 else kwargs.get("width", 4)
            text = str(user[0])
            _check("indent", len(text) + (text.count("\n") + 1) * (width if isinstance(width, int) else _size(width)))
        _check_numbers(f"the {name} filter", user[1:], kwargs)
        return f(*args, **kwargs)

    return checked


class _BudgetCodeGenerator(CodeGenerator):
    """`a ~ b` compiles to a join the environment checks first (jinja's own `str_join` cannot be intercepted)."""

    def visit_Concat(self, node, frame):
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("), context.eval_ctx)")


class _BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox plus the size checks of this module's docstring."""

    code_generator_class = _BudgetCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context, operator, left, right):
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
        _check_numbers(f"a call of {getattr(__obj, '__name__', type(__obj).__name__)}", args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj, attribute):
        value = super().getattr(obj, attribute)
        return _sized_method(value) or value

    def getitem(self, obj, argument):
        value = super().getitem(obj, argument)
        return _sized_method(value) or value

    def wrap_str_format(self, value):
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        fmt, is_map = value.__self__, value.__name__ == "format_map"

        @wraps(wrapper)
        def checked(*args, **kwargs):
            if is_map:
                _check_format(fmt, (), dict(args[0]) if args and isinstance(args[0], Mapping) else {})
            else:
                _check_format(fmt, args, kwargs)
            return wrapper(*args, **kwargs)

        return checked

    @staticmethod
    def checked_concat(parts, eval_ctx):
        _check("a ~ concatenation", sum(_size(p) for p in parts))
        return (jinja2.runtime.markup_join if eval_ctx.autoescape else jinja2.runtime.str_join)(parts)

    @staticmethod
    def checked_output(value):
        _check("an output value", _size(value))
        return value


class _OverTime(BaseException):
    """Raised in the rendering thread by the watchdog. A BaseException, so that no `except Exception` on the way
    (jinja's, a filter's) swallows it."""


class _Watchdog:
    """One daemon thread per process that interrupts renders past their deadline.

    `arm()` registers the calling thread with a deadline; when it passes while still registered, the watchdog sets
    `_OverTime` as that thread's asynchronous exception (delivered at its next bytecode). `disarm` unregisters and
    clears an exception set but not yet delivered, both under the lock the watchdog fires under, so nothing is ever
    delivered after a render returned. A deadline fires at most once."""

    def __init__(self):
        self._lock = threading.Condition()
        self._heap: list[tuple[float, int, dict]] = []
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float) -> dict:
        entry = {"thread": threading.get_ident(), "live": True, "fired": False}
        with self._lock:
            heapq.heappush(self._heap, (time.monotonic() + seconds, next(self._ids), entry))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="chat-template-watchdog", daemon=True)
                self._thread.start()
            self._lock.notify()
        return entry

    def disarm(self, entry: dict) -> bool:
        """Unregister; True when the deadline had fired."""
        with self._lock:
            if entry["live"]:
                entry["live"] = False
                if entry["fired"]:  # set, maybe not yet delivered: clear it
                    _set_async_exc(entry["thread"], None)
            return entry["fired"]

    def _run(self):
        with self._lock:
            while True:
                while self._heap and not self._heap[0][2]["live"]:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._lock.wait()
                    continue
                deadline, _, entry = self._heap[0]
                now = time.monotonic()
                if now < deadline:
                    self._lock.wait(deadline - now)
                    continue
                heapq.heappop(self._heap)
                entry["fired"] = True
                _set_async_exc(entry["thread"], _OverTime)


def _set_async_exc(thread_id: int, exc) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


_WATCHDOG = _Watchdog()


@lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    env = _BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols],
                               finalize=_BudgetedEnvironment.checked_output)
    env.filters = {name: _checked_filter(name, f) for name, f in env.filters.items()}
    env.filters["tojson"] = _checked_filter("tojson", _tojson)
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(), namespace=_Namespace)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {_one_line(e)}") from None
    except (RecursionError, MemoryError, OverflowError) as e:  # e.g. thousands of nested brackets
        raise ChatTemplateError(f"chat template does not compile: {type(e).__name__}") from None


def render_chat_template(source: str, messages: Sequence[Mapping[str, object]], *, add_generation_prompt: bool,
                         special_tokens: Mapping[str, str]) -> str:
    """The conversation rendered as transformers' `apply_chat_template(..., tokenize=False)` renders it, within the
    module's time and size budgets."""
    template = compile_chat_template(source)
    # transformers drops None-valued keys (some templates print "None" for them) and passes plain data only
    chat = [{str(k): v for k, v in m.items() if v is not None} for m in messages]
    entry = _WATCHDOG.arm(TIME_BUDGET_S)
    try:
        try:
            out = _render(template, dict(messages=chat, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **special_tokens))
        finally:
            fired = _WATCHDOG.disarm(entry)
        if fired:  # delivered, and swallowed by some `except BaseException` on the way: over time all the same
            raise _OverTime
        return out
    except _OverTime:
        _WATCHDOG.disarm(entry)
        raise ChatTemplateError(f"chat template: rendering is over its time budget of {TIME_BUDGET_S:g} s") from None
    except _OverBudget as e:
        raise ChatTemplateError(f"chat template: {_one_line(e)}") from None
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template: {_one_line(e)}") from None
    except RecursionError:
        raise ChatTemplateError("chat template: rendering recurses too deeply (a macro that calls itself?)") from None
    except (MemoryError, OverflowError) as e:
        raise ChatTemplateError(f"chat template: rendering failed ({type(e).__name__}: {_one_line(e)})") from None


def _render(template: jinja2.Template, variables: dict) -> str:
    """template.render, streamed, so that the output is counted as it grows rather than after it was built."""
    out, size = [], 0
    for chunk in template.generate(**variables):
        size += len(chunk)
        _check("the output", size)
        out.append(chunk)
    return "".join(out)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
