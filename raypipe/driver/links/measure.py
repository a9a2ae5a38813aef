"""The links between a run's neighbouring stages, measured (issue 36): what `Trainer.links()`,
`stage_info()`, the diagram, `raypipe plan --links` and the link-aware planner read.

Each pair of neighbouring stages (replica 0, tp rank 0, whose links stand for every replica's)
on different nodes measures its link together (`raypipe.transport.probe`), one pair at a time so
that no probe shares a link with another. Stages on one node exchange boundaries through memory,
which no home or office link limits: they are listed, not probed. Without a torch.distributed
world (engine="refs" with no dp or tp) boundaries go through Ray's object store and nothing is
probed either.
"""

from __future__ import annotations

from typing import Any

from raypipe.driver.results import gather
from raypipe.planning.links import Link


def probe_links(group: Any) -> list[Link]:
    """Both directions of every link between neighbouring stages of `group` (an `ActorGroup`),
    measured where they cross nodes; in (sender, receiver) order."""
    from raypipe.driver.cluster.placement import linked_stages, needs_world

    topology, names, actors = group.topology, group.names, group.actors
    infos: list[dict[str, object]] = []
    pairs = sorted({(min(s, n), max(s, n)) for s, ns in enumerate(linked_stages(group.schedule)) for n in ns})
    if not needs_world(group.config):
        return [Link(s, r, "ray") for a, b in pairs for s, r in ((a, b), (b, a))]
    links: list[Link] = []
    for a, b in pairs:
        ra, rb = topology.rank(0, a, 0), topology.rank(0, b, 0)
        if group.nodes.get(names[ra]) == group.nodes.get(names[rb]):
            links += [Link(a, b, "memory"), Link(b, a, "memory")]
            continue
        infos = infos or group.info()
        transport = infos[ra]["links"].get(names[rb], "gloo")
        mine, _ = gather(
            [actors[ra].probe_link.remote(rb, True), actors[rb].probe_link.remote(ra, False)],
            f"the link probe between stages {a} and {b}",
            [actors[ra], actors[rb]],
            [names[ra], names[rb]],
            timeout=group.config.step_timeout,
        )
        latency = mine["latency_s"]
        links += [
            Link(a, b, transport, mine["to_peer_bytes_per_s"], latency),
            Link(b, a, transport, mine["from_peer_bytes_per_s"], latency),
        ]
    return links
