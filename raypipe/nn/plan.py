"""Turning a plain module into its tensor-parallel shard: `parallelize(module, tp)`.

A layer says how it splits by a `tp_plan(tp_size)` method (or a `tp_plan` dict)
mapping submodule names to styles, in the spirit of torch's `parallelize_module`:

    def tp_plan(self, tp_size):
        return {"attn.c_attn": ColumnParallel(chunks=3), "attn.c_proj": RowParallel(),
                "mlp.c_fc": ColumnParallel(), "mlp.c_proj": RowParallel()}

The layer is built whole under its seed, then the named submodules are swapped for
their parallel twins holding this rank's shard, so the weights are those of the
dense model whatever tp is. Submodules outside the plan are replicated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from raypipe.core.errors import ConfigError
from raypipe.nn.group import TensorParallelGroup
from raypipe.nn.shard import ShardSpec
from raypipe.nn.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


@dataclass(frozen=True)
class ColumnParallel:
    """Split an nn.Linear's output features (`chunks=3` for a fused q/k/v projection)."""

    chunks: int = 1
    gather_output: bool = False

    def apply(self, module: nn.Module, tp: TensorParallelGroup) -> nn.Module:
        return ColumnParallelLinear.from_dense(_expect(module, nn.Linear, self), tp, self.gather_output, self.chunks)


@dataclass(frozen=True)
class RowParallel:
    """Split an nn.Linear's input features; its input must be a column-parallel output."""

    def apply(self, module: nn.Module, tp: TensorParallelGroup) -> nn.Module:
        return RowParallelLinear.from_dense(_expect(module, nn.Linear, self), tp)


@dataclass(frozen=True)
class VocabParallel:
    """Split an nn.Embedding's rows (its vocabulary)."""

    def apply(self, module: nn.Module, tp: TensorParallelGroup) -> nn.Module:
        return VocabParallelEmbedding.from_dense(_expect(module, nn.Embedding, self), tp)


def tp_plan_of(module: nn.Module, tp_size: int) -> dict[str, Any]:
    """The module's plan for `tp_size` ranks ({} when it declares none)."""
    plan = getattr(module, "tp_plan", None)
    if plan is None:
        return {}
    return dict(plan(tp_size) if callable(plan) else plan)


def parallelize(module: nn.Module, tp: TensorParallelGroup) -> nn.Module:
    """Replaces the submodules named in the module's tp plan with this rank's parallel shards."""
    if tp.size == 1:
        return module
    for name, style in tp_plan_of(module, tp.size).items():
        parent_name, _, child = name.rpartition(".")
        try:
            parent = module.get_submodule(parent_name) if parent_name else module
            target = getattr(parent, child)
        except AttributeError:
            raise ConfigError(
                f"{type(module).__name__}.tp_plan names {name!r}, which is not a submodule; "
                f"names look like {[n for n, _ in module.named_modules() if n][:4]}."
            ) from None
        setattr(parent, child, style.apply(target, tp))
    return module


def shard_specs(module: nn.Module) -> dict[str, ShardSpec]:
    """State-dict key -> ShardSpec for every split tensor of `module` (replicated ones are absent)."""
    specs = {}
    for prefix, sub in module.named_modules():
        if hasattr(sub, "shard_specs") and callable(sub.shard_specs):
            for name, spec in sub.shard_specs().items():
                specs[f"{prefix}.{name}" if prefix else name] = spec
    return specs


def check_tensor_parallel(specs: Sequence[Any], tp_size: int) -> list[bool | None]:
    """Splits every layer on the meta device, so a tp that does not fit fails before any actor starts.

    Returns, per layer, whether it declares a tp plan (None where it cannot be built on the meta
    device, so the actor will tell); all True when tp_size is 1.
    """
    if tp_size == 1:
        return [True] * len(specs)
    splits: list[bool | None] = []
    for index, spec in enumerate(specs):
        try:
            with torch.device("meta"):
                module = spec.build()
                splits.append(bool(tp_plan_of(module, tp_size)))
                parallelize(module, TensorParallelGroup(0, tp_size))
        except ConfigError as error:
            raise ConfigError(f"layer {index} ({spec!r}) cannot be split for tensor parallelism: {error}") from None
        except Exception:  # a constructor that needs real tensors: the actor will report it
            splits.append(None)
    return splits


def check_stages_split(splits: Sequence[bool | None], plan: Sequence[tuple[int, int]], tp_size: int) -> None:
    """Refuses a plan in which no layer of some stage has a tp plan: its tp ranks would each
    hold and run the same whole layers, tp times the actors for nothing.

    Raises:
        ConfigError: naming the first such stage, its layers and how to add a plan.
    """
    if tp_size == 1:
        return
    for stage, (start, end) in enumerate(plan):
        if all(split is False for split in splits[start:end]):
            raise ConfigError(
                f"tp={tp_size}, but no layer of stage {stage} (layers [{start}, {end})) declares a tp_plan, so "
                f"each of its {tp_size} tensor-parallel actors would hold and run the same whole layers. Give a "
                f"layer of that stage a `tp_plan(self, tp_size)` method returning the submodules to split, e.g. "
                f"{{'fc1': ColumnParallel(), 'fc2': RowParallel()}} (raypipe.nn), move such a layer into the stage "
                f"(shard_plan), or set tp=1."
            )


def _expect(module: nn.Module, kind: type, style: Any) -> Any:
    if type(module) is not kind:
        raise ConfigError(f"{style} applies to {kind.__name__}, got {type(module).__name__}.")
    return module
