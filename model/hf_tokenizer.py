"""Hugging Face tokenizers for real checkpoints: a local tokenizer directory or the tokenizer inside a GGUF file.

Runtime dependencies are `tokenizers`, `jinja2` and `gguf` (header constants); never transformers, whose
outputs the tests compare against (tests/unit/test_hf_tokenizer*.py). `load_hf_tokenizer(path)` returns an
`HFTokenizer` (the `Tokenizer` protocol of model/tokenizer.py), cached per file and modification time so
that `rl validate` builds it once.

Directory: `tokenizer.json` (a fast tokenizer: the only format read) and what transformers reads beside
it: `tokenizer_config.json` and `special_tokens_map.json` for the bos/eos/pad/unk tokens, `add_bos_token`
and `chat_template`; `chat_template.jinja` (newer transformers write the template there; it wins);
`generation_config.json` for more eos ids (`eos_token_id` may be a list), `bos/pad_token_id` when the
tokenizer names none, and `stop_strings`. Without `add_bos_token`, BOS is added when the tokenizer's own
post-processor adds it.

GGUF: the `tokenizer.ggml.*` metadata rebuilt as transformers' GGUF converter does for byte-level BPE
(`tokenizer.ggml.model == "gpt2"`): GPT-2's byte alphabet (a token spelled outside it is respelled from its
UTF-8 bytes), BPE over the file's merges, control tokens (type 3) as special added tokens, user-defined
ones (type 4) as plain added tokens, a ByteLevel decoder, and a pre-tokenizer chosen by
`tokenizer.ggml.pre` (`_PRE_TOKENIZERS`). One deliberate departure: "smollm" (also "starcoder", "refact")
splits digits one by one before the GPT-2 regex, as llama.cpp does and as SmolLM2's own tokenizer.json
does; transformers 5.x has no entry for it and falls back to the plain GPT-2 regex, which differs when a
run of whitespace precedes a digit ("a\\n\\n1"). Other tokenizer models (SentencePiece "llama", "t5", ...)
and unknown pre-tokenizers are refused with one line: a silently different split would train the model on
ids it never saw. eos ids are `eos_token_id` plus llama.cpp's end-of-turn/-message ids when present.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from configbase.jsonfile import loads as bounded_json
from model.chat_template import ChatTemplateError, render_chat_template
from model.gguf_metadata import read_gguf_metadata


class HFTokenizer:
    """A `tokenizers.Tokenizer` with the special ids, BOS rule and chat template of its checkpoint."""

    def __init__(self, backend: Backend, *, eos_ids: Sequence[int], bos_id: int | None, pad_id: int | None, add_bos: bool,
                 chat_template: str | None, special_tokens: Mapping[str, str], stop_strings: Sequence[str] = (),
                 source: str = ""):
        self.backend, self.source = backend, source
        self._vocab_size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        if not eos_ids:
            raise ValueError(f"{source}: the tokenizer names no eos token")
        self.eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids))
        self.eos_id = self.eos_ids[0]
        self.bos_id = bos_id
        self.pad_id = self.eos_id if pad_id is None else pad_id
        self.add_bos = bool(add_bos and bos_id is not None)
        for what, ids in (("eos", self.eos_ids), ("bos", () if bos_id is None else (bos_id,)), ("pad", (self.pad_id,))):
            bad = [i for i in ids if not 0 <= i < self._vocab_size]
            if bad:
                raise ValueError(f"{source}: {what} id {bad[0]} is outside the vocabulary of {self._vocab_size} ids")
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)
        self.stop_strings = tuple(stop_strings)
        """Texts that end a response (generation_config.json); the engine does not act on them yet."""

    @property
    def vocab_size(self) -> int:
        """Highest id + 1 (added tokens included): the policy's embedding needs at least this many rows."""
        return self._vocab_size

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Ids of `text`; special tokens written in the text (e.g. "<|im_start|>") become their ids, and a byte the
        vocabulary has no token for is dropped (SmolLM2 lacks a few control characters), both as in transformers."""
        try:
            ids = self.backend.encode(text, add_special_tokens=False).ids
        except (TypeError, ValueError, UnicodeError) as e:  # e.g. a lone surrogate, which is not UTF-8
            raise ValueError(f"cannot encode text with the {self.source} tokenizer: {str(e).splitlines()[0]}") from None
        return ([self.bos_id] if bos and self.bos_id is not None else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; special tokens and ids past the vocabulary (padded embedding rows) decode to nothing."""
        n = self._vocab_size
        return self.backend.decode([int(i) for i in ids if 0 <= i < n], skip_special_tokens=True)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ChatTemplateError(f"the {self.source} tokenizer has no chat template; give prompts as text")
        try:
            return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                        special_tokens=self.special_tokens)
        except ChatTemplateError as e:  # named: which checkpoint's template misbehaves
            raise ChatTemplateError(f"the chat template of {self.source}: {str(e).removeprefix('chat template: ')}") from None

    def save_hf_files(self, directory: str | Path) -> None:
        """Write this tokenizer as Hugging Face tokenizer files (tokenizer.json, tokenizer_config.json with
        the special tokens, the BOS rule and the chat template) into `directory`: what an export of a run
        started from a GGUF file carries, so that transformers' AutoTokenizer reads the same tokenizer."""
        d = Path(directory)
        self.backend.save(str(d / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": self.add_bos, "add_eos_token": False,
                  "clean_up_tokenization_spaces": False, **self.special_tokens}
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))

    def __repr__(self) -> str:
        return (f"HFTokenizer({self.source!r}, vocab_size={self._vocab_size}, eos_ids={self.eos_ids}, bos_id={self.bos_id}, "
                f"pad_id={self.pad_id}, add_bos={self.add_bos})")


