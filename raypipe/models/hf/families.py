"""The HuggingFace causal-LM families raypipe splits into layers, each described by what
differs between them: where its weights live in the checkpoint, which classes build its
embedding, decoder layer, final norm and rotary embedding, and how it embeds tokens.

GPT-2 and the Llama family (Llama, Mistral, Qwen2, and Mixtral, whose MLP is a mixture of
experts: the same shape, their own classes) are tested; another `model_type` gets an error naming it and these.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from raypipe.errors import ConfigError


@dataclass(frozen=True)
class Family:
    """One architecture's layout.

    Attributes:
        module: the transformers modeling module, e.g. "transformers.models.llama.modeling_llama".
        decoder: its decoder layer class; rotary: its rotary embedding class ("" for learned positions).
        base: the checkpoint prefix of the base model ("transformer." for GPT-2, "model." for Llama).
        embeddings: the base model's embedding modules, by attribute name.
        layers: the base model's attribute holding the decoder layers ("h", "layers").
        norm: the base model's final norm attribute ("ln_f", "norm"); norm_class its class.
        token_embedding: the attribute of the token embedding (tied to the head when configured).
    """

    module: str
    decoder: str
    rotary: str
    base: str
    embeddings: tuple[str, ...]
    layers: str
    norm: str
    norm_class: str
    token_embedding: str

    def classes(self) -> Any:
        return importlib.import_module(self.module)

    def decoder_prefix(self, index: int) -> str:
        """The checkpoint prefix of decoder layer `index` (0-based among the decoder layers)."""
        return f"{self.base}{self.layers}.{index}."

    def tied_key(self) -> str:
        """The checkpoint key of the token embedding, which a tied head shares."""
        return f"{self.base}{self.token_embedding}.weight"


GPT2 = Family(
    "transformers.models.gpt2.modeling_gpt2",
    "GPT2Block",
    "",
    "transformer.",
    ("wte", "wpe"),
    "h",
    "ln_f",
    "LayerNorm",
    "wte",
)
LLAMA_SHAPED = {
    name: Family(
        f"transformers.models.{name}.modeling_{name}",
        f"{prefix}DecoderLayer",
        f"{prefix}RotaryEmbedding",
        "model.",
        ("embed_tokens",),
        "layers",
        "norm",
        f"{prefix}RMSNorm",
        "embed_tokens",
    )
    for name, prefix in (("llama", "Llama"), ("mistral", "Mistral"), ("qwen2", "Qwen2"), ("mixtral", "Mixtral"))
}
FAMILIES = {"gpt2": GPT2, **LLAMA_SHAPED}


def family_of(config: Any) -> Family:
    """The family of a transformers config.

    Raises:
        ConfigError: the model type is not one raypipe knows how to split.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ConfigError(
            f"raypipe.models.hf cannot split a model of type {model_type!r} ({type(config).__name__}): supported "
            f"types are {sorted(FAMILIES)}. Write the model as a list of LayerSpecs, or split an nn.Module at "
            f"named points with raypipe.models.module.split."
        )
    return FAMILIES[model_type]
