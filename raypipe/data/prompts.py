"""Prompts for GRPO jobs: TRL's prompt-only format `{"prompt", ...}` (the prompt as text or as a list
of chat messages; every other column goes to the reward functions, such as an expected answer)
read from JSONL and tokenized with the model directory's tokenizer. Without a file, prompts made
from the standard library with a reward to verify: a documented function's signature opens its
docstring, and `summary_line` scores the docstring's first line by PEP 257's rules."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from raypipe.core.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def stdlib_prompts(limit: int = 2000, max_bytes: int = 4_000_000) -> list[dict[str, object]]:
    """Prompt records `{"prompt": <a signature opening its docstring>}` of documented standard-library
    functions (`raypipe.data.sft.stdlib_docstrings`), in a fixed order: docstrings for the model to write."""
    from raypipe.data.sft import stdlib_docstrings

    return [{"prompt": record["prompt"]} for record in stdlib_docstrings(limit, max_bytes)]


def summary_line(completions: Sequence[str], **_: Any) -> list[float]:
    """The reward of the stdlib prompts, verifiable by PEP 257's rules for a docstring's summary
    line: a third each for starting with a capital letter, ending with a period, and ending (a
    newline follows it within the completion)."""
    rewards = []
    for text in completions:
        line, newline, _ = str(text).partition("\n")
        line = line.strip()
        rewards.append((line[:1].isupper() + line.endswith(".") + bool(newline and line)) / 3)
    return rewards


def _prompt_text(record: dict[str, object], tokenizer: PreTrainedTokenizerBase, index: int) -> str:
    """A record's prompt as text: chat messages through the tokenizer's chat template when it has
    one (else `role: content` lines), with the assistant's turn opened."""
    if "prompt" not in record:
        raise ConfigError(f"prompt record {index} has no 'prompt': give {{'prompt': text or chat messages, ...}}")
    prompt = record["prompt"]
    if isinstance(prompt, list):
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return "".join(f"{m['role']}: {m['content']}\n" for m in prompt) + "assistant: "
    return str(prompt)


@dataclass
class PromptDataset:
    """Prompt records with their token ids (`prompt_ids`, at most `block_size` // 2 tokens: the
    prompt keeps its end), each keeping its other columns for the reward functions."""

    records: list[dict[str, Any]]
    block_size: int

    @classmethod
    def from_records(
        cls, records: Iterable[dict[str, object]], tokenizer: PreTrainedTokenizerBase, block_size: int
    ) -> PromptDataset:
        out = []
        for index, record in enumerate(records):
            text = _prompt_text(record, tokenizer, index)
            ids = tokenizer.encode(text, add_special_tokens=False)[-(block_size // 2) :]
            if ids:
                out.append({**record, "prompt": text, "prompt_ids": ids})
        if not out:
            raise ConfigError("no prompts were read: the file holds no records with a non-empty prompt")
        return cls(out, block_size)

    def split(self, val_fraction: float) -> tuple[PromptDataset, PromptDataset]:
        cut = max(1, int(len(self.records) * (1.0 - val_fraction)))
        return PromptDataset(self.records[:cut], self.block_size), PromptDataset(
            self.records[cut:] or self.records[-1:], self.block_size
        )

    def __len__(self) -> int:
        """Prompt tokens in all records."""
        return sum(len(r["prompt_ids"]) for r in self.records)

    def batch(self, index: int, prompts: int, seed: int = 0) -> list[dict[str, object]]:
        """`prompts` prompt records of generation batch `index`, a function of (seed, index) alone."""
        rng = np.random.default_rng([seed, index])
        chosen = rng.choice(len(self.records), size=prompts, replace=len(self.records) < prompts)
        return [self.records[i] for i in chosen]
