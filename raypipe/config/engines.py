"""What each engine (`TrainConfig.engine`) can do, declared once as data: the config's checks, the
fit loop, placement and the planner ask an engine's capabilities, never its name. The engines
themselves (how a step is sent) are in `raypipe.driver.engines`, one line each in its registry."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class EngineKind:
    """An engine's capabilities.

    Attributes:
        whole_step_calls: each actor gets its whole step in one call (its action list), so what
            lives inside a step (chunks, split backwards, ZeRO-3's gathers, an expert group's
            all-to-all, batches an actor reads itself) can run; else one call per action.
        direct_links: boundary tensors go actor to actor (one torch.distributed world), not
            through the driver as object references.
        queues_steps: a submitted step starts at once, so `fit` can queue the next behind it.
        actor_steps: the actors can drive runs of steps themselves (`TrainConfig.actor_steps`).
    """

    whole_step_calls: bool
    direct_links: bool
    queues_steps: bool
    actor_steps: bool


ENGINES: dict[str, EngineKind] = {
    "p2p": EngineKind(whole_step_calls=True, direct_links=True, queues_steps=True, actor_steps=True),
    "compiled": EngineKind(whole_step_calls=True, direct_links=True, queues_steps=False, actor_steps=False),
    "refs": EngineKind(whole_step_calls=False, direct_links=False, queues_steps=False, actor_steps=False),
}


def engine_kind(name: str) -> EngineKind:
    """The capabilities of engine `name` (a checked `TrainConfig.engine`)."""
    return ENGINES[name]


def engines_that(capability: str) -> str:
    """The engines with `capability`, for an error's words: "p2p and compiled"."""
    return " and ".join(name for name, kind in ENGINES.items() if getattr(kind, capability))
