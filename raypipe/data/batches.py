"""Cutting a batch into the parts a step needs (dp replicas x microbatches), with an error
that says which sizes work; whether those parts differ in shape; and each part's share of
a loss that counts items (tokens) rather than samples."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from raypipe.core.errors import BatchError
from raypipe.core.layers import LossFunction


def check_token_ids(x: object, vocab: int | None) -> None:
    """Refuses token ids a model cannot embed, before any stage runs: `x` (a tensor, the first of a
    tuple, `x["input_ids"]`, or each microbatch of a list) must hold integers in [0, vocab).

    Raises:
        BatchError: naming the tensor, its dtype or the first id out of range and where it is.
    """
    if vocab is None:
        return
    if isinstance(x, list):
        for i, part in enumerate(x):
            check_token_ids(part, vocab) if not torch.is_tensor(part) else _check_ids(part, f"x[{i}]", vocab)
        return
    name, ids = (
        ("x['input_ids']", x.get("input_ids"))
        if isinstance(x, dict)
        else ("x[0]", x[0])
        if isinstance(x, tuple) and x
        else ("x", x)
    )
    if torch.is_tensor(ids):
        _check_ids(ids, name, vocab)


def _check_ids(ids: torch.Tensor, name: str, vocab: int) -> None:
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise BatchError(
            f"{name} is a {ids.dtype} tensor, but the model's first layer embeds token ids from a "
            f"vocabulary of {vocab}: give integer ids (torch.long)."
        )
    low, high = torch.aminmax(ids) if ids.numel() else (0, 0)  # one pass over the ids
    if int(low) < 0 or int(high) >= vocab:
        bad = ((ids < 0) | (ids >= vocab)).nonzero()[0].tolist()
        raise BatchError(
            f"{name}{bad} = {int(ids[tuple(bad)])} is not a token id of the model's vocabulary of "
            f"{vocab} (ids 0..{vocab - 1}): nothing was run. Check the tokenizer matches the model."
        )


def check_positions(width: int, positions: int | None, what: str, fix: str = "shorten it") -> None:
    """Raises BatchError when `width` tokens exceed the model's `positions` (`Model.max_positions`)."""
    if positions is not None and width > positions:
        raise BatchError(
            f"{what} takes {width} positions, past the model's {positions} (max_position_embeddings): a learned "
            f"position table has no row for it and rotary ones run past what the model learned; {fix}"
        )


def split_batch(x: Any, y: Any, parts: int, dp: int, microbatches: int) -> tuple[list[Any], list[Any]]:
    """Splits `(x, y)` into `parts` equal chunks along dim 0; `y=None` (inference) takes any
    split that divides the batch.

    `x` is a tensor or a tuple or dict of tensors with the same batch size (such as
    `{"input_ids": ..., "attention_mask": ...}`); a tensor (or tree of tensors) `y` is
    split alongside, anything else repeated. A Python *list* `x` is the step's microbatches
    already cut (`parts` of them, which may differ in shape: unpadded sequences), with a
    list `y` of as many targets.

    Raises:
        BatchError: `x` is not batched, `y` does not match it, or the batch does not
            divide into `parts` (`dp` and `microbatches` word the message).
    """
    if isinstance(x, list):
        return _given(x, y, parts, dp, microbatches)
    leaves = pytree.tree_leaves(x)
    if not leaves or not all(torch.is_tensor(t) for t in leaves):
        raise BatchError(
            f"x must be a torch.Tensor, a tuple or dict of tensors, or a list of microbatches; got {type(x).__name__}"
        )
    if any(t.dim() == 0 for t in leaves):
        raise BatchError("x must have a batch dimension (dim 0)")
    batch = leaves[0].shape[0]
    if batch == 0:
        raise BatchError(
            f"x holds no samples (shape {tuple(leaves[0].shape)}): a step needs at least {parts} "
            f"(one per microbatch{' and replica' if dp > 1 else ''}); skip empty batches before the step."
        )
    if any(t.shape[0] != batch for t in leaves):
        raise BatchError(
            f"the tensors of x differ in batch size ({[t.shape[0] for t in leaves]}): give each one row per sample."
        )
    for t in pytree.tree_leaves(y) if y is not None else []:
        if torch.is_tensor(t) and (t.dim() == 0 or t.shape[0] != batch):
            raise BatchError(
                f"x has {batch} samples but y has shape {tuple(t.shape)}: give one target per sample (y.shape[0] == {batch})."  # noqa: E501
            )
    if y is None:
        parts = math.gcd(batch, parts)  # inference: any split works
    elif batch % parts:
        into = (
            f"dp={dp} x microbatches={microbatches} = {parts}"
            if parts == dp * microbatches and dp > 1
            else f"microbatches={parts}"
        )
        options = [d for d in range(1, batch + 1) if batch % d == 0]
        raise BatchError(
            f"a batch of {batch} samples cannot be split into {into} equal parts: "
            f"use a batch size divisible by {parts} (e.g. {max(parts, batch - batch % parts)})"
            + (f", or microbatches in {options}." if dp == 1 else ".")
            + " Or pass x and y as lists of microbatches of any sizes."
        )
    inputs = _chunks(x, parts, batch)
    has_tensor = any(torch.is_tensor(t) for t in pytree.tree_leaves(y))
    targets = _chunks(y, parts, batch) if has_tensor else [y] * len(inputs)
    return inputs, targets


