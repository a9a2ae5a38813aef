"""Starting a trainer's stage actors: resources and label selectors per accelerator kind,
reserved all or nothing in one placement group (`gang.py`), a bounded wait that turns an
unplaceable actor into an error saying why, and the rendezvous that joins them into one
torch.distributed world with their dp, tp and ep groups.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import ray

from raypipe.actors.stage_actor import StageActor
from raypipe.config import TrainConfig
from raypipe.config.engines import engine_kind
from raypipe.core.devices import ray_options
from raypipe.core.errors import PlacementError, StageError
from raypipe.core.layers import LayerSpec, LossFunction
from raypipe.core.protocol import ActorInfo, ActorSpec, WorldSpec
from raypipe.driver.checkpoints import check_reachable
from raypipe.driver.chunks import actor_chunks, actor_plan
from raypipe.driver.cluster import gang
from raypipe.driver.cluster.helper_actors import on_driver_node
from raypipe.driver.cluster.topology import Topology
from raypipe.driver.links import ways
from raypipe.driver.results import gather, last_line
from raypipe.models.model import tied_stages
from raypipe.planning.threads import oversubscribed, threads_by_node
from raypipe.schedules import Schedule, owners, virtual_stages
from raypipe.transport.ray_store import KEEPER_DIED, StoreKeeper

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.util.placement_group import PlacementGroup


NAME_WAIT = 10.0  # seconds a new actor waits for the name of one just killed
CONTROL = "control"  # the stage actors' concurrency group for calls a busy actor still answers


@dataclass(frozen=True)
class StartedActors:
    """A trainer's actors once started: world-rank order, the placement group reserved for them
    (None inside a Ray Tune trial, whose group is the trial's), and the node each runs on (by name)."""

    actors: list[ActorHandle]
    placement_group: PlacementGroup | None
    nodes: dict[str, str]
    keeper: ActorHandle | None = None  # the world's rendezvous (`transport.ray_store`), None without a world
    listening: dict[str, list[str]] = field(default_factory=dict)  # per actor, the ports its world opened


def cpus_per_actor(config: TrainConfig, actors: int) -> float:
    """The logical CPUs each actor reserves: the config's, or a share of the cluster's (at most 1)."""
    if config.cpus_per_actor is not None:
        return float(config.cpus_per_actor)
    total = ray.cluster_resources().get("CPU", 1.0)
    return min(1.0, int(100 * total / actors) / 100) or 0.01


def stage_options(config: TrainConfig, stage: int) -> dict[str, object]:
    """Ray options placing a stage on a node of its accelerator kind (none for cpu)."""
    return ray_options(config.stage_kinds()[stage], config.gpus_per_actor)


def actor_bundles(
    config: TrainConfig, topology: Topology, cpus: float
) -> list[tuple[dict[str, float], dict[str, str]]]:
    """Each actor's bundle (rank by rank) and label selector: `cpus` and its stage's accelerator kind."""
    return [gang.bundle(cpus, stage_options(config, topology.place(r)[1])) for r in range(len(topology.names()))]


def start_actors(
    config: TrainConfig,
    topology: Topology,
    names: Sequence[str],
    specs: Sequence[LayerSpec],
    plan: Sequence[tuple[int, int]],
    schedule: Schedule,
    loss_fn: LossFunction,
    run_name: str,
    cpus: float,
    tied: Sequence[Sequence[str]] = (),
    group: PlacementGroup | None = None,
    first: int = 0,
) -> list[Any]:
    """Creates every stage actor (Ray places them asynchronously; `wait_for_actors` waits), each
    with the layers of the virtual stages `schedule` gives it (`plan` is per virtual stage), in
    its bundle (`first` + rank) of the placement `group` that reserved them (`gang.reserve`)."""
    threads = config.threads_per_actor or max(1, int(cpus))  # while building; `fit_threads` sets the rest
    # "control": a thread of its own for `hand_over`, which must answer while a step stuck on a
    # lost peer holds the actor's main thread
    remote_cls = ray.remote(concurrency_groups={CONTROL: 1})(StageActor)
    kinds = config.stage_kinds()
    actors = []
    for rank, name in enumerate(names):
        d, s, t = topology.place(rank)
        held = actor_chunks(plan, schedule, s)
        start = held[0][1]
        layers = [spec for _, a, b in held for spec in specs[a:b]]
        num_virtual = len(plan)
        options = dict(
            name=name,
            namespace=f"raypipe-{run_name}",
            num_cpus=cpus,
            max_restarts=0,
            max_task_retries=0,
            **(
                gang.in_bundle(group, first + rank, stage_options(config, s))
                if group is not None
                else stage_options(config, s)
            ),
        )
        spec = ActorSpec(
            name,
            s,
            config.pp,
            layers,
            start,
            config.seed,
            threads,
            loss_fn if any(v == num_virtual - 1 for v, _, _ in held) else None,
            d,
            config.dp,
            t,
            config.tp,
            kinds[s],
            config.allow_cpu_fallback,
            tuple(tied),
            dict(config.lora) if config.lora is not None else None,
            config.quantize[s] if config.quantize else None,
            tuple(held) if len(held) > 1 or held[0][0] != s else (),
            num_virtual,
            config.ep,
        )
        actors.append(created(lambda options=options, spec=spec: remote_cls.options(**options).remote(spec)))
    return actors


def created(make: Callable[[], Any], wait: float = NAME_WAIT) -> Any:
    """`make()`, a named actor's creation, tried again while Ray still holds the name: an actor
    killed a moment before (a restart, a recovery) keeps it until the GCS has seen it die
    (measured: once in a full test run, a recovery's new actor found its name taken)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return make()
        except ray.exceptions.ActorAlreadyExistsError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def wait_for_actors(
    actors: Sequence[ActorHandle],
    names: Sequence[str],
    topology: Topology,
    plan: Sequence[tuple[int, int]],
    config: TrainConfig,
    cpus: float,
    others: Callable[[], list[str]],
    ready: Callable[[int], None] = lambda done: None,
) -> list[ActorInfo]:
    """Waits until every actor has built its layers, telling `ready` how many are as they come up;
    returns each one's `info()` (where it runs).

    Raises:
        StageError: an actor failed to start (its layers did not build, say).
        PlacementError: some actors were not placed within `actor_start_timeout`; names what
            they asked for, what the cluster offers, and `others()`: trainers still holding actors.
    """
    refs = [a.info.remote() for a in actors]
    deadline = time.monotonic() + config.actor_start_timeout
    pending = list(refs)
    infos: list[Any] = [None] * len(refs)
    while pending:
        wait = min(1.0, max(0.0, deadline - time.monotonic()))  # a second at a time: `ready` hears of each
        built, pending = ray.wait(pending, num_returns=len(pending), timeout=wait)
        for ref in built:
            rank = refs.index(ref)
            try:
                infos[rank] = ray.get(ref)
            except ray.exceptions.RayActorError as error:
                raise StageError(
                    f"{names[rank]} (layers {plan[topology.place(rank)[1]]}) could not start: {last_line(error)}"
                ) from None
        ready(len(refs) - len(pending))
        if pending and time.monotonic() >= deadline:
            waiting = [names[refs.index(r)] for r in pending]
            asked = "; ".join(
                f"{n} (stage {topology.place(names.index(n))[1]}) asked for "
                f"{ {'CPU': cpus, **stage_options(config, topology.place(names.index(n))[1])} }"
                for n in waiting[:6]
            )
            held = others()
            hint = (
                f" Other trainers of this process still hold actors: {'; '.join(held)}; "
                f"call .shutdown() on those you are done with."
                if held
                else ""
            )
            for ref in pending:  # never leave a pending actor behind
                ray.kill(actors[refs.index(ref)], no_restart=True)
            raise PlacementError(
                f"actors {waiting} were not placed within {config.actor_start_timeout:.0f} s "
                f"(TrainConfig.actor_start_timeout): {asked}. The cluster offers: {cluster_offer()}; "
                f"{ray.available_resources()} free in all. Free resources, lower cpus_per_actor or "
                f"gpus_per_actor, add a node of the missing kind (`ray start ... $(raypipe node-resources)`), "
                f"or change TrainConfig.devices.{hint}"
            )
    return infos


def start_gang(*args: Any, **kwargs: Any) -> StartedActors:
    """`start_once`, made once more, afresh, when the world's rendezvous keeper died as the actors
    joined (its node was lost as the start began, before Ray marked it dead)."""
    try:
        return start_once(*args, **kwargs)
    except KeeperLost:
        return start_once(*args, **kwargs)


def start_once(
    config: TrainConfig,
    topology: Topology,
    names: Sequence[str],
    specs: Sequence[LayerSpec],
    plan: Sequence[tuple[int, int]],
    schedule: Schedule,
    loss_fn: LossFunction,
    run_name: str,
    others: Callable[[], list[str]],
    tied: Sequence[Sequence[str]] = (),
    reserve_wait: float | None = None,
    ready: Callable[[int], None] = lambda done: None,
) -> StartedActors:
    """Starts every stage actor, waits until all are placed and built, and joins them into the
    trainer's world when it needs one; on any failure kills those started, then raises.
    `plan`: per virtual stage of `schedule`. `tied`: the model's tied weights (`raypipe.models.model.Model.tied`).
    `reserve_wait`: seconds to wait for the actors' resources (TrainConfig.replace_wait, after a
    lost node), instead of `actor_start_timeout`, which still bounds their building. `ready`: told
    how many actors are built, as they come up."""
    cpus = cpus_per_actor(config, len(names))
    stages = [topology.place(r)[1] for r in range(len(names))]
    group, first = gang.enclosing(actor_bundles(config, topology, config.cpus_per_actor or 0.01)), 1
    if group is not None:  # a Tune trial's group: its bundles 1.. were reserved for the actors
        cpus = min(b.get("CPU", 0.0) for b in group.bundle_specs[1 : len(names) + 1]) or cpus
    else:
        asks = [
            f"{n} (stage {s}) asked for { {'CPU': cpus, **stage_options(config, s)} }" for n, s in zip(names, stages)
        ]
        group, first = (
            gang.reserve(
                actor_bundles(config, topology, cpus),
                config.placement,
                f"raypipe-{run_name}",
                config.actor_start_timeout if reserve_wait is None else reserve_wait,
                asks,
                cluster_offer,
                others,
                "actor_start_timeout" if reserve_wait is None else "replace_wait",
            ),
            0,
        )
    try:
        actors = start_actors(
            config, topology, names, specs, plan, schedule, loss_fn, run_name, cpus, tied, group, first
        )
    except BaseException:
        if not first:
            gang.release_group(group)
        raise
    own = group if not first else None  # the trainer's own group goes with its actors; a trial's stays
    shared = [(g, stages) for g, stages in enumerate(tied_stages(tied, actor_plan(plan, schedule))) if len(stages) > 1]
    world = needs_world(config) or bool(shared)
    keeper = on_driver_node(StoreKeeper, run_name, "rendezvous", head=True) if world else None  # built meanwhile
    listening: dict[str, list[str]] = {}
    try:
        infos = wait_for_actors(actors, names, topology, plan, config, cpus, others, ready)
        infos = fit_threads(actors, names, infos, config.threads_per_actor or (max(1, int(cpus)) if first else None))
        if keeper is not None:
            listening = join_world(actors, names, topology, infos, config, shared, schedule, keeper)
        if config.checkpoint_dir is not None:
            check_reachable(actors, names, config.checkpoint_dir)
    except BaseException:
        kill(actors + ([keeper] if keeper is not None else []), own)
        raise
    return StartedActors(actors, own, {name: info.node_id for name, info in zip(names, infos)}, keeper, listening)


def fit_threads(
    actors: Sequence[ActorHandle], names: Sequence[str], infos: Sequence[ActorInfo], configured: int | None
) -> list[ActorInfo]:
    """Gives each placed actor its torch threads (`raypipe.planning.threads`: its node's CPUs
    shared among the trainer's actors there, or `configured`); returns the infos with them."""
    nodes, cores = [i.node_id for i in infos], [i.cores for i in infos]
    wanted = threads_by_node(nodes, configured, cores=cores)
    for problem in oversubscribed(nodes, wanted, cores) if configured else ():
        warnings.warn(
            f"TrainConfig.threads_per_actor={configured}: {problem}, so they take turns on them (slower, not "
            f"faster). Leave threads_per_actor unset to share each node's cores among its actors.",
            RuntimeWarning,
            stacklevel=2,
        )
    got = gather([a.set_threads.remote(n) for a, n in zip(actors, wanted)], "set threads", actors, names)
    return [replace(i, threads=n) for i, n in zip(infos, got)]


def linked_stages(schedule: Schedule) -> list[list[int]]:
    """Per stage (actor), the stages it exchanges boundary values with: those holding the virtual
    stages next to its own (interleaved chunks also link the last stage to the first)."""
    owner = owners(schedule)
    return [
        sorted({owner[u] for v in stages for u in (v - 1, v + 1) if u in owner and owner[u] != s})
        for s, stages in enumerate(virtual_stages(schedule))
    ]


def needs_world(config: TrainConfig) -> bool:
    """Collectives (dp, tp) or actor-to-actor boundaries (p2p, compiled between stages) need one."""
    return config.dp > 1 or config.tp > 1 or (engine_kind(config.engine).direct_links and config.pp > 1)


def join_world(
    actors: Sequence[ActorHandle],
    names: Sequence[str],
    topology: Topology,
    infos: Sequence[ActorInfo],
    config: TrainConfig,
    shared: Sequence[tuple[int, list[int]]],
    schedule: Schedule,
    keeper: ActorHandle,
) -> dict[str, list[str]]:
    """Every actor joins the world, meeting through `keeper` (a `transport.ray_store.StoreKeeper`);
    returns, per actor name, the TCP addresses its world listens on (gloo's own connections).

    Each actor is in one dp group (its stage and tp rank across replicas) and one tp
    group (its stage's ranks within its replica); the groups overlap in membership.
    `shared`: (tied group index, its stages) for each weight tied across stages; the
    holders of each (replica, tp rank) get a group of their own. Device links (`ways.plan_links`)
    get a two-rank group per stream, after all the others. `infos`: each actor's `info()`.
    """
    pp, tp = topology.pp, topology.tp
    linked = linked_stages(schedule)
    dp_groups, tp_groups = topology.dp_groups(), topology.tp_groups()
    tied_groups = [
        (g, topology.across_stages(stages, d, t)) for g, stages in shared for d in range(topology.dp) for t in range(tp)
    ]
    groups = [g for g in dp_groups + tp_groups if len(g) > 1] + [ranks for _, ranks in tied_groups]
    groups += [list(g) for g in topology.expert_groups() if len(g) > 1 and list(g) not in groups]
    backends = [ways.group_backend(infos, g) for g in groups]
    device_links = ways.plan_links(topology, schedule, infos, names, config.device_links)
    first_stream = len(groups)
    groups += [s.ranks for s in device_links.streams]
    backends += [s.backend for s in device_links.streams]
    joins = []
    for r, actor in enumerate(actors):
        d, s, t = topology.place(r)
        joins.append(
            actor.join.remote(
                WorldSpec(
                    keeper,
                    len(actors),
                    r,
                    groups,
                    dp_groups[s * tp + t],
                    tp_groups[d * pp + s],
                    config.step_timeout,
                    backends,
                    tuple(topology.rank(d, n, t) for n in linked[s]),
                    config.same_node_transport,
                    tuple((g, ranks) for g, ranks in tied_groups if r in ranks),
                    *((topology.ep_group(d, s, t), topology.expert_group(d, s, t)) if topology.ep > 1 else ((), ())),
                    tuple((first_stream + i, st.sender, st.receiver, st.v, st.what) for i, st in device_links.of(r)),
                )
            )
        )
    try:
        return dict(zip(names, gather(joins, "rendezvous", actors, names)))
    except StageError as error:
        if KEEPER_DIED in str(error):
            raise KeeperLost(str(error)) from None
        raise


class KeeperLost(StageError):
    """The world's rendezvous keeper died while the actors joined (its node was lost): the start may
    be made again, with new actors and a new keeper."""


def name_links(infos: Sequence[ActorInfo], names: Sequence[str]) -> list[dict[str, Any]]:
    """The actors' `info()` with each link keyed by the neighbour's name instead of its world rank."""
    return [{**i.to_dict(), "links": {names[r]: how for r, how in i.links.items()}} for i in infos]


def cluster_offer() -> str:
    """Each alive node's CPUs, GPUs, accelerator resources and raypipe labels, for placement errors."""
    parts = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        res = {k: v for k, v in sorted(node.get("Resources", {}).items()) if k in ("CPU", "GPU", "cuda", "rocm", "mps")}
        labels = {k: v for k, v in (node.get("Labels") or {}).items() if k.startswith("raypipe.io/")}
        parts.append(f"node {node['NodeID'][:8]} {res}{' ' + str(labels) if labels else ''}")
    return "; ".join(parts) or "no alive nodes"


def listening_line(listening: dict[str, list[str]]) -> str:
    """The start log's line naming, per node address, the TCP ports the actors' world listens on
    (gloo's own connections; the rendezvous goes through Ray and opens none)."""
    by_host: dict[str, dict[str, list[str]]] = {}
    for name, addresses in listening.items():
        for address in addresses:
            host, port = address.rsplit(":", 1)
            by_host.setdefault(host, {}).setdefault(name, []).append(port)
    where = "; ".join(
        f"{host}: " + ", ".join(f"{name} {' '.join(ports)}" for name, ports in actors.items())
        for host, actors in sorted(by_host.items())
    )
    return f"raypipe: the actors' world listens on {where or 'no TCP port'}; its rendezvous goes through Ray (no port)"


def kill(actors: Sequence[ActorHandle], placement_group: PlacementGroup | None = None) -> None:
    """Kills the actors, then frees the placement group that reserved them (their trainer's own)."""
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already dead, or Ray already shut down
            pass
    if placement_group is not None:
        gang.release_group(placement_group)
