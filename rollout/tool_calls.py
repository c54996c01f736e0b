"""Tool calls at the tokenizer level (issue #16): the two documented call formats, parsing a call out of the
model's turn, the stop matcher the engine consults after each sampled token, the tokens appended after a
call (tool output wrapped as the chat template wraps a tool message), and the tool declarations rendered
into the prompt. Pure: stdlib and the `Tokenizer` protocol; the worker (rl/) runs the calls in a sandbox.

Formats (`ToolFormat`):
- `hermes` (Qwen2.5/Qwen3, Hermes): a call is a JSON object in tags, the model's turn stops at the closing tag:

      <tool_call>
      {"name": "python", "arguments": {"code": "print(2 ** 100)"}}
      </tool_call>

- `code`: a fenced Python block means "run this with the python tool"; the turn stops at its closing fence:

      ```python
      print(2 ** 100)
      ```

  The block's info string is `python`, `py` or `python3`; the closing fence is a line that is exactly
  "```" (trailing whitespace allowed). Other fenced blocks (```text, ```) are prose, never calls.

Token in, token out: the model's own tokens are never re-tokenised. After a call the worker appends
`tool_result_tokens(...)`: the end of the model's turn, a tool message with the output, and the start of the
next assistant turn, all tokenised on their own (loss mask 0), and generation continues from the cached KV.

How a call runs (`ToolSpec.run`): `python` runs the call's `code` argument with `python3 -c`, `shell` runs its
`command` argument with `/bin/sh -c` (`RUN_ARGUMENT`); `ToolCall.source` holds that string.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Literal, NamedTuple

from model.tokenizer import Tokenizer

ToolFormat = Literal["hermes", "code"]
FORMATS: tuple[str, ...] = ToolFormat.__args__
RunKind = Literal["python", "shell"]
RUN_ARGUMENT: dict[str, str] = {"python": "code", "shell": "command"}
"""The argument a tool of each `run` kind executes (a required string parameter of its schema)."""

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
FENCE = "```"
PYTHON_INFO = ("python", "py", "python3")
"""Info strings of a fenced block that the `code` format runs."""


class ToolCallError(ValueError):
    """A call the model wrote that cannot run (malformed, unknown tool, arguments against the schema): one line,
    which the worker shows the model as the tool's output (status `parse_error`)."""

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))


@dataclass(frozen=True)
class ToolSpec:
    """One declared tool: what the prompt tells the model and how a call of it runs."""

    name: str
    description: str
    parameters: Mapping[str, Any] = field(hash=False)
    """JSON schema of the arguments: an object schema (`check_parameters_schema`)."""
    run: RunKind = "python"


PYTHON_TOOL = ToolSpec(
    name="python", run="python",
    description="Run Python 3 code in a fresh sandbox and return what it prints (stdout, then stderr).",
    parameters={"type": "object", "properties": {"code": {"type": "string", "description": "The Python code to run."}},
                "required": ["code"]},
)
"""The tool the `code` format calls when the recipe declares none."""


@dataclass(frozen=True)
class ToolCall:
    """A call parsed out of the model's turn."""

    name: str
    arguments: dict[str, Any] = field(hash=False)
    raw: str
    """The call as the model wrote it: `<tool_call>...</tool_call>` or the fenced block, fences included."""
    format: ToolFormat
    run: RunKind
    source: str
    """What runs: the `code` (python) or `command` (shell) argument."""

    @property
    def call_text(self) -> str:
        """The call as the store keeps it: the JSON of name and arguments (hermes), the code (code)."""
        if self.format == "code":
            return self.source
        return json.dumps({"name": self.name, "arguments": self.arguments}, ensure_ascii=False, sort_keys=True)


# -- JSON schema (the subset tool declarations use) ------------------------------------------------------
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
               "object": (dict,), "null": (type(None),)}


