"""Token datasets with a reproducible data order: batch `k` depends only on (seed, k)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from raypipe.data.tokenizer import ByteTokenizer
from raypipe.data.tokens import read_tokens


class TokenDataset:
    """Random windows of `block_size + 1` tokens from one long token array.

    `batch(step, ...)` draws its windows from a generator seeded by `(seed, step)`,
    so the data a step sees does not depend on what ran before it, which makes runs
    resumable at any step with the same data order.
    """

    def __init__(self, tokens: np.ndarray | Sequence[int], block_size: int) -> None:
        self.tokens = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens, dtype=np.uint16)
        self.block_size = block_size
        if len(self.tokens) <= block_size + 1:
            raise ValueError(
                f"the dataset has {len(self.tokens)} tokens; it needs more than block_size + 1 = {block_size + 1}"
            )

    @classmethod
    def from_bin(cls, path: str | Path, block_size: int) -> TokenDataset:
        return cls(read_tokens(path), block_size)

    @classmethod
    def from_text_files(cls, paths: Iterable[str | Path], block_size: int) -> TokenDataset:
        tokenizer = ByteTokenizer()
        ids: list[int] = []
        for path in paths:
            ids.extend(tokenizer.encode(Path(path).read_text(encoding="utf-8", errors="replace")))
        return cls(np.asarray(ids, dtype=np.uint16), block_size)

    def split(self, val_fraction: float) -> tuple[TokenDataset, TokenDataset]:
        """The first (1 - val_fraction) of the tokens for training, the rest for validation."""
        cut = int(len(self.tokens) * (1.0 - val_fraction))
        return TokenDataset(self.tokens[:cut], self.block_size), TokenDataset(self.tokens[cut:], self.block_size)

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, step: int, batch_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs (B, T) and next-token targets (B, T) as int64 tensors."""
        rng = np.random.default_rng([seed, step])
        starts = rng.integers(0, len(self.tokens) - self.block_size - 1, size=batch_size)
        windows = np.stack([np.asarray(self.tokens[s : s + self.block_size + 1], dtype=np.int64) for s in starts])
        data = torch.from_numpy(windows)
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()
