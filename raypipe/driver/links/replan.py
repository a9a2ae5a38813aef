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
from raypipe.driver.actor_group import ActorGroup
from raypipe.planning.autoschedule import plan_for_links
from raypipe.planning.links import link_map

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