def check_parameters_schema(schema: Any, where: str = "parameters") -> None:
    """Raise ValueError (one line) unless `schema` is an object schema this module validates: `type: object`,
    `properties` of schemas whose `type` is a JSON type (or a list of them), `required` naming properties."""
    if not isinstance(schema, Mapping) or schema.get("type") != "object":
        raise ValueError(f"{where} must be a JSON schema with type: object")
    props = schema.get("properties", {})
    if not isinstance(props, Mapping):
        raise ValueError(f"{where}.properties must be a mapping of argument name to schema")
    for name, sub in props.items():
        _check_subschema(sub, f"{where}.properties.{name}")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError(f"{where}.required must be a list of argument names")
    unknown = [r for r in required if r not in props]
    if unknown:
        raise ValueError(f"{where}.required names {unknown}, which are not in its properties")


def _check_subschema(sub: Any, where: str) -> None:
    if not isinstance(sub, Mapping):
        raise ValueError(f"{where} must be a JSON schema (a mapping)")
    types = sub.get("type")
    if types is None and "enum" not in sub:
        raise ValueError(f"{where} needs a type ({', '.join(_JSON_TYPES)}) or an enum")
    for t in [types] if isinstance(types, str) else types or []:
        if t not in _JSON_TYPES:
            raise ValueError(f"{where}.type {t!r} is not a JSON type ({', '.join(_JSON_TYPES)})")
    if "items" in sub:
        _check_subschema(sub["items"], f"{where}.items")
    if types == "object" or "properties" in sub:
        for name, s in (sub.get("properties") or {}).items():
            _check_subschema(s, f"{where}.properties.{name}")


def schema_errors(value: Any, schema: Mapping[str, Any], where: str = "arguments") -> list[str]:
    """Where `value` breaks `schema` (type, enum, required keys, additionalProperties: false, array items);
    [] when it fits. Formats, patterns and bounds are not checked (the sandboxed code sees the values anyway)."""
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        # Python's bool is an int, JSON's boolean is not a number
        if not any(isinstance(value, _JSON_TYPES[t]) and not (isinstance(value, bool) and t in ("integer", "number"))
                   for t in names):
            return [f"{where} should be {' or '.join(names)}, got {_json_type(value)}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{where} should be one of {json.dumps(schema['enum'])}, got {json.dumps(value)}"]
    errors: list[str] = []
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        errors += [f"{where} lacks required {r!r}" for r in schema.get("required", []) if r not in value]
        if schema.get("additionalProperties") is False:
            errors += [f"{where} has unknown argument {k!r}" for k in value if k not in props]
        for k, v in value.items():
            if k in props:
                errors += schema_errors(v, props[k], f"{where}.{k}")
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, v in enumerate(value):
            errors += schema_errors(v, schema["items"], f"{where}[{i}]")
    return errors


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    return next((t for t, py in _JSON_TYPES.items() if isinstance(value, py)), type(value).__name__)


# -- parsing ---------------------------------------------------------------------------------------------
def parse_tool_call(text: str, fmt: ToolFormat, tools: Sequence[ToolSpec]) -> ToolCall:
    """The last complete call in `text`, the model's current turn only (the response after the last tool
    output; the worker decodes it from the turn's tokens). Raises `ToolCallError` with one line."""
    if fmt == "hermes":
        return _parse_hermes(text, tools)
    if fmt == "code":
        return _parse_code(text, tools)
    raise ValueError(f"unknown tool-call format {fmt!r} (known: {', '.join(FORMATS)})")


