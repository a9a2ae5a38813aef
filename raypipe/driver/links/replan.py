"""Planning again once the links are measured (issue 36): a profiled plan (`partition="profile"`,
`schedule="auto"`) is made before any stage actor runs, so it cannot know the links between the
nodes they land on. Once the actors have started and measured them (`ActorGroup.links`), the
plan is made again from the same profiles with each boundary timed on its link
(`planning.autoschedule.plan_for_links`). A new schedule, microbatch count or warm-up reaches
the running actors as a reconfiguration; a new split or chunk count needs other layers on
them, so the actors are started again once (and their links measured again).
"""

from __future__ import annotations

from collections.abc import Callable

from raypipe.config import TrainConfig
from raypipe.core.errors import ScheduleError
from raypipe.driver.actor_group import ActorGroup
from raypipe.planning.autoschedule import plan_for_links
from raypipe.planning.links import link_map
from raypipe.schedules import SCHEDULES, build_schedule

MIN_GAIN = 0.02  # the predicted share of the step a new plan must save to replace the running one


def follow_links(group: ActorGroup, asked: TrainConfig, log: Callable[[str], None]) -> None:
    """Gives `group` the plan for the links its actors measured (and makes it its `report`), where
    one crosses nodes and the new plan is predicted to save `MIN_GAIN` of the step. `asked`: the
    config as the user gave it (schedule "auto" before the link-blind choice)."""
    measured = link_map(group.links)
    if not measured or group.report is None:
        return
    config, new, blind, aware, account = plan_for_links(asked, group.config, group.report, group.specs, measured)
    if aware > (1 - MIN_GAIN) * blind:  # not worth a restart (nor a different plan than the one printed)
        log(f"links measured between stages: {'; '.join(map(str, group.links))}; the running plan stays")
        return
    changed = new.plan != group.plan or config.num_chunks() != group.config.num_chunks()
    log(
        "links measured between stages:\n"
        + "\n".join(f"  {link}" for link in group.links)
        + f"\nplanned again for them: {account}\n"
        + f"the link-blind plan ({group.config.schedule}, m={group.config.microbatches}, {group.plan}) would take "
        + f"{1000 * blind:.1f} ms per step on these links; this one {1000 * aware:.1f} ms"
        + ("; starting the stages again with the new split" if changed else "")
    )
    if changed:
        group.shutdown()
        group.reshape(config, new.plan)
        group.start()
    elif config != group.config:
        group.reconfigure(config)
    group.report = new


def overlap_links(group: ActorGroup, log: Callable[[str], None]) -> bool:
    """`extra_warmup` left unset (None): one more forward in flight where neighbouring stages run on
    different nodes, so the next microbatches' activations cross while the first gradient comes
    back, instead of the link idling a round trip per pair of microbatches (1F1B 1.162 -> 0.995 s a
    step at 200 Mbit/s, 0.489 -> 0.454 s at 1 Gbit/s: docs/benchmarks/details.md, "slow link");
    it changes the order of actions only, never a result, and costs one more microbatch's stashed
    activations on every stage but the last. Reaches the running actors as a reconfiguration; logs
    what it chose and why. True when it chose 1."""
    config = group.config
    crossing = [(s, s + 1) for s in range(config.pp - 1) if _node_of(group, s) != _node_of(group, s + 1)]
    if not crossing or not SCHEDULES[config.schedule].extra_warmup:
        return False
    try:
        build_schedule(config.schedule, config.pp, config.microbatches, config.chunks, 1, int(config.sequence_chunks))
    except ScheduleError:
        return False
    rates = {(link.sender, link.receiver): link for link in group.links if link.measured}
    where = "; ".join(str(rates[(a, b)]) if (a, b) in rates else f"stage {a} -> stage {b}" for a, b in crossing)
    log(
        f"raypipe: stages on different nodes ({where}): extra_warmup=1, one more forward in flight, so "
        "activations keep crossing while the first gradient comes back (one more microbatch stashed on "
        "every stage but the last; set extra_warmup=0 to keep 1F1B's own warm-up). " + _precision_word(group.config)
    )
    group.reconfigure(config.replace(extra_warmup=1))
    return True


def _precision_word(config: TrainConfig) -> str:
    """What the start log says of the boundaries' precision on those links (`links.advice`)."""
    if config.boundary_dtype == "auto":
        return (
            "Boundaries cross as computed (boundary_dtype='auto'); if a step shows one of these links "
            "bounding it, they cross in bf16 from the next step on, half the bytes (set boundary_dtype='fp32' "
            "to keep them exact). schedule='auto' with a sample plans the split for the links"
        )
    return "For a slow link, schedule='auto' with a sample plans the split for it"


def with_chosen_warmup(group: ActorGroup, changes: dict[str, object]) -> dict[str, object]:
    """`Trainer.reconfigure`'s `changes`, with the extra warm-up `overlap_links` chose following a new
    schedule (0 for one that takes none, as GPipe) unless they set it; one they set is theirs from then."""
    if "extra_warmup" in changes:
        group.warmup_chosen = False
    elif group.warmup_chosen:
        schedule = str(changes.get("schedule", group.config.schedule))
        changes = {**changes, "extra_warmup": 1 if SCHEDULES[schedule].extra_warmup else 0}
    return changes


def _node_of(group: ActorGroup, stage: int) -> str | None:
    """The node stage `stage`'s lead actor (replica 0, tp rank 0) runs on."""
    return group.nodes.get(group.names[group.topology.lead_ranks()[stage]])
