"""Recovery from memory (issue 38): after a loss, the new actors take the state of the surviving
data-parallel replicas instead of the last checkpoint, so no step is replayed: the step that
failed is run again, from the state it began with.

Before the old actors are stopped, each one on a node still alive hands over its state
(`StageActor.hand_over`, in its "control" concurrency group: it answers while its main thread
still waits on a lost peer). The state is the call's return value, owned by the driver and kept
in the object store of the survivor's node, so it outlives the actor that made it. A survivor
counts only when its weights are at the driver's step: the step's closing agreement precedes
every optimizer step, so a step that failed was applied nowhere or (the loss came after the
agreement) everywhere, which a survivor's `completed` tells. The restore needs every layer of
the model, for each tp rank and ep rank, from such survivors; it serves the same topology on a
spare node, a shrunk one and a grown one alike, whatever their split.

When that is not so (dp = 1, ZeRO shares, survivors at another step, a layer held by lost actors
only, `TrainConfig.restore_from_replicas` off, a state that does not load), the recovery restores
the checkpoint as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import ray

from raypipe.config import TrainConfig
from raypipe.core.errors import ActorDiedError, RaypipeError
from raypipe.core.protocol import HeldState
from raypipe.driver.actor_group import ActorGroup
from raypipe.driver.cluster.placement import CONTROL
from raypipe.driver.results import gather

HAND_OVER_WAIT = 10.0  # seconds the survivors have to answer; each answers in milliseconds


@dataclass
class Held:
    """What the survivors handed over: each one's `HeldState` and the reference to its state,
    all at `step` (the driver's step count: the failed step is the one after it)."""

    step: int
    states: list[tuple[HeldState, object]]

    @property
    def nbytes(self) -> int:
        return sum(held.nbytes for held, _ in self.states)


def why_not(config: TrainConfig, lost: bool = True) -> str | None:
    """Why a group of `config` cannot hand its state over in memory, or None. `lost`: after a loss,
    when a copy must survive elsewhere (dp > 1); a whole group handing over (an elastic run growing
    back) needs none."""
    if not config.restore_from_replicas:
        return "TrainConfig.restore_from_replicas is off"
    if lost and config.dp == 1:
        return "dp = 1: no replica holds a copy"
    if config.zero in (1, 3) and config.dp > 1:
        return f"each replica holds a ZeRO-{config.zero} share of its stage's state only"
    return None


def take(group: ActorGroup, gone: set[str], step: int, log: Callable[[str], None], lost: bool = True) -> Held | None:
    """Asks every actor of `group` not on a node of `gone` for its state (before the group stops);
    returns what covers the model at `step`, or None (with the reason logged) when it does not.
    `lost`: after a loss (`why_not`)."""
    config = group.config
    reason = why_not(config, lost)
    if reason is not None:
        if config.dp > 1:
            log(f"raypipe: not restoring from the surviving replicas: {reason}")
        return None
    calls = {}
    for name, actor in zip(group.names, group.actors):
        if group.nodes.get(name) not in gone:
            held, state = actor.hand_over.options(concurrency_group=CONTROL, num_returns=2).remote()
            calls[held] = state
    answers, pending, deadline = [], list(calls), time.monotonic() + HAND_OVER_WAIT
    while pending and time.monotonic() < deadline:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        for ref in ready:
            try:
                answers.append((ray.get(ref), calls[ref]))
            except (ray.exceptions.RayError, RaypipeError):  # died with its node, or could not hand over
                continue
    current = [(held, ref) for held, ref in answers if held.completed == step]
    problem = uncovered([held for held, _ in current], config, len(group.specs))
    if problem:
        others = sorted({held.completed for held, _ in answers} - {step})
        at = f" (survivors at step {', '.join(map(str, others))}, not {step})" if others else ""
        log(f"raypipe: the surviving replicas cannot restore the run: {problem}{at}; restoring from the checkpoint")
        return None
    return Held(step, current)


def uncovered(held: list[HeldState], config: TrainConfig, num_layers: int) -> str:
    """What no survivor in `held` holds, in words ("" when they cover the model): each tp rank and
    ep rank needs every layer."""
    gaps = []
    for t in range(config.tp):
        for e in range(config.ep):
            have = {i for h in held if (h.tp_rank, h.ep_rank) == (t, e) for i in h.layers}
            missing = [i for i in range(num_layers) if i not in have]
            if missing:
                where = f" of tp rank {t}" * (config.tp > 1) + f" of ep rank {e}" * (config.ep > 1)
                gaps.append(f"layers {compact(missing)}{where} were held by lost actors only")
    return "; ".join(gaps)


def compact(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


def donors(
    held: list[tuple[HeldState, object]], name: str, t: int, e: int, layers: list[int]
) -> list[tuple[HeldState, object]]:
    """The survivors a new actor `name` (tp rank t, ep rank e) loads `layers` from: the old actor of
    its name when it survived, then those holding most of what is still missing."""
    mine = [h for h in held if (h[0].tp_rank, h[0].ep_rank) == (t, e)]
    chosen = [h for h in mine if h[0].name == name]
    missing = set(layers) - {i for h in chosen for i in h[0].layers}
    while missing:
        best = max(mine, key=lambda h: len(missing & set(h[0].layers)))
        if not missing & set(best[0].layers):
            raise RaypipeError(f"{name}: no survivor holds layers {sorted(missing)}")  # `uncovered` rules it out
        chosen.append(best)
        missing -= set(best[0].layers)
    return chosen


def restore(group: ActorGroup, held: Held, log: Callable[[str], None]) -> bool:
    """Loads the started `group` from `held`; True when every actor loaded. False (logged) when
    one could not: the caller restores the checkpoint, which replaces every actor's state."""
    plans, ep, calls, sources = group.actor_plan(), group.config.ep, [], set()
    try:
        for rank, (actor, name) in enumerate(zip(group.actors, group.names)):
            d, s, t = group.topology.place(rank)
            layers = [i for a, b in plans[s] for i in range(a, b)]
            chosen = donors(held.states, name, t, d % ep, layers)
            sources.update(h.name for h, _ in chosen)
            calls.append(actor.take_over.remote(held.step, *[ref for _, ref in chosen]))
        gather(calls, "restoring from the surviving replicas", group.actors, group.names)
    except (RaypipeError, ActorDiedError, ray.exceptions.RayError) as error:
        log(f"raypipe: restoring from the surviving replicas failed ({error}); restoring from the checkpoint")
        return False
    log(
        f"raypipe: the new actors took the state of step {held.step} from {', '.join(sorted(sources))} "
        f"({held.nbytes / 2**20:.1f} MiB, from memory)"
    )
    return True
