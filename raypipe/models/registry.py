"""The models a job file can name, behind one small interface (`JobModel`), so the job and the
CLI are not tied to one model: `model:` holds the reference GPT's fields (the default), or
`hf:` with a local transformers model directory or a transformers config's fields.

    model: {n_layer: 4, n_embd: 128, block_size: 64}            # raypipe's GPT
    model: {hf: runs/llama/hf, block_size: 128}                  # a saved transformers model
    model: {hf: {model_type: llama, vocab_size: 256, ...}}       # a fresh one from config fields
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from raypipe.config.checks import check_whole_number
from raypipe.core.errors import ConfigError, nearest
from raypipe.models import gpt
from raypipe.models.model import Model


class JobModel:
    """What a job needs of its model: its `Model`, the sequence length it trains on, a line
    describing it, and the targets for a batch of (inputs, next tokens)."""

    block_size: int

    def build(self) -> Model:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def targets(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The next tokens `y` (the GPT's loss takes them); a transformers loss shifts `x` itself."""
        return y

    def tokenizer(self) -> Any:
        """The tokenizer of the model's data (raypipe's bytes, as a transformers tokenizer)."""
        from raypipe.data.hf_tokenizer import byte_tokenizer

        return byte_tokenizer()

    def save_tokenizer(self, directory: str) -> None:
        """Saves the tokenizer beside an exported model, so `AutoTokenizer` loads it from there."""
        self.tokenizer().save_pretrained(directory)


@dataclass(frozen=True)
class GPTModel(JobModel):
    """raypipe's reference GPT (`raypipe.models.gpt`)."""

    config: gpt.GPTConfig

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def build(self) -> Model:
        from raypipe.models import gpt_export

        return gpt_export.model(self.config)

    def describe(self) -> str:
        c = self.config
        moe = (
            f", {sum(map(c.is_moe_block, range(c.n_layer)))} MoE blocks of {c.num_experts} experts, top {c.top_k}"
            if c.moe
            else ""
        )
        return f"GPT {c.parameters / 1e6:.2f}M parameters ({c.n_layer} blocks, n_embd {c.n_embd}{moe})"


@dataclass(frozen=True)
class HFModelSection(JobModel):
    """A transformers causal LM (`raypipe.models.hf`).

    Attributes:
        hf: a local model directory, or a transformers config's fields with its `model_type`.
        dtype: "fp32" or "bf16"; block_size: the sequence length to train on.
    """

    hf: Any
    dtype: str = "fp32"
    block_size: int = 128

    def __post_init__(self) -> None:
        check_whole_number("model.block_size", self.block_size, 1)
        if not isinstance(self.hf, (str, dict)):
            raise ConfigError(f"model.hf={self.hf!r} is invalid: give a model directory or a mapping of config fields.")
        if isinstance(self.hf, dict) and "model_type" not in self.hf:
            raise ConfigError("model.hf needs model_type (e.g. llama or gpt2) among its config fields.")

    def build(self) -> Model:
        from raypipe.models import hf

        if isinstance(self.hf, str):
            return hf.from_pretrained(self.hf, dtype=self.dtype)
        from transformers import AutoConfig

        fields = dict(self.hf)
        return hf.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields), dtype=self.dtype)

    def describe(self) -> str:
        where = self.hf if isinstance(self.hf, str) else f"{self.hf['model_type']} from config fields"
        return f"transformers model ({where}, {self.dtype})"

    def targets(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x

    def tokenizer(self) -> object:
        """The model directory's own tokenizer when it has one, else raypipe's byte tokenizer."""
        import os

        if isinstance(self.hf, str) and any(
            os.path.exists(os.path.join(self.hf, f)) for f in ("tokenizer.json", "tokenizer_config.json")
        ):
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(self.hf)
        return super().tokenizer()


def job_model(values: Mapping[str, Any] | None) -> JobModel:
    """The model a job's `model:` section describes.

    Raises:
        ConfigError: an unknown field, naming the fields of the model it looks like.
    """
    values = dict(values or {})
    cls, target = (HFModelSection, HFModelSection) if "hf" in values else (gpt.GPTConfig, GPTModel)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in names:
            raise ConfigError(
                f"unknown field model.{key}: model takes {', '.join(names)}, or hf: "
                f"<model directory or config fields>.{nearest(str(key), names)}"
            )
    return cls(**values) if cls is HFModelSection else target(cls(**values))
