"""The running actors of one trainer, as one object: who they are (names, topology), what they
run (schedule, engine) and the calls that reach all of them (start, submit a step, save, load,
info, reconfigure, shut down). Like Ray Train's WorkerGroup: nothing else starts, replaces or
stops a trainer's actors."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raypipe.checkpoint import lock as root_lock
from raypipe.config import TrainConfig
from raypipe.core.errors import RaypipeError
from raypipe.core.layers import LayerSpec
from raypipe.core.protocol import StageSettings
from raypipe.data.batches import Prepared
from raypipe.data.sequence_units import sequence_units
from raypipe.driver import checkpoints, chunks
from raypipe.driver.checkpoints import Written
from raypipe.driver.cluster import live_trainers, placement
from raypipe.driver.cluster.helper_actors import on_driver_node
from raypipe.driver.cluster.topology import Topology
from raypipe.driver.engines import Engine, StepInput, StepTarget, Wait, make_engine
from raypipe.driver.engines.refs import submission_order
from raypipe.driver.links import measure
from raypipe.driver.results import gather
from raypipe.driver.run_state import RunState
from raypipe.models.model import Model
from raypipe.observe.phases import Phase
from raypipe.planning.links import Link
from raypipe.planning.profiling import PlanReport
from raypipe.schedules import build_schedule

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.util.placement_group import PlacementGroup


@dataclass
class Submitted:
    """A step sent to the actors and not yet booked (`run.step.book`)."""

    call_id: int
    samples: int
    tokens: int | None  # token ids in the batch; None for float inputs
    wait: Wait  # wait(since) -> the step's result
    weights: list[float] | None = None  # the parts' loss weights, replica by replica (`loss_weights`)
    done: bool = False
    extra: dict[str, float] | None = None  # the batch's own figures (a GRPO generation's), for its metrics


class ActorGroup:
    """Every stage actor of one trainer, started together and stopped together.

    Args:
        config: the run's settings (replaced by `reconfigure`).
        specs: the model's layer specs; plan: the layer range of each virtual stage.
        loss_fn: the loss the last stage computes.
        run_name: the run's name, which the actors' names and placement group carry.
        model: the model object (its tied weights, and the base identity a LoRA checkpoint records).
        log: where its long phases report (`raypipe.observe.phases`).
    """

    def __init__(
        self,
        config: TrainConfig,
        specs: Sequence[LayerSpec],
        plan: Sequence[tuple[int, int]],
        loss_fn: Callable,
        run_name: str,
        model: Model,
        log: Callable[[str], None] = print,
    ) -> None:
        self.specs, self.loss_fn, self.run_name, self.model = list(specs), loss_fn, run_name, model
        self.log = log  # where its long phases (starting the actors, generating) say how far they are
        self.actors: list[ActorHandle] = []  # world-rank order
        self.placement_group: PlacementGroup | None = None  # the actors' reservation (None in a Tune trial)
        self.nodes: dict[str, str] = {}  # actor name -> the node it runs on, kept after a node is lost
        self.links: list[Link] = []  # between neighbouring stages, measured at each start (`links.measure`)
        self.warmup_chosen = False  # extra_warmup=1 set by the trainer for stages across nodes (`replan.overlap_links`)
        self.engine: Engine = make_engine(config.engine)
        self.calls = 0  # step calls issued, the id of the last one
        #: a preference run's reference policy once captured: "adapters_off", "frozen_copy", or "not_saved"
        #: after loading a checkpoint of a run whose reference a checkpoint does not hold (`inference.reference`)
        self.reference_kind: str | None = None
        self.report: PlanReport | None = None  # the profiled plan's report, which a shrink plans from
        self.shrunk: Any = None  # after an elastic shrink: what it grows back to (`elastic.Shrunk`)
        self.keeper: ActorHandle | None = None  # the world's rendezvous keys (`transport.ray_store`)
        self.board: ActorHandle | None = None  # the actor-driven runs' step board (`actor_runs`), made at first use
        self.reader: ActorHandle | None = None  # the actor-driven runs' reader of a function's batches (`feeds`)
        self.actor_run: Any = None  # the actor-driven run under way (`actor_runs.ActorRun`)
        self.warm = False  # whether the actors ran a step since they started or were reconfigured (`metrics["warmup"]`)
        self.reshape(config, plan)
        self._finalizer: weakref.finalize | None = None

    def reshape(self, config: TrainConfig, plan: Sequence[tuple[int, int]]) -> None:
        """Gives the stopped group another topology and split (an elastic shrink or regrowth)."""
        if self.actors:
            raise RaypipeError("a running group cannot change its topology: shut it down first")
        self.config, self.plan = config, list(plan)
        self.topology = Topology(config.pp, config.dp, config.tp, config.ep)  # rank = (d * pp + s) * tp + t
        self.names = self.topology.names()  # "stage{s}-dp{d}-tp{t}"
        self.set_schedule(config)

    @property
    def running(self) -> bool:
        return bool(self.actors)

    # ----- life cycle ------------------------------------------------------------

    def start(self, reserve_wait: float | None = None) -> None:
        """Starts, places and joins every actor; a failure stops those already started.

        Raises:
            PlacementError: the actors' resources were not reserved within `reserve_wait` s (by
                default `config.actor_start_timeout`), or they were not built within the latter.
            StageError: a stage failed to build its layers.
        """
        self.engine = make_engine(self.config.engine)
        count = len(self.names)
        actors = f"{count} actor{'s' if count > 1 else ''}"
        starting = Phase(
            f"starting {actors}",
            self.log,
            count,
            "actors",
            done_line=lambda s: f"raypipe: {actors} started in {s:.1f} s",
        )
        with starting:
            started = self._start_gang(reserve_wait, starting.at)
        self.actors, self.placement_group = started.actors, started.placement_group
        self.nodes, self.keeper = started.nodes, started.keeper
        if started.listening:
            self.log(placement.listening_line(started.listening))
        try:
            self.configure()
            self.links = self.measure_links() if self.config.probe_links else []
        except BaseException:
            self.shutdown()
            raise
        # a group dropped without shutdown() (its trainer in a re-run notebook cell) frees its actors
        self._finalizer = weakref.finalize(self, placement.kill, self.actors + self.helpers(), self.placement_group)
        self._finalizer.atexit = False  # at exit Ray ends the actors with the driver

    def _start_gang(self, reserve_wait: float | None, ready: Callable[[int], None]) -> placement.StartedActors:
        return placement.start_gang(
            self.config,
            self.topology,
            self.names,
            self.specs,
            self.plan,
            self.schedule,
            self.loss_fn,
            self.run_name,
            lambda: live_trainers.others_holding_actors(self),
            self.model.tied,
            reserve_wait,
            ready,
        )

    def shutdown(self) -> None:
        """Stops every actor. Safe to call twice."""
        self.engine.close()
        placement.kill(self.actors + self.helpers(), self.placement_group)
        self.actors, self.placement_group, self.keeper, self.board, self.reader, self.actor_run = [], *[None] * 5
        if self._finalizer is not None:
            self._finalizer.detach()

    def helpers(self) -> list[ActorHandle]:
        """Its actors besides the stages: the world's rendezvous keeper, the actor runs' board and reader."""
        return [a for a in (self.keeper, self.board, self.reader) if a is not None]

    # ----- settings --------------------------------------------------------------

    def set_schedule(self, config: TrainConfig) -> None:
        """Builds `config`'s schedule. Raises ConfigError for one whose chunks the running actors do not hold."""
        schedule = build_schedule(
            config.schedule, config.pp, config.microbatches, config.chunks, config.extra_warmup, config.sequence_chunks
        )
        if self.actors:
            chunks.check_same_layout(self.schedule, schedule, config.schedule)
        self.schedule, self.order = schedule, submission_order(schedule)

    def reconfigure(self, config: TrainConfig, reset_optimizer: bool = False) -> None:
        """Applies new settings to the running actors (`Trainer.reconfigure`)."""
        self.idle("reconfigure")
        self.set_schedule(config)  # refuses other chunks before anything changes
        self.config = config
        self.configure(reset_optimizer)

    def configure(self, reset_optimizer: bool = False) -> None:
        settings = StageSettings.from_config(self.config)
        gather([a.configure.remote(settings, reset_optimizer) for a in self.actors], "configure")
        self.warm = False  # the next step is the first under these settings: it pays for the warm-up

    # ----- steps -----------------------------------------------------------------

    def submit(self, batch: Prepared, index: int, after: int | None = None) -> Submitted:
        """Sends the step of 0-based index `index` on `batch` (cut for the actors) to the engine:
        the p2p engine starts it at once, the others when it is waited for. `after`: the call id
        of the step queued ahead of it."""
        if not self.actors:
            raise RaypipeError("the trainer has no actors; build a new Trainer or call load() after a failure.")
        self.idle("a step")
        if self.config.sequence_chunks > 1:  # each microbatch's chunks: the schedule's units
            batch = sequence_units(batch, self.config.sequence_chunks, self.loss_fn)
        self.calls += 1
        grid = self.topology.grid
        target = StepTarget(
            grid(self.actors), grid(self.names), grid(range(len(self.actors))), self.schedule, self.order
        )
        data = StepInput(
            batch.inputs,
            batch.targets,
            self.calls,
            index,
            self.config.step_timeout,
            batch.weights,
            batch.varying,
            batch.packed,
        )
        weights = [w for replica in batch.weights for w in replica] if batch.weights is not None else None
        sent = self.engine.submit(target, data, after)
        return Submitted(self.calls, batch.samples, batch.tokens, sent, weights, extra=batch.extra)

    def idle(self, what: str) -> None:
        """Raises when the actors are driving a run of steps (`actor_runs`): a call would wait
        behind the whole run, and then see the weights of its end, not of the step being booked."""
        if self.actor_run is not None:
            raise RaypipeError(
                f"{what} while the actors drive a run of steps (TrainConfig.actor_steps="
                f"{self.config.actor_steps!r}): call it after fit returns, or from on_step with "
                f"fit(overlap=False) or actor_steps=0"
            )

    # ----- checkpoints -----------------------------------------------------------

    def save(self, root: str, run: RunState, written: Written | None = None) -> Path:
        """Saves run `run`'s checkpoint of its current step under `root`, all actors in lock-step
        (or commits the one an actor-driven run `written`: its directory, each actor's part);
        returns `<root>/step-<N>`."""
        meta = checkpoints.run_meta(
            run.step_count, len(self.specs), self.plan, run.run_name, run.run_id, self.config, self.base_identity()
        )
        if self.reference_kind is not None:  # a preference run's reference policy (`inference.reference`)
            meta["reference"] = self.reference_kind
        with root_lock.held_by(root, run.run_name):  # no other live run writes there meanwhile
            if written is None:
                self.idle("save")
                where = checkpoints.save(
                    self.actors, self.names, root, run.step_count, meta, self.config.keep_checkpoints
                )
            else:
                try:
                    where = checkpoints.commit_save(*written, meta, self.config.keep_checkpoints)
                except BaseException:
                    checkpoints.ckpt.abort(written[0])
                    raise
        run.loads.clear()  # the checkpoint holds what was loaded before it: a recovery restores that
        return where

    def step_board(self) -> ActorHandle:
        """The actor-driven runs' board (`raypipe.actors.step.step_board`), on the driver's node."""
        if self.board is None:
            from raypipe.actors.step.step_board import StepBoard

            self.board = on_driver_node(StepBoard, self.run_name, "step-board")
        return self.board

    def function_reader(self) -> ActorHandle:
        """The actor-driven runs' reader of a function's batches (`raypipe.actors.io.reader`, its
        function set by each `fit`), on the driver's node; the board starts with it, since a run
        needs both and each is a process to start."""
        if self.reader is None:
            from raypipe.actors.io.reader import DatasetReader

            self.step_board()
            self.reader = on_driver_node(DatasetReader, self.run_name, "function-reader", None, 0, None, 1, 1, None)
        return self.reader

    def load(self, path: str | Path, step: int | None, run: RunState, log: Callable[[str], None]) -> Path:
        """Restores a checkpoint into every actor (all or nothing); `run` continues the run that saved
        it from its step, and that run's checkpoints after the step are set aside."""
        self.idle("load")
        where, meta = checkpoints.load(
            self.actors,
            self.names,
            path,
            step,
            len(self.specs),
            self.plan,
            log,
            self.base_identity(),
            self.config.optimizer.get("name"),
        )
        run.step_count = meta["step"]
        run.run_id = meta.get("run_id") or run.run_id  # checkpoints from before run ids: this run goes on
        self.reference_kind = reference_after_load(meta)
        if self.reference_kind == "frozen_copy":  # the starting adapters' copy is in the checkpoint
            gather(
                [a.restore_reference.remote(checkpoints.address(where)) for a in self.actors],
                "load",
                self.actors,
                self.names,
            )
        run.restored_from = (where, run.step_count)
        run.loads.clear()  # the checkpoint replaces whatever was loaded before it
        checkpoints.set_aside_future(self.config.checkpoint_dir, run.run_id, run.step_count, log)
        return where

    def base_identity(self) -> dict[str, object] | None:
        """In a LoRA run, the frozen base model's identity its adapters' checkpoints record."""
        return self.model.identity() if self.config.lora else None

    # ----- where things are ------------------------------------------------------

    def measure_links(self) -> list[Link]:
        """Measures both ways of each link between neighbouring stages on different nodes
        (`links.measure`), keeps and returns them."""
        self.idle("measuring links")
        self.links = measure.probe_links(self)
        return self.links

    def info(self) -> list[dict[str, Any]]:
        """Per actor: name, layers, parameters, node, pid, device, threads, `links` (neighbour ->
        transport), `link_rates` (neighbour -> the measured link to it: Mbit/s and latency) and
        `topology`: pp, dp, tp now and as configured (an elastic run's shrink shows here)."""
        self.idle("stage_info")
        infos = placement.name_links(gather([a.info.remote() for a in self.actors], "stage_info"), self.names)
        full = self.shrunk.config if self.shrunk is not None else self.config
        shape = {"pp": self.config.pp, "dp": self.config.dp, "tp": self.config.tp}
        shape |= {"configured_pp": full.pp, "configured_dp": full.dp}
        measured = {(link.sender, link.receiver): link for link in self.links if link.measured}
        stage = {name: self.topology.place(rank)[1] for rank, name in enumerate(self.names)}
        for info in infos:
            info["topology"] = shape
            info["link_rates"] = {
                name: {"mbit_per_s": link.bytes_per_s * 8e-6, "latency_ms": 1e3 * (link.latency_s or 0.0)}
                for name in info["links"]
                if (link := measured.get((stage[info["name"]], stage[name]))) is not None
            }
        return infos

    @contextlib.contextmanager
    def whole_weights(self, gradients: bool = False) -> Iterator[None]:
        """Under ZeRO-3 (`zero=3`, dp > 1) every actor holds its stage's weights whole inside the
        block (and the last step's gradients with `gradients`), for what reads them on one
        replica: evaluation, generation, state dicts, exports. Nothing otherwise."""
        self.idle("reading the weights")
        if self.config.zero != 3 or self.config.dp == 1:
            yield
            return
        gather([a.hold_weights.remote(True, gradients) for a in self.actors], "gathering ZeRO-3 weights")
        try:
            yield
        finally:
            gather([a.hold_weights.remote(False) for a in self.actors], "freeing ZeRO-3 weights")

    def replica0(self) -> tuple[list[list[ActorHandle]], list[list[str]]]:
        """Replica 0's actors and their names, per stage and tp rank: where inference runs."""
        self.idle("inference")
        return self.topology.grid(self.actors)[0], self.topology.grid(self.names)[0]

    def inference_path(self) -> tuple[list, list, list[int] | None]:
        """The actors a forward-only pass runs through, in virtual-stage order (`chunks.inference_path`)."""
        self.idle("inference")
        return chunks.inference_path(*chunks.inference_group(self.topology, self.actors, self.names), self.schedule)

    def actor_plan(self) -> list[list[tuple[int, int]]]:
        """Per actor, the layer ranges of the virtual stages it holds."""
        return chunks.actor_plan(self.plan, self.schedule)


def reference_after_load(meta: dict[str, Any]) -> str | None:
    """The reference policy of a run resumed from a checkpoint with manifest `meta`: the adapters off
    when it started from a new adapter; a frozen copy of the adapters it started from, loaded from
    the checkpoint, when it started from loaded ones; "not_saved" when that copy is not in it (a run
    at tp or ep > 1, or a checkpoint from before copies were saved); None for a checkpoint of a run
    without one (the first DPO or GRPO step captures the loaded weights as the reference: a run
    starting from an SFT run's checkpoint)."""
    kind = meta.get("reference")
    return "not_saved" if kind == "frozen_copy" and not meta.get("reference_saved") else kind
