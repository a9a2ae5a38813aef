"""How a full tensor maps onto tensor-parallel shards, and back.

A `ShardSpec(dim, chunks)` says a tensor is split along `dim`; with `chunks > 1`
the tensor is first cut into that many equal blocks (q, k and v of a fused
attention projection) and each block is split across ranks, so every rank holds
whole heads of each. `shard` and `merge` are exact inverses: this is what lets
`Trainer.state_dict()` and checkpoints hold full tensors whatever tp is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from raypipe.core.errors import ConfigError


@dataclass(frozen=True)
class ShardSpec:
    dim: int
    chunks: int = 1

    def check(self, what: str, shape: Sequence[int], size: int) -> None:
        """Raises ConfigError when `shape` does not split evenly into `size` ranks."""
        length = shape[self.dim]
        if length % (self.chunks * size):
            blocks = f" in {self.chunks} blocks" if self.chunks > 1 else ""
            raise ConfigError(
                f"{what} has {length} rows along dim {self.dim}, which do not split{blocks} across "
                f"TrainConfig.tp={size} ranks: use a tp that divides {length // self.chunks}."
            )


def shard(full: torch.Tensor, spec: ShardSpec, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s shard of `full` (a copy, contiguous)."""
    blocks = full.chunk(spec.chunks, dim=spec.dim)
    return torch.cat([b.chunk(size, dim=spec.dim)[rank] for b in blocks], dim=spec.dim).contiguous()


def merge(shards: Sequence[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """The full tensor from every rank's shard, in rank order."""
    per_rank = [s.chunk(spec.chunks, dim=spec.dim) for s in shards]
    return torch.cat([r[c] for c in range(spec.chunks) for r in per_rank], dim=spec.dim)
