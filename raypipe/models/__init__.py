"""Models for raypipe: the reference GPT (written as LayerSpecs), transformers causal LMs (`hf`,
which imports transformers only when used), and any nn.Module that chains submodules (`module`)."""

from raypipe.models import gpt, hf, module

__all__ = ["gpt", "hf", "module"]