def _parse_hermes(text: str, tools: Sequence[ToolSpec]) -> ToolCall:
    end = text.rfind(HERMES_CLOSE)
    if end < 0:
        raise ToolCallError(f"no {HERMES_CLOSE} closes a call in this turn")
    start = text.rfind(HERMES_OPEN, 0, end)
    if start < 0:
        raise ToolCallError(f"{HERMES_CLOSE} without a {HERMES_OPEN} before it in this turn")
    raw = text[start : end + len(HERMES_CLOSE)]
    body = text[start + len(HERMES_OPEN) : end].strip()
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"malformed JSON in {HERMES_OPEN}: {e}") from None
    if not isinstance(obj, dict):
        raise ToolCallError(f"a call is a JSON object with name and arguments, got {_json_type(obj)}")
    name, args = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str):
        raise ToolCallError("the call has no \"name\" string")
    if isinstance(args, str):  # some models write the arguments as a JSON string (OpenAI's wire format does)
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise ToolCallError(f"malformed JSON in the arguments string: {e}") from None
    if not isinstance(args, dict):
        raise ToolCallError(f"\"arguments\" should be an object, got {_json_type(args)}")
    return _checked(name, args, raw, "hermes", tools)


_FENCE_LINE = re.compile(r"^```[ \t]*([^\s`]*)[^\n`]*$", re.MULTILINE)


def _fenced_blocks(text: str) -> tuple[list[tuple[str, int, int, int]], str | None]:
    """Closed fenced blocks as (info, start of the opening fence, start of the body, start of the closing
    fence), and the info string of a block still open at the end (None when none is)."""
    blocks, open_ = [], None
    for m in _FENCE_LINE.finditer(text):
        info = m.group(1).lower()
        if open_ is None:
            open_ = (info, m.start(), m.end() + 1)
        elif not info:  # CommonMark: a closing fence has no info string; "```python" inside a block is content
            blocks.append((open_[0], open_[1], open_[2], m.start()))
            open_ = None
    return blocks, None if open_ is None else open_[0]


def _parse_code(text: str, tools: Sequence[ToolSpec]) -> ToolCall:
    blocks, _ = _fenced_blocks(text)
    python = [b for b in blocks if b[0] in PYTHON_INFO]
    if not python:
        raise ToolCallError(f"no closed {FENCE}python block in this turn")
    info, start, body, close = python[-1]
    code = text[body:close] if body <= close else ""
    if not code.strip():
        raise ToolCallError(f"the {FENCE}python block is empty")
    spec = next((t for t in tools if t.run == "python"), None)
    if spec is None:
        raise ToolCallError("no python tool is declared for fenced code")
    raw = text[start : close + len(FENCE)]
    return _checked(spec.name, {RUN_ARGUMENT["python"]: code}, raw, "code", tools)


def _checked(name: str, args: dict, raw: str, fmt: ToolFormat, tools: Sequence[ToolSpec]) -> ToolCall:
    spec = next((t for t in tools if t.name == name), None)
    if spec is None:
        raise ToolCallError(f"unknown tool {name!r} (declared: {', '.join(t.name for t in tools) or 'none'})")
    errors = schema_errors(args, spec.parameters)
    if errors:
        raise ToolCallError(f"{name}: {errors[0]}" + (f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""))
    key = RUN_ARGUMENT[spec.run]
    if not isinstance(args.get(key), str):
        raise ToolCallError(f"{name}: arguments need a {key!r} string to run")
    return ToolCall(name=name, arguments=args, raw=raw, format=fmt, run=spec.run, source=args[key])


# -- stopping at a call ----------------------------------------------------------------------------------
STOP_STRINGS: dict[str, tuple[str, ...]] = {"hermes": (HERMES_CLOSE,), "code": (FENCE,)}
"""The text whose completion may end a call, per format (`code`: a fence that closes an open python block)."""


