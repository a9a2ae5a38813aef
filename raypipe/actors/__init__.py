"""Ray actors that hold model pieces: the `StageActor` shell around a plain `Stage`."""

from raypipe.actors.stage_actor import StageActor
from raypipe.core.protocol import StageSettings

__all__ = ["StageActor", "StageSettings"]
