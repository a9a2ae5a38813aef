"""Ray actors that hold model pieces."""

from raypipe.actors.stage import StageActor, StageSettings

__all__ = ["StageActor", "StageSettings"]
