"""All-or-nothing placement: a trainer's actors reserved together in one Ray placement group.

Without it, two trainers started at once on a cluster that fits one could each be given
half their actors and wait for the other half forever. With it, Ray reserves every actor's
bundle (its CPUs, its accelerator kind's resources, its node labels) at once or none of them:
a trainer that does not fit holds nothing while it waits, and gets a `PlacementError` after
`actor_start_timeout` naming what it asked for. Each actor is then started in its own bundle.
The group is removed with the actors (`release`), so nothing leaks; a recovery reserves a
fresh one.

A trainer built inside a placement group that captures its children (a Ray Tune trial's, reserved
with `raypipe.tune.resources`) does not reserve another: its actors go into that group's bundles
after the first (the trial's own), which the trial reserved for them (`enclosing`).

`TrainConfig.placement` picks Ray's strategy: "pack" (as few nodes as possible, so stages
share memory links), "spread" (across nodes where it can) or "strict_spread" (one actor per
node, else it fails).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raypipe.core.errors import PlacementError

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

STRATEGIES = {"pack": "PACK", "spread": "SPREAD", "strict_spread": "STRICT_SPREAD"}


def bundle(cpus: float, options: dict[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """One actor's bundle and its label selector, from its Ray actor options (`devices.ray_options`)."""
    resources = {"CPU": cpus, **options.get("resources", {})}
    if options.get("num_gpus"):
        resources["GPU"] = options["num_gpus"]
    return resources, dict(options.get("label_selector", {}))


def reserve(
    bundles: Sequence[tuple[dict[str, float], dict[str, str]]],
    strategy: str,
    name: str,
    timeout: float,
    asks: Sequence[str],
    offer: Callable[[], str],
    others: Callable[[], list[str]],
    timeout_field: str = "actor_start_timeout",
) -> PlacementGroup:
    """Reserves every bundle at once and waits up to `timeout` seconds for all of them.

    Args:
        asks: per bundle, what its actor asks for in words ("stage0-dp0-tp0 (stage 0) asked for ...").

    Raises:
        PlacementError: not every bundle fits within `timeout`: names the actors' asks, the
            strategy, what the cluster offers and other trainers of this process holding actors.
            The group is removed first, so a refused trainer holds nothing.
    """
    selectors = [s for _, s in bundles]
    group = placement_group(
        [b for b, _ in bundles],
        strategy=STRATEGIES[strategy],
        name=name,
        bundle_label_selector=selectors if any(selectors) else None,
    )
    try:
        ready = _wait(group, bundles, timeout)
    except BaseException:  # Ctrl-C or SIGTERM while waiting: a pending group would take the resources later
        remove_placement_group(group)
        raise
    if not ready:
        remove_placement_group(group)
        held = others()
        hint = (
            f" Other trainers of this process still hold actors: {'; '.join(held)}; call .shutdown() on "
            f"those you are done with."
            if held
            else ""
        )
        nowhere = [ask for (b, sel), ask in zip(bundles, asks) if not _fits_some_node(b, sel)]
        nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
        if nowhere:
            why = f"no node can ever hold {'; '.join(nowhere[:6])}"
            if any(kind in ask for ask in nowhere for kind in ("'cuda'", "'rocm'", "'mps'")):
                why += (
                    " (to try a cuda, rocm or mps stage on a CPU node, as tests and demos do: "
                    "TrainConfig(allow_cpu_fallback=True))"
                )
        elif strategy == "strict_spread" and len(bundles) > nodes:
            why = f"strict_spread puts each of the {len(bundles)} actors on a node of its own, and {nodes} are alive"
        else:
            why = (
                f"each fits some node, but not all at once now: {'; '.join(asks[:6])}{' ...' if len(asks) > 6 else ''}"
            )
        raise PlacementError(
            f"the {len(bundles)} actors could not be reserved together within {timeout:.0f} s "
            f"(TrainConfig.{timeout_field}; placement={strategy!r}, all or nothing): {why}. The cluster offers: {offer()}; {ray.available_resources()} "  # noqa: E501
            f"free in all. Free resources (another trainer may hold them), lower cpus_per_actor or gpus_per_actor, "
            f"add a node of the missing kind (`ray start ... $(raypipe node-resources)`), change "
            f"TrainConfig.devices, or use placement='pack'.{hint}"
        )
    return group


