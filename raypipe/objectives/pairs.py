"""Preference pairs as a batch: TRL 1.16's tokenized columns (`prompt_ids`, `chosen_ids`,
`rejected_ids`) made into the rows a DPO step trains on."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from raypipe.core.errors import BatchError
from raypipe.objectives.base import IGNORE

COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


def pair_batch(records: Sequence[Mapping[str, Any]], pad_id: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`(x, labels)` of the pairs `records`: rows 2i and 2i + 1 are pair i's prompt followed by its
    chosen and by its rejected completion, right-padded with `pad_id` to the longest row;
    `x` = {"input_ids", "attention_mask"}, `labels` the completions' tokens, -100 elsewhere.

    Raises:
        BatchError: not a list of records with the three columns of token ids.
    """
    if not isinstance(records, Sequence) or not records or not all(isinstance(r, Mapping) for r in records):
        raise BatchError(
            f"a DPO step takes a list of pair records {{{', '.join(map(repr, COLUMNS))}}} (token ids); "
            f"got {type(records).__name__}"
        )
    rows, completions = [], []
    for i, record in enumerate(records):
        missing = [c for c in COLUMNS if c not in record]
        if missing:
            raise BatchError(
                f"pair {i} lacks {', '.join(missing)}: each record needs {', '.join(COLUMNS)} (lists of token ids)"
            )
        prompt = [int(t) for t in record["prompt_ids"]]
        for column in ("chosen_ids", "rejected_ids"):
            completion = [int(t) for t in record[column]]
            if not completion:
                raise BatchError(f"pair {i}'s {column} is empty: a completion needs at least one token")
            rows.append(prompt + completion)
            completions.append(len(completion))
    return completion_rows(rows, completions, pad_id)


def completion_rows(
    rows: Sequence[Sequence[int]], completions: Sequence[int], pad_id: int = 0
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`(x, labels)` of token `rows` (a prompt then a completion of `completions[r]` tokens each),
    right-padded with `pad_id` to the longest: x = {"input_ids", "attention_mask"}, `labels` the
    completions' tokens and -100 elsewhere (DPO's pairs, GRPO's generations)."""
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for r, (row, completion) in enumerate(zip(rows, completions)):
        input_ids[r, : len(row)] = torch.tensor(row)
        attention_mask[r, : len(row)] = 1
        labels[r, len(row) - completion : len(row)] = torch.tensor(row[len(row) - completion :])
    return {"input_ids": input_ids, "attention_mask": attention_mask}, labels