class StopMatcher:
    """Decides, after a token is sampled, whether the model's current turn now ends a tool call.

    The engine checks `tokens[-1] in trigger_ids` (a set lookup per sampled token) and only then calls
    `matches(turn_tokens)`, where `turn_tokens` are the response tokens of the model's current turn (after
    the last appended tool output). `matches` decodes a bounded tail: the call's closing text must be
    completed by the last token (BPE may merge its end with what follows: SmolLM2 has ">." and "></"), so
    the matcher fires once, at the token that closes the call. For `code` it then decodes the whole turn (only when the
    tail ends with a line-start fence) to check that the fence closes a python block opened in this turn.

    Known limit (`code`): the match is decided at the fence's last backtick, so a line "```python" inside an
    open python block (content, by CommonMark) closes the block early. Models do not nest fences in practice.
    """

    def __init__(self, tokenizer: Tokenizer, fmt: ToolFormat):
        if fmt not in STOP_STRINGS:
            raise ValueError(f"unknown tool-call format {fmt!r} (known: {', '.join(FORMATS)})")
        self.tokenizer, self.format = tokenizer, fmt
        self.stop_strings = STOP_STRINGS[fmt]
        last_chars = {s[-1] for s in self.stop_strings}
        self.trigger_ids: frozenset[int] = _ids_containing(tokenizer, frozenset(last_chars))
        """Ids whose text contains the last character of a stop string: only these can complete one."""
        # Every token of a stop string's text covers at least one of its characters, so len(stop) tokens hold
        # it; +3 leaves room for a partial UTF-8 byte at the tail's start and whitespace merged after it.
        self.tail_tokens = max(len(s) for s in self.stop_strings) + 3

    def matches(self, turn_tokens: Sequence[int]) -> bool:
        if not turn_tokens:
            return False
        tail = list(turn_tokens[-self.tail_tokens :])
        text, before = self.tokenizer.decode(tail), self.tokenizer.decode(tail[:-1])
        if self.format == "hermes":
            return text.count(HERMES_CLOSE) > before.count(HERMES_CLOSE)
        # code: the last token completes a fence, with only whitespace after it (cheap, on the tail) ...
        stripped = text.rstrip(" \t\n")
        if not stripped.endswith(FENCE) or len(stripped) <= len(before):
            return False
        # ... and that fence, on a line of its own, closes a python block opened in this turn (whole turn)
        turn = self.tokenizer.decode(list(turn_tokens))
        blocks, _ = _fenced_blocks(turn)
        return bool(blocks) and blocks[-1][3] == len(turn.rstrip(" \t\n")) - len(FENCE) and blocks[-1][0] in PYTHON_INFO


@lru_cache(maxsize=8)
def _ids_containing(tokenizer: Tokenizer, chars: frozenset[str]) -> frozenset[int]:
    # One decode per id, once per tokenizer (~0.1 s for a 50k vocabulary); the engine keeps the matcher.
    return frozenset(i for i in range(tokenizer.vocab_size) if any(c in tokenizer.decode([i]) for c in chars))


# -- the tokens appended after a call --------------------------------------------------------------------
TOOL_ROLE = "tool"
"""The role of the tool message rendered through the chat template (Qwen, SmolLM2, Llama 3.1 use it)."""
PLAIN_TOOL_OPEN, PLAIN_TOOL_CLOSE = "\n<tool_output>\n", "\n</tool_output>\n"
"""Tokenizers without a chat template (the char tokenizer) append the output between these."""
TRUNCATION_MARK = "\n[tool output truncated to {n} tokens]"
CHARS_PER_TOKEN_CAP = 64
"""Before tokenising, an output is cut at max_tokens x 64 characters: a token spans far fewer characters
(barring long whitespace runs), and a sandbox may return a megabyte that the model will never see anyway."""
_MARK, _OUT = "ASYNCRLTOOLCALLMARK", "ASYNCRLTOOLOUTPUTMARK"


class ToolResult(NamedTuple):
    tokens: tuple[int, ...]
    """Ids to append after the call: end of the model's turn, the tool message, the next assistant turn's start."""
    truncated: bool
    """The output passed `max_tokens` and was cut (the cut is marked in the text)."""
    output: str
    """The output text the tokens hold (after truncation and escaping): what the store shows as the tool's output."""


