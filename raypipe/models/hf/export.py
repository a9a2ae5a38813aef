"""How a split transformers model maps onto its own checkpoint format: each raypipe key's name
there, the layers' prefixes, and the `config.json` to write beside the shards (which
`driver.export` has the actors write)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from raypipe.core.layers import LayerSpec
from raypipe.models.hf.causal_lm_layers import checkpoint_keys
from raypipe.models.hf.skeleton import Plan, causal_lm_class

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class HFExporter:
    """How a model's raypipe keys (`"<layer>.<name>"`) map onto its transformers checkpoint."""

    def __init__(self, config: PretrainedConfig, plan: Plan) -> None:
        self.config, self.plan = config, plan

    def names(self, specs: Sequence[LayerSpec]) -> dict[str, str | None]:
        """raypipe key -> checkpoint key, None for a tied head (transformers ties it on load).
        The layers are built on the meta device: nothing is allocated."""
        tied = set(self.plan.tied) if getattr(self.config, "tie_word_embeddings", False) else set()
        names: dict[str, str | None] = {}
        for i, spec in enumerate(specs):
            with torch.device("meta"):
                module = spec.build()
            for local, key in checkpoint_keys(module).items():
                names[f"{i}.{local}"] = None if key in tied else key
        return names

    def prefixes(self, specs: Sequence[LayerSpec]) -> list[list[tuple[str, str]]]:
        """Per layer, its (local prefix, checkpoint prefix) pairs (built on the meta device)."""
        out = []
        for spec in specs:
            with torch.device("meta"):
                out.append(list(spec.build().prefixes))
        return out

    def write_config(self, directory: str, dtype: torch.dtype) -> None:
        """The model's transformers config, with its class and the weights' dtype, in `directory`."""
        config = self.config
        config.architectures = config.architectures or [_causal_lm_class(config)]
        config.dtype = dtype
        config.save_pretrained(directory)


def _causal_lm_class(config: PretrainedConfig) -> str:
    return causal_lm_class(config).__name__