def load_hf_tokenizer(path: str | Path) -> HFTokenizer:
    """The tokenizer of a Hugging Face directory or a .gguf file; one-line ValueError when it cannot be built."""
    p = Path(path).expanduser()
    if p.is_dir():
        files = [f for f in (p / n for n in _DIR_FILES) if f.is_file()]
        if not (p / "tokenizer.json").is_file():
            raise ValueError(f"{p}: no tokenizer.json (asyncrl reads fast tokenizers: save one with transformers' "
                             "save_pretrained, or point at the model's .gguf file)")
        stamp = tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in files)
        return _cached(str(p.resolve()), stamp)
    if p.is_file():
        st = p.stat()
        return _cached(str(p.resolve()), ((p.name, st.st_mtime_ns, st.st_size),))
    raise ValueError(f"tokenizer path {str(p)!r} does not exist (a Hugging Face tokenizer directory or a .gguf file)")


@lru_cache(maxsize=16)
def _cached(path: str, stamp: tuple) -> HFTokenizer:  # `stamp`: a changed file is read again
    p = Path(path)
    return _from_dir(p) if p.is_dir() else _from_gguf(p)


# -- a Hugging Face directory ---------------------------------------------------------------------------
_DIR_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
              "chat_template.jinja", "chat_template.json")
