"""Tokenizers and datasets. Nothing here downloads: corpora are built from local text."""

from raypipe.data.corpus import stdlib_corpus
from raypipe.data.dataset import TokenDataset
from raypipe.data.tokenizer import ByteTokenizer
from raypipe.data.tokens import read_tokens, write_tokens

__all__ = ["ByteTokenizer", "TokenDataset", "read_tokens", "stdlib_corpus", "write_tokens"]
