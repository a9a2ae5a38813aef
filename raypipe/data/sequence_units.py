"""A step's microbatches cut along the sequence into the units sequence-chunked schedules run
(`TrainConfig.sequence_chunks`): unit u is chunk u % k of microbatch u // k, and weighs in the
loss by the tokens its targets count, so the step's loss and gradients stay the whole batch's."""

from __future__ import annotations

import dataclasses

import torch
import torch.utils._pytree as pytree

from raypipe.core.errors import BatchError
from raypipe.core.layers import LossFunction
from raypipe.data.batches import Prepared, is_varying
from raypipe.nn.cross_entropy import IGNORE


def sequence_units(batch: Prepared, chunks: int, loss_fn: LossFunction) -> Prepared:
    """`batch` with each microbatch cut into `chunks` units along dim 1 (the sequence) of every
    tensor as long as its first tensor's sequence; targets too, one token longer where the loss
    shifts labels itself (`loss_fn.shifts_labels`, transformers' causal-LM loss).

    Raises:
        BatchError: a batch already packed by a dataset reader, or sequences shorter than `chunks`.
    """
    if batch.inputs is None or batch.targets is None:
        raise BatchError(
            "sequence_chunks cuts each microbatch on the driver, but this batch was packed by a dataset "
            "reader: feed the trainer batches (or a function of the step), or use sequence_chunks=1."
        )
    inputs, targets, weights = [], [], []
    for r, (xs, ys) in enumerate(zip(batch.inputs, batch.targets)):
        xs_cut, ys_cut, ws = [], [], []
        for m, (x, y) in enumerate(zip(xs, ys)):
            units, unit_targets, counts = cut_microbatch(x, y, chunks, loss_fn, m)
            xs_cut += units
            ys_cut += unit_targets
            total = sum(counts)
            share = batch.weights[r][m] if batch.weights is not None else 1.0
            ws += [share * chunks * c / total if total else 0.0 for c in counts]
        inputs.append(xs_cut)
        targets.append(ys_cut)
        weights.append(ws)
    varying = batch.varying or is_varying([x for replica in inputs for x in replica])  # unequal chunks
    return dataclasses.replace(batch, inputs=inputs, targets=targets, weights=weights, varying=varying)


def cut_microbatch(
    x: object, y: object, chunks: int, loss_fn: LossFunction, m: int = 0
) -> tuple[list, list, list[float]]:
    """Microbatch `m`'s input and target cut into `chunks` units, and the tokens each unit's loss
    averages over (`sequence_units`; the profiler times layers on such units). transformers' inputs
    (a dict with `input_ids`) also carry, in each unit, one past their largest position
    (`sequence_end`, a 0-dim tensor).

    Raises:
        BatchError: sequences shorter than `chunks`.
    """
    overlap = 1 if getattr(loss_fn, "shifts_labels", False) else 0
    length = sequence_length(x)
    if length < chunks:
        raise BatchError(
            f"microbatch {m} holds sequences of {length} tokens, fewer than sequence_chunks={chunks}: "
            f"use sequence_chunks <= {length}."
        )
    bounds = [int(b[0]) for b in torch.arange(length).tensor_split(chunks)] + [length]
    units = [_cut(x, length, a, b) for a, b in zip(bounds, bounds[1:])]
    if isinstance(x, dict) and "input_ids" in x:  # transformers' inputs: each unit carries its sequence's end
        end = _sequence_end(x, length)
        units = [{**unit, "sequence_end": end} for unit in units]
    targets = [_cut(y, length, a, b + (overlap if b < length else 0)) for a, b in zip(bounds, bounds[1:])]
    return units, targets, [_count(loss_fn, t, overlap) for t in targets]


def sequence_length(x: object) -> int:
    """The sequence length of a microbatch's input: dim 1 of its first tensor, which holds token ids
    (batch, sequence) or vectors (batch, sequence, features)."""
    first = next((t for t in pytree.tree_leaves(x) if torch.is_tensor(t)), None)
    if first is None or first.dim() < 2 or (first.is_floating_point() and first.dim() == 2):
        shape = tuple(first.shape) if first is not None else None
        raise BatchError(
            f"sequence_chunks cuts inputs along the sequence (dim 1), but the input's first tensor has shape {shape}: "
            f"give token ids (batch, sequence) or vectors (batch, sequence, features), or use sequence_chunks=1."
        )
    return int(first.shape[1])


def _sequence_end(x: dict, length: int) -> torch.Tensor:
    """One past the largest position of transformers' inputs `x`, as its forward finds it (its
    position ids, or the sequence numbered from 0): where a rotary embedding that follows the
    length (`models.hf.rope`) sets its frequencies for every chunk."""
    positions = x.get("position_ids")
    return torch.tensor(int(positions.max()) + 1 if torch.is_tensor(positions) else length)


def _cut(value: object, length: int, start: int, end: int) -> object:
    """`value`'s tensors as long as the sequence, cut to [start, end) along dim 1 (cloned: a view
    would carry the whole sequence's storage to the actors); the others whole."""

    def cut(t: object) -> object:
        if torch.is_tensor(t) and t.dim() >= 2 and t.shape[1] == length:
            return t[:, start:end].clone()
        return t

    return pytree.tree_map(cut, value)


def _count(loss_fn: LossFunction, target: object, overlap: int) -> float:
    """The tokens a unit's loss averages over: `loss_fn.count` where it has one, else its integer
    targets not ignored, else its length."""
    count = getattr(loss_fn, "count", None)
    if count is not None:
        return float(count(target))
    leaves = [t for t in pytree.tree_leaves(target) if torch.is_tensor(t) and t.dim() >= 2]
    if leaves and not leaves[0].is_floating_point():
        return float((leaves[0][:, overlap:] != IGNORE).sum())
    return float(leaves[0].shape[1] - overlap) if leaves else 1.0