_NAMED = ("bos_token", "eos_token", "unk_token", "pad_token")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        out = bounded_json(path.read_text(encoding="utf-8"))  # nesting bounded: one line, not RecursionError
    except (OSError, UnicodeError, ValueError) as e:
        raise ValueError(f"{path}: not readable JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(out, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return out


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # AddedToken as transformers serialises it
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise ValueError(f"expected a token id or a list of ids, got {value!r}")


def _from_dir(d: Path) -> HFTokenizer:
    try:
        backend = Backend.from_file(str(d / "tokenizer.json"))
    except Exception as e:  # the Rust side raises its own exception type for a malformed file
        raise ValueError(f"{d / 'tokenizer.json'}: not a tokenizers file ({str(e).splitlines()[0]})") from None
    config, special_map = _read_json(d / "tokenizer_config.json"), _read_json(d / "special_tokens_map.json")
    generation = _read_json(d / "generation_config.json")
    named = {k: _token_text(config.get(k)) or _token_text(special_map.get(k)) for k in _NAMED}

    def id_of(key: str) -> int | None:
        if named[key] is None:
            return None
        i = backend.token_to_id(named[key])
        if i is None:
            raise ValueError(f"{d}: {key} {named[key]!r} is not in the vocabulary")
        return i

    try:
        gen_eos, gen_bos, gen_pad = (_ids(generation.get(k)) for k in ("eos_token_id", "bos_token_id", "pad_token_id"))
    except ValueError as e:
        raise ValueError(f"{d / 'generation_config.json'}: {e}") from None
    eos = id_of("eos_token")
    bos = id_of("bos_token")
    bos = bos if bos is not None else (gen_bos[0] if gen_bos else None)
    pad = id_of("pad_token")
    pad = pad if pad is not None else (gen_pad[0] if gen_pad else None)
    add_bos = config.get("add_bos_token")
    if not isinstance(add_bos, bool):  # no explicit flag: whatever the tokenizer's own post-processor does
        add_bos = bos is not None and backend.encode("a", add_special_tokens=True).ids[:1] == [bos]
    stops = generation.get("stop_strings") or ()
    stops = (stops,) if isinstance(stops, str) else tuple(s for s in stops if isinstance(s, str))
    return HFTokenizer(backend, eos_ids=([eos] if eos is not None else []) + gen_eos, bos_id=bos, pad_id=pad, add_bos=add_bos,
                       chat_template=_dir_chat_template(d, config), special_tokens={k: v for k, v in named.items() if v},
                       stop_strings=stops, source=str(d))


def _dir_chat_template(d: Path, config: dict) -> str | None:
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(d / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(f"{d}: several chat templates ({', '.join(map(str, named))}) and none named 'default'")
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{d}: chat_template is not a string")
    return template


# -- a GGUF file -----------------------------------------------------------------------------------------
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the rest map to code points 256 and up."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(extra)}}


_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _byte_level(split: str | None = None, digits: bool = False) -> pre_tokenizers.PreTokenizer:
    if split is not None:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2]) if digits else gpt2


_PRE_TOKENIZERS = {
    **dict.fromkeys(("default", "gpt2"), {}),
    **dict.fromkeys(("smollm", "starcoder", "refact"), {"digits": True}),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx"), {"split": _LLAMA3}),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), {"split": _QWEN2}),
}
"""`tokenizer.ggml.pre` -> how text is split before BPE (the regexes are llama.cpp's and transformers')."""

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _from_gguf(path: Path) -> HFTokenizer:
    meta = read_gguf_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: GGUF tokenizer model {kind!r} is not supported (asyncrl builds byte-level BPE, 'gpt2'; "
                         "point tokenizer.path at the model's Hugging Face directory instead)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"{path}: GGUF pre-tokenizer {pre!r} is not supported (known: {', '.join(sorted(_PRE_TOKENIZERS))})")
    tokens, merges = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.merges") or []
    types = meta.get("tokenizer.ggml.token_type") or []
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{path}: GGUF has no tokenizer.ggml.tokens")
    pairs = [tuple(m.split(" ")) for m in merges] if all(isinstance(m, str) for m in merges) else [()]
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"{path}: GGUF tokenizer.ggml.merges holds an entry that is not two tokens")

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)}
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                                 fuse_unk=False))
    backend.pre_tokenizer = _byte_level(**_PRE_TOKENIZERS[pre])
    backend.decoder = decoders.ByteLevel()

    def special_id(key: str) -> int | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is None:
            return None
        if not isinstance(i, int) or not 0 <= i < len(tokens):
            raise ValueError(f"{path}: GGUF {key} {i!r} is outside its {len(tokens)} tokens")
        return i

    ids = {k: special_id(f"{k}_token_id") for k in ("bos", "eos", "unknown", "padding", "eot", "eom")}
    named = {"bos_token": ids["bos"], "eos_token": ids["eos"], "unk_token": ids["unknown"], "pad_token": ids["padding"]}
    control = [t for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= alphabet]
    control += [tokens[i] for i in named.values() if i is not None]  # transformers makes the named ones special too
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(control)])
    user = [t for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    template = meta.get("tokenizer.chat_template")
    return HFTokenizer(backend, eos_ids=[i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None], bos_id=ids["bos"],
                       pad_id=ids["padding"], add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                       chat_template=template if isinstance(template, str) else None,
                       special_tokens={k: tokens[i] for k, i in named.items() if i is not None}, source=str(path))
