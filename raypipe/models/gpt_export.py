"""raypipe's reference GPT in transformers' GPT-2 format.

The GPT's layout is GPT-2's (token and learned position embeddings, pre-norm blocks with
a fused q/k/v projection, final norm and head), so a trained GPT exports as a GPT-2 that
`transformers.AutoModelForCausalLM` loads with the same logits. The differences are mapped:
GPT-2 stores its projections as Conv1D (weights transposed), uses the tanh GELU (the
export says `activation_function: gelu`, the exact one the GPT uses) and ties its head
(the GPT does not: `tie_word_embeddings: false`). A GPT built with `bias=False` has no
GPT-2 twin (GPT-2's layers always have biases) and is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from raypipe.core.errors import ConfigError
from raypipe.core.layers import LayerSpec
from raypipe.models import gpt
from raypipe.models.model import Model

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def model(cfg: gpt.GPTConfig) -> Model:
    """The GPT as a model object: its layers, its loss, and this export (`Trainer.save_pretrained`)."""
    return Model(gpt.layers(cfg), gpt.loss_fn, exporter=GPT2Exporter(cfg), max_positions=cfg.block_size)


class GPT2Exporter:
    """Writes a trained reference GPT as a transformers GPT-2 directory (`Trainer.save_pretrained`)."""

    def __init__(self, cfg: gpt.GPTConfig) -> None:
        self.cfg = cfg

    def names(self, specs: Sequence[LayerSpec]) -> dict[str, str | None]:
        """raypipe key -> GPT-2 checkpoint key."""
        import torch

        last = len(specs) - 1
        names: dict[str, str | None] = {}
        for i, spec in enumerate(specs):
            with torch.device("meta"):
                keys = list(spec.build().state_dict())
            for key in keys:
                if i == 0 or (i == last and key.startswith("ln_f.")):
                    names[f"{i}.{key}"] = f"transformer.{key}"
                elif i == last:
                    names[f"{i}.{key}"] = key
                else:
                    names[f"{i}.{key}"] = f"transformer.h.{i - 1}.{key}"
        return names

    def check(self) -> None:
        """Refuses a GPT that GPT-2's format cannot hold (no biases, or experts)."""
        c = self.cfg
        if not c.bias:
            raise ConfigError(
                "a GPT with model.bias=False has no GPT-2 twin (GPT-2's layers have biases): "
                "save it with Trainer.save() or state_dict() instead."
            )
        if c.moe:
            raise ConfigError(
                f"a GPT with model.num_experts={c.num_experts} has no GPT-2 twin (GPT-2 has no mixture "
                f"of experts): save it with Trainer.save() or state_dict() instead."
            )

    def transposed(self, names: dict[str, str | None]) -> list[str]:
        """The keys GPT-2 stores transposed (its Conv1D weights)."""
        return [k for k in names if k.endswith(CONV1D)]

    def write_config(self, directory: str, dtype: Any) -> None:
        """GPT-2's config for this GPT, with the weights' dtype, in `directory`."""
        from transformers import GPT2Config

        c = self.cfg
        config = GPT2Config(
            vocab_size=c.vocab_size,
            n_positions=c.block_size,
            n_embd=c.n_embd,
            n_layer=c.n_layer,
            n_head=c.n_head,
            activation_function="gelu",
            tie_word_embeddings=False,
            resid_pdrop=c.dropout,
            embd_pdrop=c.dropout,
            attn_pdrop=c.dropout,
            bos_token_id=None,
            eos_token_id=None,
            architectures=["GPT2LMHeadModel"],
        )
        config.dtype = dtype
        config.save_pretrained(directory)
