"""A run's helper actors: the small actors beside its stages (the world's rendezvous keeper, the
step board, the dataset reader), each named `<role>-<hex>` in the run's namespace so the Ray
dashboard shows whose they are."""

from __future__ import annotations

import uuid
from typing import Any


def on_driver_node(cls: type, run_name: str, role: str, *args: object, head: bool = False) -> Any:
    """An actor of `cls` on the driver's node (with `head`, the cluster's head node: the one whose
    loss ends the cluster anyway; a driver attached from elsewhere may sit on any node), soft:
    elsewhere if that node cannot take it. It reserves no CPU and is outside any placement group (a
    Tune trial's group does not capture it)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    if head:
        heads = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and "node:__internal_head__" in n["Resources"]]
        node = heads[0] if heads else node
    here = NodeAffinitySchedulingStrategy(node, soft=True)
    named = helper_options(run_name, role)
    return ray.remote(cls).options(num_cpus=0, max_restarts=0, scheduling_strategy=here, **named).remote(*args)


def helper_options(run_name: str, role: str) -> dict[str, str]:
    """A helper actor's name and namespace: `<role>-<hex>` beside the run's stage actors."""
    return {"name": f"{role}-{uuid.uuid4().hex[:6]}", "namespace": f"raypipe-{run_name}"}
