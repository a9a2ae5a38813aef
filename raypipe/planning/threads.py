"""How many torch intra-op threads a stage actor (or a profiler timing layers for one) computes with.

A CPU stage's speed is its thread count: one thread on a 16-core box is a sixteenth of the
machine. Ray's logical CPU reservation is the wrong measure, because raypipe keeps it small
(at most 1) so that actors pack onto a node. The rule instead: the node's CPUs (as Ray counts
them: `ray start --num-cpus`, else the machine's cores) divided among the raypipe actors
placed on that node, at least 1 each, so the sum of their threads never exceeds the node's
cores. `TrainConfig.threads_per_actor` overrides it. Inside a Ray Tune trial the trial's
bundles are its share of the node (other trials run beside it), so there the reservation is
the rule.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence


def fitting_threads(node_cpus: float, actors_on_node: int) -> int:
    """Threads each of `actors_on_node` actors gets on a node of `node_cpus` CPUs: an equal share, at least 1."""
    return max(1, int(node_cpus) // max(1, actors_on_node))


def node_cpus() -> dict[str, float]:
    """Each alive node's CPUs as Ray counts them, by node id."""
    import ray

    return {n["NodeID"]: float(n.get("Resources", {}).get("CPU", 1.0)) for n in ray.nodes() if n.get("Alive")}


def threads_by_node(
    nodes: Sequence[str], configured: int | None, cpus_of: Callable[[], dict[str, float]] = node_cpus
) -> list[int]:
    """Per actor (the node id each runs on, `nodes`), its threads: `configured` when set, else its
    node's CPUs divided among the actors of `nodes` on that node."""
    if configured:
        return [configured] * len(nodes)
    counts, cpus = Counter(nodes), cpus_of()
    return [fitting_threads(cpus.get(n, 1.0), counts[n]) for n in nodes]


def packed_on_node(node_cpus: float, reservation: float, actors: int) -> int:
    """How many of `actors` actors, each reserving `reservation` logical CPUs, a node of
    `node_cpus` CPUs takes when they pack: the profiler's estimate, made before the stages exist."""
    return max(1, min(actors, int(node_cpus / reservation + 1e-9) if reservation > 0 else actors))
