"""The run's reference policy, which an objective's passes measure against
(`StageActor.forward_only(..., reference=kind)`): captured on every actor before the first
objective step, kept in the run's checkpoints."""

from __future__ import annotations

from typing import TYPE_CHECKING

from raypipe.checkpoint.layout import CheckpointError
from raypipe.driver.results import gather

if TYPE_CHECKING:
    from raypipe.driver.actor_group import ActorGroup


def reference_kind(group: ActorGroup) -> str:
    """The run's reference policy: captured on every actor before its first objective step (the
    weights as they stand: a new adapter's, or one loaded first), kept in its checkpoints' manifest.

    Raises:
        CheckpointError: the run resumed from a checkpoint of a run that started from a loaded
            adapter, whose copy checkpoints do not hold.
    """
    if group.reference_kind is None:
        kinds = gather([a.capture_reference.remote() for a in group.actors], "reference", group.actors, group.names)
        group.reference_kind = "adapters_off" if set(kinds) == {"adapters_off"} else "frozen_copy"
    if group.reference_kind == "not_saved":
        raise CheckpointError(
            f"this {group.config.objective['name'].upper()} run resumed from a checkpoint of a run that started from "
            "a loaded adapter: its reference policy, that adapter, is not in checkpoints (a new adapter's, the "
            "adapters off, is). Start a new run from the adapter you started from (load_adapter before the first step)."
        )
    return group.reference_kind
