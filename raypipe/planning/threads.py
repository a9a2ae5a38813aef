"""How many torch intra-op threads a stage actor (or a profiler timing layers for one) computes with.

A CPU stage's speed is its thread count: one thread on a 16-core box is a sixteenth of the
machine. Ray's logical CPU reservation is the wrong measure, because raypipe keeps it small
(at most 1) so that actors pack onto a node. The rule instead: the node's CPUs (as Ray counts
them: `ray start --num-cpus`, else the machine's cores), never more than the cores the OS lets
its actors run on (`devices.usable_cores`: people raise `--num-cpus` to fit more actors, and
threads past the cores only take turns on them, 0.82x instead of 1.11x on a 2-core machine told
4), divided among the raypipe actors placed on that node, at least 1 each, so the sum of their
threads never exceeds the node's cores. `TrainConfig.threads_per_actor` overrides it (with a
warning naming the node's cores when it oversubscribes them). Inside a Ray Tune trial the trial's
bundles are its share of the node (other trials run beside it), so there the reservation is
the rule.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence


def fitting_threads(node_cpus: float, actors_on_node: int, cores: int | None = None) -> int:
    """Threads each of `actors_on_node` actors gets on a node of `node_cpus` CPUs (as Ray counts
    them) and `cores` usable cores (None: unknown): an equal share of the fewer, at least 1."""
    usable = int(node_cpus) if not cores else min(int(node_cpus), cores)
    return max(1, usable // max(1, actors_on_node))


def node_cpus() -> dict[str, float]:
    """Each alive node's CPUs as Ray counts them, by node id."""
    import ray

    return {n["NodeID"]: float(n.get("Resources", {}).get("CPU", 1.0)) for n in ray.nodes() if n.get("Alive")}


def threads_by_node(
    nodes: Sequence[str],
    configured: int | None,
    cpus_of: Callable[[], dict[str, float]] = node_cpus,
    cores: Sequence[int] = (),
) -> list[int]:
    """Per actor (the node id each runs on, `nodes`; the cores it may run on, `cores`, 0 when
    unknown), its threads: `configured` when set, else its node's CPUs, at most its cores,
    divided among the actors of `nodes` on that node."""
    if configured:
        return [configured] * len(nodes)
    counts, cpus, least = Counter(nodes), cpus_of(), node_cores(nodes, cores)
    return [fitting_threads(cpus.get(n, 1.0), counts[n], least.get(n)) for n in nodes]


def node_cores(nodes: Sequence[str], cores: Sequence[int]) -> dict[str, int]:
    """Each node's usable cores, the fewest any of its actors reported (`cores`, per actor of
    `nodes`; a 0 is unknown)."""
    least: dict[str, int] = {}
    for n, c in zip(nodes, cores):
        if c:
            least[n] = min(least.get(n, c), c)
    return least


def oversubscribed(nodes: Sequence[str], threads: Sequence[int], cores: Sequence[int]) -> list[str]:
    """What is wrong on each node whose actors' threads together exceed its usable cores where
    fewer threads would not (one thread each is the least an actor runs)."""
    total: Counter[str] = Counter()
    for n, t in zip(nodes, threads):
        total[n] += t
    counts = Counter(nodes)
    return [
        f"the {counts[n]} actor(s) on node {n[:12]} run {total[n]} torch threads together on its {c} cores"
        for n, c in node_cores(nodes, cores).items()
        if total[n] > max(c, counts[n])
    ]


def packed_on_node(node_cpus: float, reservation: float, actors: int) -> int:
    """How many of `actors` actors, each reserving `reservation` logical CPUs, a node of
    `node_cpus` CPUs takes when they pack: the profiler's estimate, made before the stages exist."""
    return max(1, min(actors, int(node_cpus / reservation + 1e-9) if reservation > 0 else actors))