def enclosing(bundles: Sequence[tuple[dict[str, float], dict[str, str]]]) -> Any:
    """The placement group this process runs in, when it captures the tasks and actors started
    here (a Tune trial's); its bundles 1.. hold the actors. None outside one.

    Raises:
        PlacementError: the group has no bundle, or too small a one, for some actor.
    """
    group = ray.util.get_current_placement_group()
    if group is None:
        return None
    specs = group.bundle_specs
    short = [
        f"actor {i} asks for {b}, bundle {i + 1} holds {specs[i + 1] if i + 1 < len(specs) else 'nothing'}"
        for i, (b, _) in enumerate(bundles)
        if i + 1 >= len(specs) or any(specs[i + 1].get(k, 0.0) < v - 1e-9 for k, v in b.items())
    ]
    if short:
        raise PlacementError(
            f"this trainer runs inside a placement group (a Ray Tune trial's) of {len(specs)} bundles, which "
            f"does not hold its {len(bundles)} actors beside the trial's own bundle: {'; '.join(short[:4])}. "
            f"Reserve them with the trial: tune.with_resources(train_fn, raypipe.tune.resources(config))."
        )
    return group


GRACE_S = 10.0  # how long a request no node can hold waits before a fixed cluster refuses it


def _wait(group: PlacementGroup, bundles: Sequence[tuple[dict[str, float], dict[str, str]]], timeout: float) -> bool:
    """Whether the group was reserved within `timeout`; False sooner, after `GRACE_S`, when some
    bundle fits no node alive and the cluster has no autoscaler (nothing will change). With one,
    the whole `timeout`: it launches node types one update after another, so "nothing pending
    now" does not mean "nothing will come" (a cuda + rocm request saw its rocm node up and its
    cuda node not yet asked for)."""
    import time

    started = time.monotonic()
    while True:
        left = timeout - (time.monotonic() - started)
        ready, _ = ray.wait([group.ready()], timeout=max(0.0, min(1.0, left)))
        if ready:
            return True
        if left <= 1.0:
            return False
        waited = time.monotonic() - started
        if waited >= GRACE_S and not _autoscaled() and not all(_fits_some_node(b, s) for b, s in bundles):
            return False


def _autoscaled() -> bool:
    """Whether the cluster has an autoscaler that may still launch nodes. Ray's monitor reports
    on every head, but on a fixed cluster through a read-only provider that names each node's
    type `node_<its id>`; an autoscaler's node types are the ones its config names."""
    import json

    try:
        from ray.experimental.internal_kv import _internal_kv_get

        status = json.loads(_internal_kv_get("__autoscaling_status") or b"{}")
    except Exception:  # noqa: BLE001 - no status to read: assume one may launch, as before
        return True
    report = status.get("autoscaler_report") or {}
    if report.get("pending_launches") or report.get("pending_nodes"):
        return True
    return any(kind != f"node_{node}" for node, kind in (report.get("node_type_mapping") or {}).items())


def _fits_some_node(resources: dict[str, float], selector: dict[str, str]) -> bool:
    """Whether an alive node has (in total, free or not) the resources and labels of a bundle."""
    for node in ray.nodes():
        labels, total = node.get("Labels") or {}, node.get("Resources", {})
        if (
            node.get("Alive")
            and all(labels.get(k) == v for k, v in selector.items())
            and all(total.get(k, 0.0) >= v for k, v in resources.items())
        ):
            return True
    return False


def in_bundle(group: PlacementGroup, index: int, options: dict[str, object]) -> dict[str, object]:
    """Ray actor options starting an actor in bundle `index` of `group` (its label selector is
    the bundle's; a trial's group, which Tune reserves without selectors, relies on the kind's
    resource alone)."""
    options = {k: v for k, v in options.items() if k != "label_selector"}
    return {
        **options,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=index, placement_group_capture_child_tasks=False
        ),
    }


def release_group(group: PlacementGroup) -> None:
    """Removes a placement group (a trainer's own, after its actors are killed)."""
    try:
        remove_placement_group(group)
    except Exception:  # already removed, or Ray already shut down
        pass
