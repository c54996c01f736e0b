"""Character-level tokenizer for the synthetic tasks (pure Python).

Ids: 0 <pad>, 1 <bos>, 2 <eos>, 3 newline, then printable ASCII 32..126 (95 characters): 99 ids.
Any text made of printable ASCII and newlines round-trips exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_CHARS = "\n" + "".join(chr(c) for c in range(32, 127))


class CharTokenizer:
    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID

    def __init__(self) -> None:
        self._offset = 3
        self._to_id = {ch: i + self._offset for i, ch in enumerate(_CHARS)}

    @property
    def vocab_size(self) -> int:
        return self._offset + len(_CHARS)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        try:
            ids = [self._to_id[ch] for ch in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the char tokenizer's vocabulary") from None
        return ([BOS_ID] if bos else []) + ids + ([EOS_ID] if eos else [])

    def decode(self, ids: Sequence[int]) -> str:
        """Special tokens decode to nothing; ids are assumed to be < vocab_size."""
        off = self._offset
        return "".join(_CHARS[i - off] for i in ids if i >= off)