def tool_result_tokens(tokenizer: Tokenizer, output_text: str, *, max_tokens: int, turn_closed: bool = False) -> ToolResult:
    """The tokens appended after the model's call, tokenised on their own (never with the model's text).

    With a chat template (`tokenizer.chat_template`), the conversation [user, assistant "MARK", tool OUTPUT] is
    rendered with the generation prompt and the text between MARK and the end is split around OUTPUT: what
    follows the model's text is the template's end of an assistant turn (e.g. "<|im_end|>\\n"), the tool
    message (e.g. "<|im_start|>tool\\n" OUTPUT "<|im_end|>\\n") and the next assistant header
    ("<|im_start|>assistant\\n"). The model's end-of-turn token is part of these appended tokens (loss mask
    0): the engine pauses the turn at the call's closing text, before the model samples its end of turn, so
    nothing of the model's own closes the turn. With `turn_closed` (the model's last token is already one of
    `eos_ids`, e.g. a worker that runs a call found in a finished turn), a leading end-of-turn id is dropped
    rather than repeated.

    Without a chat template the output sits between `PLAIN_TOOL_OPEN` and `PLAIN_TOOL_CLOSE` (documented
    plain text: the char tokenizer's prompts have no roles either).

    The output is cut to `max_tokens` tokens (its own tokenisation), the cut marked with `TRUNCATION_MARK`;
    text the tokenizer cannot encode is replaced by "?", and text that would encode to a special token (a
    tool printing "<|im_end|>") is broken up, so a tool's output never forges a turn boundary.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    shown, truncated = _shown_output(tokenizer, output_text, max_tokens)
    head, tail = _template_parts(tokenizer)
    tokens = tokenizer.encode(head + shown + tail)
    if turn_closed and tokens and tokens[0] in tokenizer.eos_ids:
        tokens = tokens[1:]
    return ToolResult(tuple(tokens), truncated, shown)


def _shown_output(tokenizer: Tokenizer, text: str, max_tokens: int) -> tuple[str, bool]:
    truncated = len(text) > max_tokens * CHARS_PER_TOKEN_CAP
    text = _encodable(tokenizer, text[: max_tokens * CHARS_PER_TOKEN_CAP])
    ids = tokenizer.encode(text)
    if len(ids) > max_tokens:
        ids, truncated = ids[:max_tokens], True
        text = tokenizer.decode(ids).rstrip("\ufffd")  # a cut inside a multi-byte character decodes to U+FFFD
    text = _no_special_tokens(tokenizer, text, ids)
    return (text + TRUNCATION_MARK.format(n=max_tokens) if truncated else text), truncated


def _encodable(tokenizer: Tokenizer, text: str) -> str:
    try:
        tokenizer.encode(text)
        return text
    except ValueError:  # e.g. the char tokenizer and non-ASCII output: each character it lacks becomes "?"
        bad = set()
        for ch in set(text):
            try:
                tokenizer.encode(ch)
            except ValueError:
                bad.add(ch)
        return "".join("?" if ch in bad else ch for ch in text)


def _no_special_tokens(tokenizer: Tokenizer, text: str, ids: Sequence[int]) -> str:
    """`text` with every special token's text broken by a space after its first character ("< |im_end|>")."""
    specials = {i for i in set(ids) if i in _special_ids(tokenizer)}
    backend = getattr(tokenizer, "backend", None)  # HFTokenizer: the token's text; others encode no specials
    for i in specials:
        piece = backend.id_to_token(i) if backend is not None else None
        if piece:
            text = text.replace(piece, piece[0] + " " + piece[1:])
    return text


@lru_cache(maxsize=8)
def _special_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids that decode to nothing (special tokens, by the protocol's `decode`)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        return frozenset(i for i in (tokenizer.pad_id, tokenizer.bos_id, *tokenizer.eos_ids) if i is not None)
    return frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)


@lru_cache(maxsize=8)
def _template_parts(tokenizer: Tokenizer) -> tuple[str, str]:
    """(text before the output, text after it), from the chat template or the plain wrapper."""
    if getattr(tokenizer, "chat_template", None) is None:
        return PLAIN_TOOL_OPEN, PLAIN_TOOL_CLOSE
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi."}, {"role": "assistant", "content": _MARK},
                                          {"role": TOOL_ROLE, "content": _OUT}], add_generation_prompt=True)
    after = text.split(_MARK)
    parts = after[-1].split(_OUT) if len(after) == 2 else []
    if len(parts) != 2:
        raise ValueError("the chat template does not render an assistant message and a tool message's content once each; "
                         "cannot place tool output after a call")
    return parts[0], parts[1]


