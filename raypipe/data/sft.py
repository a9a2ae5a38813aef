"""Supervised fine-tuning data: prompt/response examples (JSONL, or chat `messages`) tokenized
with the model directory's own tokenizer, the prompt's tokens left out of the loss (label
-100), one example per row or several packed into one row.

Packed rows keep each example to itself: its `position_ids` restart at 0, and transformers'
masks read a restart as the start of a new sequence, so no token attends across examples
(a dict boundary carries the positions from stage to stage). Without a dataset of your own,
`stdlib_docstrings` makes one from text on every machine: a standard-library function's
signature as the prompt and its docstring as the response.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from raypipe.core.errors import ConfigError
from raypipe.data.corpus import stdlib_sources

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE = -100


def read_jsonl(path: str | Path, pairs: bool = False, prompts: bool = False) -> list[dict[str, Any]]:
    """Records with `prompt` and `response`, or chat `messages` ([{"role", "content"}, ...]); with
    `pairs`, preference records with `prompt`, `chosen` and `rejected` (`raypipe.data.preference`);
    with `prompts`, prompt records with `prompt` and any other columns (`raypipe.data.prompts`).

    Raises:
        ConfigError: a line that is neither, naming the file and line.
    """
    records = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if pairs and not {"prompt", "chosen", "rejected"} <= set(record):
            raise ConfigError(f"{path}:{number}: give 'prompt', 'chosen' and 'rejected' (got {sorted(record)}).")
        if prompts and "prompt" not in record:
            raise ConfigError(f"{path}:{number}: give 'prompt' (text or chat messages) (got {sorted(record)}).")
        if not pairs and not prompts and not ({"prompt", "response"} <= set(record) or "messages" in record):
            raise ConfigError(f"{path}:{number}: give 'prompt' and 'response', or 'messages' (got {sorted(record)}).")
        records.append(record)
    return records


def stdlib_docstrings(limit: int = 2000, max_bytes: int = 4_000_000) -> list[dict[str, str]]:
    """Prompt = `def name(args):` of a documented standard-library function, response = the first
    paragraph of its docstring; in a fixed order."""
    records = []
    for path in stdlib_sources(max_bytes):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node) and not node.name.startswith("_"):
                doc = ast.get_docstring(node).split("\n\n")[0].strip()
                if 10 <= len(doc) <= 300:
                    records.append(
                        {"prompt": f'def {node.name}({ast.unparse(node.args)}):\n    """', "response": doc + '"""\n'}
                    )
                    if len(records) >= limit:
                        return records
    return records


def split_chat(record: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> tuple[str, str]:
    """(prompt, response) of a record; chat messages through the tokenizer's chat template when it
    has one, else `role: content` lines, the last assistant message being the response."""
    if "messages" not in record:
        return record["prompt"], record["response"]
    messages = record["messages"]
    if not messages or messages[-1].get("role") != "assistant":
        raise ConfigError("a chat record must end with the assistant's message, the response to learn.")
    if getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    else:
        prompt = "".join(f"{m['role']}: {m['content']}\n" for m in messages[:-1]) + "assistant: "
    return prompt, messages[-1]["content"]


@dataclass
class SFTDataset:
    """Tokenized examples (input ids, labels with the prompt masked) cut into rows of `block_size`."""

    examples: list[tuple[list[int], list[int]]]
    block_size: int
    pack: bool = False
    pad_id: int = 0

    @classmethod
    def from_records(
        cls,
        records: Iterable[dict[str, Any]],
        tokenizer: PreTrainedTokenizerBase,
        block_size: int,
        pack: bool = False,
    ) -> SFTDataset:
        examples = []
        for record in records:
            prompt, response = split_chat(record, tokenizer)
            p = tokenizer.encode(prompt, add_special_tokens=False)
            r = tokenizer.encode(response, add_special_tokens=False)
            if tokenizer.eos_token_id is not None:
                r.append(tokenizer.eos_token_id)
            ids = (p + r)[:block_size]
            examples.append((ids, ([IGNORE] * len(p) + r)[:block_size]))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        return cls(examples, block_size, pack, pad)

    def split(self, val_fraction: float) -> tuple[SFTDataset, SFTDataset]:
        cut = max(1, int(len(self.examples) * (1.0 - val_fraction)))
        return (
            SFTDataset(self.examples[:cut], self.block_size, self.pack, self.pad_id),
            SFTDataset(self.examples[cut:] or self.examples[-1:], self.block_size, self.pack, self.pad_id),
        )

    def __len__(self) -> int:
        return sum(len(ids) for ids, _ in self.examples)

    def batch(self, step: int, batch_size: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """A batch of `batch_size` rows: ({"input_ids", and "attention_mask" or (packed)
        "position_ids"}, labels), a function of (seed, step) alone."""
        rng = np.random.default_rng([seed, step])
        order = rng.permutation(len(self.examples))
        rows, labels, positions, masks, taken = [], [], [], [], 0
        for _ in range(batch_size):
            ids, lab, pos = [], [], []
            while taken < len(order):
                e_ids, e_lab = self.examples[order[taken % len(order)]]
                if ids and len(ids) + len(e_ids) > self.block_size:
                    break
                ids, lab, pos = ids + e_ids, lab + e_lab, pos + list(range(len(e_ids)))
                taken += 1
                if not self.pack:
                    break
            fill = self.block_size - len(ids)
            masks.append([1] * len(ids) + [0] * fill)
            rows.append(ids + [self.pad_id] * fill)
            labels.append(lab + [IGNORE] * fill)
            positions.append(pos + list(range(fill)))  # the padding is a sequence of its own
            if taken >= len(order):
                taken = 0
        x = {"input_ids": torch.tensor(rows)}
        if self.pack:
            x["position_ids"] = torch.tensor(positions)
        else:
            x["attention_mask"] = torch.tensor(masks)
        return x, torch.tensor(labels)
