"""JSON from untrusted files (checkpoints, tokenizers, model configs, run records), nesting bounded.

`json.loads` recurses once per nesting level, so `[[[[...]]]]` 100,000 deep raises RecursionError (not a
ValueError: it escapes every `except ValueError` around a load and ends in a traceback), and a value nested a
little less deep than the recursion limit loads, then breaks whatever walks it later (a copy, a repr, a
validator). `loads` turns both into one ValueError line; no file asyncrl reads nests beyond `MAX_DEPTH`
(Hugging Face configs and tokenizer files: under 10).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_DEPTH", "loads"]

MAX_DEPTH = 64
"""Most nesting levels (objects and arrays) a JSON document may have."""


def loads(text: str | bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """`json.loads(text)`; ValueError (one line) for malformed JSON or nesting deeper than `max_depth`."""
    try:
        doc = json.loads(text)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {max_depth} levels") from None
    level, depth = ([doc] if isinstance(doc, (dict, list)) else []), 0
    while level:  # breadth first, iteratively: the check itself must not recurse
        depth += 1
        if depth > max_depth:
            raise ValueError(f"JSON nested deeper than {max_depth} levels")
        level = [v for c in level for v in (c.values() if isinstance(c, dict) else c) if isinstance(v, (dict, list))]
    return doc