def format_tool_output(stdout: str, stderr: str, *, reason: str, exit_code: int | None) -> str:
    """The text a tool returns to the model, from a sandbox exec: stdout, then stderr, then one bracketed line
    when the run did not end with exit 0: "[exit code 1]", or the sandbox's reason ("[timeout]", "[memory]",
    "[output_truncated]"); "(no output)" when there is nothing at all."""
    parts = [p.rstrip("\n") for p in (stdout, stderr) if p]
    if reason != "ok":
        parts.append(f"[{reason}]")
    elif exit_code != 0:
        parts.append(f"[exit code {exit_code}]")
    return "\n".join(parts) if parts else "(no output)"


def tool_status(reason: str, exit_code: int | None) -> str:
    """A turn's status from a sandbox exec's reason (sandbox_client.records.Reason): `ok` (exited 0), `error`
    (the code failed: a non-zero exit, or a memory, process or output limit it hit), `timeout` (wall clock or
    CPU time), `sandbox_failed` (killed by nothing the code did, or never admitted)."""
    if reason == "ok":
        return "ok" if exit_code == 0 else "error"
    if reason in ("timeout", "cpu"):
        return "timeout"
    if reason in ("memory", "processes", "output_truncated"):
        return "error"
    return "sandbox_failed"


# -- declaring the tools in the prompt -------------------------------------------------------------------
def tool_instructions(tools: Sequence[ToolSpec], fmt: ToolFormat) -> str:
    """The system-prompt text that declares `tools` in the format's documented wording: Qwen2.5's and Hermes'
    tool prompt (`hermes`: one JSON signature per line in <tools></tools>), or the fenced-code convention."""
    if fmt == "hermes":
        sigs = "\n".join(json.dumps({"type": "function", "function": {"name": t.name, "description": t.description,
                                                                      "parameters": dict(t.parameters)}})
                         for t in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                f"<tools>\n{sigs}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                f"{HERMES_OPEN}{HERMES_CLOSE} XML tags:\n{HERMES_OPEN}\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n'
                f"{HERMES_CLOSE}\n\nMake one call at a time: its result comes back before you continue.")
    if fmt == "code":
        spec = next((t for t in tools if t.run == "python"), PYTHON_TOOL)
        return ("# Tools\n\nYou can run Python code. Write it in a fenced block:\n"
                f"{FENCE}python\nprint(1 + 1)\n{FENCE}\n"
                "The block runs as soon as it closes; what it prints (stdout, then stderr) comes back before you "
                f"continue. {spec.description}")
    raise ValueError(f"unknown tool-call format {fmt!r} (known: {', '.join(FORMATS)})")


def render_tools_into_prompt(prompt: str | Sequence[Mapping[str, str]], tools: Sequence[ToolSpec],
                             fmt: ToolFormat, instructions: str | None = None) -> str | list[dict[str, str]]:
    """The prompt with the tool declarations in its system prompt: chat messages get them appended to their
    system message (or a system message first); a text prompt (the char tokenizer's) gets them first, then a
    blank line. System-prompt text rather than the template's own `tools` rendering: model/chat_template.py
    passes `tools=None`, and one wording keeps the format the same across checkpoints. `instructions`: the
    recipe's own text in place of the format's wording (`tools.instructions`)."""
    text = tool_instructions(tools, fmt) if instructions is None else instructions
    if isinstance(prompt, str):
        return f"{text}\n\n{prompt}"
    messages = [dict(m) for m in prompt]
    if messages and messages[0].get("role") == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{text}"
        return messages
    return [{"role": "system", "content": text}, *messages]
