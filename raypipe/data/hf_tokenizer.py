"""raypipe's byte tokenizer as a transformers tokenizer, so a model trained on byte tokens
(the main job's data) is exported with a tokenizer `AutoTokenizer` loads: id i is byte i."""

from __future__ import annotations


def byte_tokenizer() -> object:
    """A `PreTrainedTokenizerFast` whose ids are the UTF-8 bytes (as `ByteTokenizer`'s)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = _bytes_to_unicode()
    tokenizer = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level tokenizers name tokens by."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars
