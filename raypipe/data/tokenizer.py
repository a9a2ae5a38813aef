"""A byte-level tokenizer: every UTF-8 byte is a token, so any text encodes with 256 ids."""

from __future__ import annotations

from collections.abc import Iterable


class ByteTokenizer:
    """Encodes text as its UTF-8 bytes; decodes ids back, replacing broken sequences."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
