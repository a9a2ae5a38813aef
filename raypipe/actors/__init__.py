"""Ray actors that hold model pieces."""

from raypipe.actors.settings import StageSettings
from raypipe.actors.stage import StageActor

__all__ = ["StageActor", "StageSettings"]
