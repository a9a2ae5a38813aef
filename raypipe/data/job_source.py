"""A job's data section (`data:` in its YAML): where the training tokens, examples or preference
pairs come from, and how batches reach the stages."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raypipe.core.errors import ConfigError, nearest
from raypipe.data import TokenDataset, stdlib_corpus

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DATA_SOURCES = ("stdlib", "bin", "text", "sft", "pairs", "prompts")
EXAMPLES = ("sft", "pairs", "prompts")  # records cut on the driver, not tokens
DATA_READERS = ("auto", "driver", "ray_data")


@dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from.

    Attributes:
        source: "stdlib" (the Python standard library's source, built locally),
            "bin" (a uint16 token file at `path`), "text" (text files in `paths`) or "sft"
            (prompt/response examples from the JSONL file at `path`, or without one the
            stdlib's function signatures and docstrings: `raypipe.data.sft`) or "pairs"
            (preference pairs in TRL's text or conversational format from the JSONL file at
            `path`, or stdlib pairs, for `objective` "dpo": `raypipe.data.preference`; batch_size
            counts pairs, and no validation loss is computed) or "prompts" (prompt records in TRL's
            prompt-only format from the JSONL file at `path`, or stdlib signatures whose reward is
            the share of parameters their docstring names, for `objective` "grpo":
            `raypipe.data.prompts`; batch_size counts prompts, each generated from G times).
        pack: for "sft", pack several examples into each row (positions restart per example).
        max_bytes: how much stdlib source to use.
        path: the token file for source "bin".
        paths: text files for source "text".
        val_fraction: the tail of the tokens held out for validation loss.
        reader: how training batches reach the stages: "driver" (made and cut by the job's
            process), "ray_data" (a Ray Dataset made in Ray Data's tasks and cut beside the
            actors: `raypipe.data.ray_source`; the same batches), or "auto": ray_data on a
            cluster (RAY_ADDRESS set, as under `ray job submit`), driver on the embedded Ray.
    """

    source: str = "stdlib"
    max_bytes: int = 4_000_000
    path: str | None = None
    paths: tuple[str, ...] = ()
    val_fraction: float = 0.05
    pack: bool = False
    reader: str = "auto"

    def __post_init__(self) -> None:
        if self.source not in DATA_SOURCES:
            raise ConfigError(
                f"data.source={self.source!r} is invalid: choose one of {', '.join(DATA_SOURCES)}."
                f"{nearest(str(self.source), DATA_SOURCES)}"
            )
        if self.source == "bin" and not self.path:
            raise ConfigError("data.path is missing: source 'bin' needs the path of a uint16 token file.")
        for name, path in [("path", self.path)] + [(f"paths[{i}]", p) for i, p in enumerate(self.paths or ())]:
            if path and not Path(path).is_file():
                raise ConfigError(f"data.{name}={path!r}: no such file (relative paths are from {Path.cwd()}).")
        if self.source == "text" and not self.paths:
            raise ConfigError("data.paths is missing: source 'text' needs a list of text files.")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={self.val_fraction!r} is invalid: give a number in [0, 1).")
        if self.reader not in DATA_READERS:
            raise ConfigError(
                f"data.reader={self.reader!r} is invalid: choose one of {', '.join(DATA_READERS)}."
                f"{nearest(str(self.reader), DATA_READERS)}"
            )
        if self.reader == "ray_data" and self.source in EXAMPLES:
            raise ConfigError(
                f"data.reader='ray_data' is invalid with source {self.source!r} (its examples are cut on the "
                "driver): use reader 'driver' or 'auto'."
            )
        object.__setattr__(self, "paths", tuple(self.paths))

    def uses_ray_data(self) -> bool:
        """Whether training batches go through Ray Data (`reader`, "auto" resolved)."""
        from raypipe.core.env import ray_address

        if self.reader == "auto":
            return self.source not in EXAMPLES and ray_address() is not None
        return self.reader == "ray_data"

    def dataset(self, block_size: int, tokenizer: PreTrainedTokenizerBase | None = None) -> Any:
        if self.source == "prompts":
            from raypipe.data.prompts import PromptDataset, stdlib_prompts
            from raypipe.data.sft import read_jsonl

            records = read_jsonl(self.path, prompts=True) if self.path else stdlib_prompts(max_bytes=self.max_bytes)
            return PromptDataset.from_records(records, tokenizer, block_size)
        if self.source == "pairs":
            from raypipe.data.preference import PreferenceDataset, stdlib_pairs
            from raypipe.data.sft import read_jsonl

            records = read_jsonl(self.path, pairs=True) if self.path else stdlib_pairs(max_bytes=self.max_bytes)
            return PreferenceDataset.from_records(records, tokenizer, block_size)
        if self.source == "sft":
            from raypipe.data.sft import SFTDataset, read_jsonl, stdlib_docstrings

            records = read_jsonl(self.path) if self.path else stdlib_docstrings(max_bytes=self.max_bytes)
            return SFTDataset.from_records(records, tokenizer, block_size, self.pack)
        if self.source == "stdlib":
            return TokenDataset.from_bin(stdlib_corpus(self.max_bytes), block_size)
        if self.source == "bin":
            return TokenDataset.from_bin(self.path, block_size)
        return TokenDataset.from_text_files(self.paths, block_size)
