"""Tokenizers (pure Python): the `Tokenizer` protocol every tokenizer implements, and the character-level
tokenizer of the synthetic tasks (Hugging Face tokenizers: model/hf_tokenizer.py).

The rest of asyncrl sees a tokenizer only through `Tokenizer`: the driver renders a prompt (text, or
chat messages through `apply_chat_template`), encodes it once, and from then on moves token ids (the
trainer trains on the ids the engine produced, never on re-tokenised text); the engine stops on any of
`eos_ids`; the recipe's vocabulary check reads `vocab_size`. A recipe names its tokenizer by `type`
(`model.config.TokenizerConfig`), whose `build()` returns one of these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_CHARS = "\n" + "".join(chr(c) for c in range(32, 127))


@runtime_checkable
class Tokenizer(Protocol):
    """What asyncrl needs of a tokenizer."""

    pad_id: int
    """Id used to pad batches (never trained on)."""
    bos_id: int | None
    """Id prepended to every prompt when `add_bos` (None: the tokenizer has none)."""
    eos_id: int
    """The end-of-sequence id: appended by `encode(eos=True)`; the first of `eos_ids`."""
    eos_ids: tuple[int, ...]
    """Every id that ends a response (a checkpoint may name several); the engine stops on any of them."""
    add_bos: bool
    """Whether prompts start with `bos_id` (chat templates that write their own BOS say False)."""

    @property
    def vocab_size(self) -> int:
        """Number of ids (highest id + 1); the policy's output head needs a row for each (`Recipe.validate_vocab`)."""
        ...

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Ids of `text`, optionally with BOS first and EOS last; raises ValueError on text it cannot encode."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; special ids decode to nothing."""
        ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        """Chat messages ({"role", "content"}) rendered as the prompt text the model was trained on; with
        `add_generation_prompt` the text ends where the assistant's reply begins."""
        ...


class CharTokenizer:
    """Ids: 0 <pad>, 1 <bos>, 2 <eos>, 3 newline, then printable ASCII 32..126 (95 characters): 99 ids.
    Any text made of printable ASCII and newlines round-trips exactly."""

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID
    eos_ids = (EOS_ID,)
    add_bos = True

    def __init__(self, vocab_size: int | None = None) -> None:
        self._offset = 3
        self._to_id = {ch: i + self._offset for i, ch in enumerate(_CHARS)}
        self._size = vocab_size or self._offset + len(_CHARS)
        if self._size < self._offset + len(_CHARS):
            raise ValueError(f"a char tokenizer has at least {self._offset + len(_CHARS)} ids, not {self._size}")

    @property
    def vocab_size(self) -> int:
        """99, or the padded size it was given: ids past the characters decode to nothing."""
        return self._size

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        try:
            ids = [self._to_id[ch] for ch in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the char tokenizer's vocabulary") from None
        return ([BOS_ID] if bos else []) + ids + ([EOS_ID] if eos else [])

    def decode(self, ids: Sequence[int]) -> str:
        """Special tokens, and the padding ids past the characters, decode to nothing."""
        off, end = self._offset, self._offset + len(_CHARS)
        return "".join(_CHARS[i - off] for i in ids if off <= i < end)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The messages' contents, one per line, roles dropped: a tiny char-level model has no chat format to
        follow, and a one-message prompt renders exactly as its text would. Nothing marks the generation start."""
        return "\n".join(m["content"] for m in messages)
