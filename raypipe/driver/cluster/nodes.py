"""After a whole node is lost: which of the nodes the actors ran on (`ActorGroup.nodes`, noted
when they started) are gone, and which stages each held (the actors themselves can no longer
be asked)."""

from __future__ import annotations

import socket

import ray


def unreachable(placed: dict[str, str], timeout: float = 1.0) -> set[str]:
    """The nodes of `placed` (name -> node id) that are gone: Ray marked them dead, or their raylet
    no longer accepts a connection. Ray marks a node dead only after its health checks have failed
    for ~15-20 s; the probe lets the trainer say at once which node it lost."""
    alive = {n["NodeID"]: n for n in ray.nodes()}
    gone = set()
    for node in set(placed.values()):
        info = alive.get(node, {})
        if not info.get("Alive", False):
            gone.add(node)
            continue
        try:
            socket.create_connection((info["NodeManagerAddress"], info["NodeManagerPort"]), timeout=timeout).close()
        except OSError:
            gone.add(node)
    return gone


def describe(placed: dict[str, str], gone: set[str]) -> str:
    """Each node of `gone` with the actors of `placed` it held, e.g. "node 10.0.0.2 (id 3f2a9c1e)
    held stage1-dp0-tp0"; "" when `gone` is empty."""
    address = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes()}
    by_node: dict[str, list[str]] = {}
    for name, node in placed.items():
        if node in gone:
            by_node.setdefault(node, []).append(name)
    return "; ".join(
        f"node {address.get(node, '?')} (id {node[:8]}) held {', '.join(names)}" for node, names in by_node.items()
    )
