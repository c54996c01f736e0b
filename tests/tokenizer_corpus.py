"""Test strings for tokenizer parity: ASCII prose, Unicode (accents, CJK, emoji with joiners, RTL, combining
marks), code, whitespace runs (around digits too), chat turns with special tokens, and random code points.
Deterministic for a seed."""

from __future__ import annotations

import random

WORDS = ("the quick brown fox jumps over lazy dog model token reward policy gradient sample batch "
         "don't it's we're they've I'm you'll he'd CamelCase snake_case HTTP JSON URL").split()
UNICODE = ["café", "naïve", "Ångström", "façade", "Straße", "日本語", "中文字符", "한국어", "😀", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷",
           "مرحبا", "שלום", "Ελληνικά", "Русский", "é", "ñ", "ǅ", "ﬁ", "²³", "½", "Ⅻ", "١٢٣", "१२३", "…", "—", "€",
           "\u00a0", "\u200b", "\u3000", "\ufeff", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "🤖"]
CODE = ["def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }",
        "if __name__ == '__main__':\n\tmain()", "SELECT id, name FROM users WHERE age >= 21;",
        '{"key": [1, 2.5, -3e10, null, true]}', "x = {'a': 1}\ny = x.get('a', 0)\n", "#include <stdio.h>\n",
        "lambda s: s.strip().split(',')", "    \n\t\t  \r\n", "<div class=\"c\">&amp;</div>", "0x1F 0b1010 1_000_000"]
WHITESPACE = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\t\t", "    ", "\n\n\n"]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
ROLES = ["system", "user", "assistant"]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _number(rng: random.Random) -> str:
    return rng.choice([str(rng.randrange(10 ** rng.randint(1, 8))), f"{rng.random() * 1000:.3f}", f"-{rng.randrange(100)}",
                       f"{rng.randrange(1, 13)}/{rng.randrange(1, 29)}/20{rng.randrange(10, 30)}"])


def _ascii(rng):
    s = _words(rng, rng.randint(1, 12)).capitalize() + rng.choice([".", "!", "?", "", ","])
    return s if rng.random() < 0.5 else f"{s} {_number(rng)} {_words(rng, 3)}"


def _unicode(rng):
    return rng.choice(["", " "]).join(rng.choice(UNICODE + WORDS) for _ in range(rng.randint(1, 8)))


def _code(rng):
    return rng.choice(CODE) + (rng.choice(CODE) if rng.random() < 0.3 else "")


def _whitespace(rng):
    parts = [rng.choice([_words(rng, 1), _number(rng), rng.choice(UNICODE)]) for _ in range(rng.randint(1, 5))]
    return "".join(p + rng.choice(WHITESPACE) for p in parts)


def _chat(rng):
    turns = []
    for _ in range(rng.randint(1, 3)):
        body = rng.choice([_ascii, _unicode, _code, _whitespace])(rng)
        turns.append(f"<|im_start|>{rng.choice(ROLES)}\n{body}<|im_end|>\n")
    return "".join(turns) + (rng.choice(SPECIALS) if rng.random() < 0.3 else "")


def _random_codepoints(rng):
    out = []
    for _ in range(rng.randint(1, 20)):
        cp = rng.choice([rng.randrange(0x20, 0x7F), rng.randrange(0xA0, 0x2FF), rng.randrange(0x4E00, 0x4FFF),
                         rng.randrange(0x1F300, 0x1F64F), rng.randrange(0x0600, 0x06FF), rng.randrange(0, 0x20)])
        out.append(chr(cp))
    return "".join(out)


KINDS = (_ascii, _unicode, _code, _whitespace, _chat, _random_codepoints)
EDGE = ["", " ", "\n", "a", "a  123", "a\n\n1", "\t\t7", "x 1", "  42\n", "Hello world", " Hello", "hello ", "<|im_start|>",
        "<|im_start|><|im_end|>", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "text<|endoftext|>more"]


def corpus(n: int = 1000, seed: int = 0) -> list[str]:
    """`n` strings: the edge cases, then equal shares of each kind."""
    rng = random.Random(seed)
    out = list(EDGE)
    while len(out) < n:
        out.append(KINDS[len(out) % len(KINDS)](rng))
    return out[:n]


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello!"},
     {"role": "assistant", "content": "Bonjour !"}, {"role": "user", "content": "Ça va ? 😀"}],
    [{"role": "user", "content": "def f(x):\n    return x\n\nExplain."}, {"role": "assistant", "content": "It returns x."},
     {"role": "user", "content": "  and  12  spaces?  "}],
    [{"role": "user", "content": "日本語で答えて"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "…"}],
]
"""Chat-message prompts, with and without a system message, several turns, empty and Unicode content."""