def is_varying(inputs: Sequence[object]) -> bool:
    """Whether the microbatches differ in their tensors' shapes or dtypes (or their trees)."""
    described = []
    for x in inputs:
        leaves, spec = pytree.tree_flatten(x)
        described.append(([(t.shape, t.dtype) if torch.is_tensor(t) else t for t in leaves], spec))
    return any(d != described[0] for d in described[1:])


def loss_weights(loss_fn: LossFunction, targets: Sequence[Sequence[object]]) -> list[list[float]] | None:
    """Per replica and microbatch, the loss weight that makes the step's loss the mean over all
    of its items, when `loss_fn` counts them (`loss_fn.count(target)`: the tokens a causal
    LM loss averages over, those not ignored); None otherwise (every part weighs the same).

    A part's loss is the mean over its own items; weighting it by `count * parts / total`
    makes the average over parts (what the microbatches and dp replicas compute) the mean
    over the whole batch, as a one-process run of the same batch computes it.
    """
    count = getattr(loss_fn, "count", None)
    if count is None:
        return None
    counts = [[float(count(t)) for t in replica] for replica in targets]
    total = sum(map(sum, counts))
    parts = sum(map(len, counts))
    return [[c * parts / total if total else 0.0 for c in replica] for replica in counts]


def samples_and_tokens(inputs: Sequence[object]) -> tuple[int, int | None]:
    """Samples in a step's parts, and the token ids among them (the first tensor of each part,
    when it holds integers; None for float inputs)."""
    firsts = [pytree.tree_leaves(x)[0] for x in inputs]
    samples = sum(int(t.shape[0]) for t in firsts)
    return samples, None if any(t.is_floating_point() for t in firsts) else sum(int(t.numel()) for t in firsts)


def _given(x: list, y: object, parts: int, dp: int, microbatches: int) -> tuple[list[object], list[object]]:
    """A batch given as its microbatches, checked against the count the step needs."""
    if y is not None and not isinstance(y, list):
        raise BatchError(
            f"x is a list of {len(x)} microbatches, so y must be a list of as many targets, not a {type(y).__name__}."
        )
    if y is not None and len(y) != len(x):
        raise BatchError(f"x holds {len(x)} microbatches but y holds {len(y)} targets: give one target per microbatch.")
    if y is not None and len(x) != parts:
        into = f"dp={dp} x microbatches={microbatches} = {parts}" if dp > 1 else f"microbatches={parts}"
        raise BatchError(f"x is a list of {len(x)} microbatches, but a step takes {into}: pass {parts}.")
    for i, part in enumerate(x):
        if not pytree.tree_leaves(part) or not all(torch.is_tensor(t) for t in pytree.tree_leaves(part)):
            raise BatchError(f"microbatch {i} of x is {type(part).__name__}: give tensors (or tuples/dicts of them).")
    return list(x), list(y) if y is not None else [None] * len(x)


def _chunks(value: object, parts: int, batch: int) -> list[object]:
    """`value`'s tensors cut into `parts` along dim 0, one tree per part; cloned, since a view
    would carry the whole batch's storage through the object store."""
    leaves, spec = pytree.tree_flatten(value)
    cut = [[c.clone() for c in t.split(batch // parts)] if torch.is_tensor(t) else [t] * parts for t in leaves]
    return [pytree.tree_unflatten([c[i] for c in cut], spec) for i in range(parts)]


@dataclass
class Prepared:
    """A step's batch cut for the actors, wherever it was cut (the driver, or a dataset reader):
    per replica its microbatch inputs and targets (`inputs`/`targets`), or both already packed and
    stored in Ray's object store (`packed`: per replica a reference to the packed inputs and one to
    the packed targets, which the actors fetch themselves); the loss weights, the samples and token
    ids it holds, whether the microbatches differ in shape, and what making it measured (`extra`)."""

    inputs: list[list[Any]] | None
    targets: list[list[Any]] | None
    weights: list[list[float]] | None
    samples: int
    tokens: int | None
    varying: bool
    packed: list[tuple[object, object]] | None = None
    extra: dict[str, float] | None = None  # figures measured making the batch (a GRPO generation's)


def prepare(
    x: object, y: object, dp: int, microbatches: int, loss_fn: LossFunction, vocab: int | None = None
) -> Prepared:
    """Cuts a batch `(x, y)` into dp replicas x `microbatches` parts (`split_batch`), its token ids
    checked against `vocab` first (`check_token_ids`)."""
    check_token_ids(x, vocab)
    inputs, targets = split_batch(x, y, dp * microbatches, dp, microbatches)
    per_replica = [targets[d * microbatches : (d + 1) * microbatches] for d in range(dp)]
    samples, tokens = samples_and_tokens(inputs)
    return Prepared(
        [inputs[d * microbatches : (d + 1) * microbatches] for d in range(dp)],
        per_replica,
        loss_weights(loss_fn, per_replica),
        samples,
        tokens,
        is_varying(inputs),
    )
