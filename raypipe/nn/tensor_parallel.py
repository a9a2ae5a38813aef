"""Tensor-parallel layers in the Megatron pattern.

Each layer holds one rank's shard of the weights of a dense twin and computes that
rank's share; the collectives in `group.py` put the pieces together. Every layer
can be built two ways: directly (`ColumnParallelLinear(512, 2048)` inside a stage
actor builds the dense layer under the current RNG and keeps its shard, so the
weights equal those of the dense model built with the same seed) or from an
existing dense layer (`ColumnParallelLinear.from_dense(linear, tp)`), which is how
`parallelize` converts a plain model. `shard_specs()` tells state_dict and
checkpoints how to merge the shards back into the dense tensors.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from raypipe.core.errors import ConfigError
from raypipe.nn.group import (
    TensorParallelGroup,
    copy_to_group,
    current,
    gather_from_group,
    reduce_from_group,
)
from raypipe.nn.shard import ShardSpec, shard


class ColumnParallelLinear(nn.Module):
    """A linear layer whose output features are split across the tp ranks.

    The input is the full activation on every rank; the output is this rank's slice of
    the features (or, with `gather_output=True`, all of them). Backward all-reduces the
    input gradient. `chunks=3` splits each third separately (a fused q/k/v projection),
    so each rank keeps whole heads of q, k and v.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        chunks: int = 1,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self._init_from(nn.Linear(in_features, out_features, bias=bias), tp or current(), gather_output, chunks)

    @classmethod
    def from_dense(
        cls, linear: nn.Linear, tp: TensorParallelGroup, gather_output: bool = False, chunks: int = 1
    ) -> ColumnParallelLinear:
        layer = _bare(cls)
        layer._init_from(linear, tp, gather_output, chunks)
        return layer

    def _init_from(self, linear: nn.Linear, tp: TensorParallelGroup, gather_output: bool, chunks: int) -> None:
        self.tp, self.gather_output, self.chunks = tp, gather_output, chunks
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.spec = ShardSpec(0, chunks)
        self.spec.check(
            f"ColumnParallelLinear({linear.in_features}, {linear.out_features}) output", linear.weight.shape, tp.size
        )
        self.weight = nn.Parameter(
            shard(linear.weight.detach(), self.spec, tp.rank, tp.size), requires_grad=linear.weight.requires_grad
        )
        self.bias = (
            nn.Parameter(shard(linear.bias.detach(), self.spec, tp.rank, tp.size)) if linear.bias is not None else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_group(x, self.tp), self.weight, self.bias)
        return gather_from_group(y, self.tp) if self.gather_output else y

    def shard_specs(self) -> dict[str, ShardSpec]:
        return {"weight": self.spec, **({"bias": self.spec} if self.bias is not None else {})}

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(this rank: {self.weight.shape[0]}), tp={self.tp.rank}/{self.tp.size}, "
            f"chunks={self.chunks}, gather_output={self.gather_output}"
        )


class RowParallelLinear(nn.Module):
    """A linear layer whose input features are split across the tp ranks.

    Takes this rank's slice of the input (what a ColumnParallelLinear produces) and
    all-reduces the partial products in forward; the bias, kept whole on every rank,
    is added once after the sum.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, tp: TensorParallelGroup | None = None
    ) -> None:
        super().__init__()
        self._init_from(nn.Linear(in_features, out_features, bias=bias), tp or current())

    @classmethod
    def from_dense(cls, linear: nn.Linear, tp: TensorParallelGroup) -> RowParallelLinear:
        layer = _bare(cls)
        layer._init_from(linear, tp)
        return layer

    def _init_from(self, linear: nn.Linear, tp: TensorParallelGroup) -> None:
        self.tp = tp
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.spec = ShardSpec(1)
        self.spec.check(
            f"RowParallelLinear({linear.in_features}, {linear.out_features}) input", linear.weight.shape, tp.size
        )
        self.weight = nn.Parameter(
            shard(linear.weight.detach(), self.spec, tp.rank, tp.size), requires_grad=linear.weight.requires_grad
        )
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_group(F.linear(x, self.weight), self.tp)
        return y + self.bias if self.bias is not None else y

    def shard_specs(self) -> dict[str, ShardSpec]:
        return {"weight": self.spec}

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (this rank: {self.weight.shape[1]}), "
            f"out_features={self.out_features}, tp={self.tp.rank}/{self.tp.size}"
        )


class VocabParallelEmbedding(nn.Module):
    """An embedding table whose rows (the vocabulary) are split across the tp ranks.

    Each rank looks up the ids it holds, writes zeros for the others, and the forward
    all-reduce puts every row in place; each rank's table gets gradients for its rows only.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self._init_from(nn.Embedding(num_embeddings, embedding_dim), tp or current())

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, tp: TensorParallelGroup) -> VocabParallelEmbedding:
        layer = _bare(cls)
        layer._init_from(embedding, tp)
        return layer

    def _init_from(self, embedding: nn.Embedding, tp: TensorParallelGroup) -> None:
        unsupported = [k for k in ("padding_idx", "max_norm") if getattr(embedding, k) is not None]
        if unsupported or embedding.sparse or embedding.scale_grad_by_freq:
            raise ConfigError(
                f"VocabParallelEmbedding cannot split {embedding}: padding_idx, max_norm, sparse and "
                f"scale_grad_by_freq are not supported; leave this embedding out of the layer's tp_plan."
            )
        self.tp = tp
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.spec = ShardSpec(0)
        self.spec.check(
            f"VocabParallelEmbedding({self.num_embeddings}, {self.embedding_dim}) vocabulary",
            embedding.weight.shape,
            tp.size,
        )
        rows = self.num_embeddings // tp.size
        self.first, self.end = tp.rank * rows, (tp.rank + 1) * rows
        self.weight = nn.Parameter(
            shard(embedding.weight.detach(), self.spec, tp.rank, tp.size), requires_grad=embedding.weight.requires_grad
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.first) | (ids >= self.end)
        local = (ids - self.first).masked_fill(outside, 0)
        y = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_group(y, self.tp)

    def shard_specs(self) -> dict[str, ShardSpec]:
        return {"weight": self.spec}

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.first}, {self.end}) "
            f"on tp={self.tp.rank}/{self.tp.size}"
        )


def _bare(cls: type) -> nn.Module:
    """An instance of `cls` with nn.Module set up but its own __init__ skipped (for from_dense)."""
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    return layer
