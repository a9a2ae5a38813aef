"""Reference models, each written as a list of LayerSpecs so it splits at block boundaries."""

from raypipe.models import gpt

__all__ = ["gpt"]
