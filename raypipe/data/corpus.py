"""The default corpus: the Python standard library's own source, present on every machine."""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from pathlib import Path

from raypipe.core import env
from raypipe.data.tokenizer import ByteTokenizer
from raypipe.data.tokens import write_tokens


def stdlib_sources(max_bytes: int) -> list[Path]:
    """Sorted stdlib .py files (tests and site-packages left out) totalling about max_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chosen, total = [], 0
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts)
        if parts & {"site-packages", "test", "tests", "idle_test", "__pycache__"}:
            continue
        chosen.append(path)
        total += path.stat().st_size
        if total >= max_bytes:
            break
    return chosen


def stdlib_corpus(max_bytes: int = 4_000_000, cache_dir: str | Path | None = None) -> Path:
    """Builds (once) a uint16 token file of the stdlib's source, byte-tokenized.

    The file is cached under RAYPIPE_CACHE_DIR, named by the Python version and size,
    so the main job and the tests build it once per machine.
    """
    cache = Path(cache_dir) if cache_dir is not None else env.cache_dir()
    key = hashlib.sha256(f"{sys.version}|{max_bytes}".encode()).hexdigest()[:12]
    path = cache / f"stdlib-{max_bytes}-{key}.bin"
    if path.exists():
        return path
    tokenizer = ByteTokenizer()
    ids: list[int] = []
    for source in stdlib_sources(max_bytes):
        ids.extend(tokenizer.encode(source.read_text(encoding="utf-8", errors="replace")))
        ids.append(ord("\n"))
    return write_tokens(path, ids[:max_bytes])
