"""Preference data for DPO jobs: TRL's text format `{"prompt", "chosen", "rejected"}` (and its
conversational form, each a list of messages) read from JSONL and tokenized with the model
directory's tokenizer into TRL 1.16's tokenized columns (`prompt_ids`, `chosen_ids`,
`rejected_ids`), which `Trainer.step` takes. Without a file, pairs made from the standard library:
a documented function's signature is the prompt, its docstring the chosen completion and the
same words shuffled the rejected one."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from raypipe.core.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

COLUMNS = ("prompt", "chosen", "rejected")


def stdlib_pairs(limit: int = 2000, max_bytes: int = 4_000_000, seed: int = 0) -> list[dict[str, str]]:
    """Pairs from `raypipe.data.sft.stdlib_docstrings`: each function's docstring chosen, the same
    words in a shuffled order rejected (a preference a small model learns in minutes: fluent text
    over its own words scrambled)."""
    import random

    from raypipe.data.sft import stdlib_docstrings

    rng, pairs = random.Random(seed), []
    for record in stdlib_docstrings(limit, max_bytes):
        words = record["response"].split(" ")
        shuffled = rng.sample(words, len(words))
        if shuffled != words:
            pairs.append({"prompt": record["prompt"], "chosen": record["response"], "rejected": " ".join(shuffled)})
    return pairs


def _text(record: dict[str, Any], tokenizer: PreTrainedTokenizerBase, index: int) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) as text: a conversational record's prompt through the tokenizer's
    chat template when it has one (else `role: content` lines), its completions' last messages."""
    missing = [c for c in COLUMNS if c not in record]
    if missing:
        raise ConfigError(
            f"preference record {index} lacks {', '.join(missing)}: give {{'prompt', 'chosen', 'rejected'}} "
            f"as text, or each as a list of chat messages (TRL's conversational form)"
        )
    prompt, chosen, rejected = (record[c] for c in COLUMNS)
    if isinstance(prompt, list):
        if getattr(tokenizer, "chat_template", None):
            prompt = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        else:
            prompt = "".join(f"{m['role']}: {m['content']}\n" for m in prompt) + "assistant: "
    chosen, rejected = (c[-1]["content"] if isinstance(c, list) else c for c in (chosen, rejected))
    return prompt, chosen, rejected


@dataclass
class PreferenceDataset:
    """Tokenized pairs, each `{"prompt_ids", "chosen_ids", "rejected_ids"}` of at most `block_size`
    tokens per row (prompt + completion): the prompt keeps its end, the completion its start."""

    pairs: list[dict[str, list[int]]]
    block_size: int

    @classmethod
    def from_records(
        cls, records: Iterable[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, block_size: int
    ) -> PreferenceDataset:
        pairs = []
        for index, record in enumerate(records):
            prompt, chosen, rejected = _text(record, tokenizer, index)
            p = tokenizer.encode(prompt, add_special_tokens=False)[-(block_size // 2) :]
            completions = []
            for text in (chosen, rejected):
                ids = tokenizer.encode(text, add_special_tokens=False)
                if tokenizer.eos_token_id is not None:  # as TRL ends each completion
                    ids.append(tokenizer.eos_token_id)
                completions.append(ids[: block_size - len(p)])
            pairs.append({"prompt_ids": p, "chosen_ids": completions[0], "rejected_ids": completions[1]})
        if not pairs:
            raise ConfigError("no preference pairs were read: the file holds no records")
        return cls(pairs, block_size)

    def split(self, val_fraction: float) -> tuple[PreferenceDataset, PreferenceDataset]:
        cut = max(1, int(len(self.pairs) * (1.0 - val_fraction)))
        return PreferenceDataset(self.pairs[:cut], self.block_size), PreferenceDataset(
            self.pairs[cut:] or self.pairs[-1:], self.block_size
        )

    def __len__(self) -> int:
        """Tokens in all rows (each pair is two rows sharing its prompt)."""
        return sum(2 * len(p["prompt_ids"]) + len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in self.pairs)

    def batch(self, step: int, pairs: int, seed: int = 0) -> list[dict[str, list[int]]]:
        """`pairs` pair records for step `step`, a function of (seed, step) alone."""
        rng = np.random.default_rng([seed, step])
        return [self.pairs[i] for i in rng.choice(len(self.pairs), size=pairs, replace=len(self.pairs) < pairs)]
