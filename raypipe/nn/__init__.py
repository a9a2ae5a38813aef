"""Tensor-parallel building blocks (parallel layers, split styles and `parallelize`), the
mixture-of-experts layer that expert parallelism splits (`MoE`), and a cross-entropy for large
vocabularies (`chunked_cross_entropy`)."""

from raypipe.nn.cross_entropy import chunked_cross_entropy
from raypipe.nn.group import TensorParallelGroup, current
from raypipe.nn.moe import ExpertMLP, ExpertParallelGroup, MoE
from raypipe.nn.plan import ColumnParallel, RowParallel, VocabParallel, parallelize, shard_specs
from raypipe.nn.shard import ShardSpec, merge, shard
from raypipe.nn.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

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
    "chunked_cross_entropy",
    "current",
    "merge",
    "parallelize",
    "shard",
    "shard_specs",
]
