"""Tensor-parallel building blocks (parallel layers, split styles and `parallelize`) and the
mixture-of-experts layer that expert parallelism splits (`MoE`)."""

from raypipe.nn.group import TensorParallelGroup, current
from raypipe.nn.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from raypipe.nn.moe import ExpertMLP, ExpertParallelGroup, MoE
from raypipe.nn.plan import ColumnParallel, RowParallel, VocabParallel, parallelize, shard_specs
from raypipe.nn.shard import ShardSpec, merge, shard

__all__ = [
    "ColumnParallel",
    "ColumnParallelLinear",
    "ExpertMLP",
    "ExpertParallelGroup",
    "MoE",
    "RowParallel",
    "RowParallelLinear",
    "ShardSpec",
    "TensorParallelGroup",
    "VocabParallel",
    "VocabParallelEmbedding",
    "current",
    "merge",
    "parallelize",
    "shard",
    "shard_specs",
]
