"""Where `Trainer.fit` gets each step's batch: a function of the step, any iterable of batches,
or a Ray Dataset read beside the actors so that its batches never pass through the driver.

Each feed answers `get(step)` with the step's batch cut for the actors (`Prepared`), for any
step again after a recovery or a resume: the data position of a run is its step.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import TYPE_CHECKING, Protocol, TypeGuard

from raypipe.config.engines import engine_kind, engines_that
from raypipe.core.errors import BatchError, ConfigError
from raypipe.data.batches import Prepared, prepare

if TYPE_CHECKING:
    from types import ModuleType

    from ray import ObjectRef
    from ray.actor import ActorHandle
    from ray.data import Dataset

    from raypipe.driver.actor_group import ActorGroup


#: a Ray Dataset's rows as lists of records, which the feed that made it closes (`records_of`)
RecordLists = Generator[list[dict[str, object]], None, None]


class Feed(Protocol):
    """What `Trainer.fit` reads its steps from: each step's batch cut for the actors, again for
    any step after a recovery; in an actor-driven run the reader the actors call instead."""

    def get(self, step: int) -> Prepared: ...

    def reader_for_actors(self) -> object: ...

    def kept_from(self, step: int) -> None: ...

    def close(self) -> None: ...


class FunctionFeed:
    """`batches(step) -> (x, y)`, cut on the driver."""

    def __init__(self, group: ActorGroup, batches: Callable[[int], tuple[object, object]]) -> None:
        self.group, self.batches = group, batches
        self.reader: ActorHandle | None = None  # in an actor-driven run: the trainer's reader actor, calling `batches`
        self.owned: RecordLists | None = None  # a generator the feed made (`records_of`), closed with it

    def get(self, step: int) -> Prepared:
        c = self.group.config
        prepared = prepare(*self.batches(step), c.dp, c.microbatches, self.group.loss_fn)
        figures = getattr(self.batches, "figures", None)  # a GRPO generation's (`inference.rollout`)
        prepared.extra = figures.pop(step, None) if figures else None
        return prepared

    def reader_for_actors(self) -> object:
        """A reader actor that calls `batches(step)` for the actors of an actor-driven run, on the
        driver's node (where the function's files are); the trainer keeps it for its next `fit`,
        since starting one takes seconds (a process that imports torch), and makes another after
        a restart of its actors, which stops it with them.

        Raises:
            ConfigError: Ray could not send the function to the reader.
        """
        if self.reader is None or self.reader is not self.group.reader:
            import ray

            from raypipe.driver.cluster.connect import ship_user_code

            c = self.group.config
            code = getattr(self.batches, "__code__", None)
            names = getattr(self.batches, "__globals__", {})  # what it calls from the user's modules too
            ship_user_code([self.batches, *(names.get(n) for n in (code.co_names if code else ()) if n in names)])
            try:
                self.reader = self._told(ray)
            except Exception as error:  # noqa: BLE001 - Ray could not pickle the function
                raise ConfigError(
                    f"TrainConfig.actor_steps={c.actor_steps!r}: the actors call batches(step) in a reader "
                    f"actor, and it could not be sent there ({type(error).__name__}: {error}); give a "
                    f"function Ray can pickle, a ray.data.Dataset, or actor_steps=0"
                ) from error
        return self.reader

    def _told(self, ray: ModuleType) -> ActorHandle:
        """The trainer's reader, told to call `batches` from now on (a new one where it died)."""
        try:
            return self._tell(ray)
        except ray.exceptions.RayActorError:  # it died since the last fit
            self.group.reader = None
            return self._tell(ray)

    def _tell(self, ray: ModuleType) -> ActorHandle:
        c, reader = self.group.config, self.group.function_reader()
        told: ObjectRef = reader.use.remote(self.batches, c.dp, c.microbatches, self.group.loss_fn)
        ray.get(told, timeout=c.actor_start_timeout)
        return reader

    def kept_from(self, step: int) -> None:
        """No recovery replays steps before `step`: a function that keeps what it made (a GRPO
        run's generation batches) may let go of theirs."""
        keep = getattr(self.batches, "kept_from", None)
        if keep is not None:
            keep(step)

    def close(self) -> None:
        """Lets go of the trainer's reader, kept for its next fit, and of the batches it made; ends
        the reading it started (a Ray Dataset's iterator, while Ray is up)."""
        if self.reader is not None and self.reader is self.group.reader:  # not one a restart stopped
            self.reader.forget.remote()  # the parts it stored would stay pinned in the object store
        self.reader = None
        if self.owned is not None:
            self.owned.close()


class IterableFeed(FunctionFeed):
    """Batches `(x, y)` from an iterable (a DataLoader, a generator), batch k for step k: a run
    that starts at step N skips the first N. The batches from the last checkpoint on are kept,
    for the steps a recovery replays."""

    def __init__(self, group: ActorGroup, iterable: Iterable[tuple[object, object]]) -> None:
        super().__init__(group, self._batch)
        self.items: Iterator[tuple[object, object]] = iter(iterable)
        self.kept: dict[int, tuple[object, object]] = {}
        self.read = 0  # batches taken from the iterable so far
        self.oldest = 0  # no step before this one can be asked for again

    def _batch(self, step: int) -> tuple[object, object]:
        if step < self.oldest or (step < self.read and step not in self.kept):
            raise BatchError(
                f"step {step + 1}'s batch was read from the iterable and dropped: an iterable is read "
                f"once, and only batches from the last checkpoint on are kept; give batches(step) -> "
                f"(x, y) or a ray.data.Dataset to replay any step"
            )
        while self.read <= step:
            try:
                item = next(self.items)
            except StopIteration:
                raise BatchError(
                    f"the iterable of batches ended after {self.read} batches; step {step + 1} needs batch {step + 1}"
                ) from None
            if self.read >= self.oldest:
                self.kept[self.read] = item
            self.read += 1
        return self.kept[step]

    def reader_for_actors(self) -> object:
        raise ConfigError(
            f"TrainConfig.actor_steps={self.group.config.actor_steps}: an iterable of batches is read on the "
            f"driver, one at a time; give batches(step) -> (x, y) or a ray.data.Dataset, or actor_steps=0"
        )

    def kept_from(self, step: int) -> None:
        """No step before `step` will be replayed (it is checkpointed, or nothing restores earlier)."""
        self.oldest = max(self.oldest, step)
        for old in [k for k in self.kept if k < self.oldest]:
            del self.kept[old]


class DatasetFeed:
    """A `ray.data.Dataset` read by a `DatasetReader` actor (`raypipe.actors.io.reader`), which cuts
    each batch for the stage actors and stores the parts; the driver holds references only. The
    next step's batch is read while the current one trains."""

    def __init__(self, group: ActorGroup, dataset: object, batch_size: int, collate: Callable | None = None) -> None:
        import ray

        from raypipe.actors.io.reader import DatasetReader
        from raypipe.driver.cluster.placement import cpus_per_actor

        c = group.config
        if not engine_kind(c.engine).whole_step_calls:
            raise ConfigError(
                f"TrainConfig.engine={c.engine!r} is invalid with a ray.data.Dataset: its calls carry each microbatch "
                f"from the driver; use the {engines_that('whole_step_calls')} engines (engine='p2p', the default)."
            )
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ConfigError(
                f"batch_size={batch_size!r} is invalid: a ray.data.Dataset is read batch_size rows per "
                f"step; give fit(dataset, steps, batch_size=N), N a multiple of dp x microbatches."
            )
        free = ray.available_resources().get("CPU", 0.0)
        if free < 1:
            warnings.warn(
                f"raypipe: {free:g} CPUs of the cluster are free beside the trainer's actors, and Ray "
                f"Data's tasks each need one to make the dataset's blocks: lower TrainConfig.cpus_per_actor "
                f"(now {cpus_per_actor(c, len(group.names)):g}) or add a node, else the first batch "
                f"never comes.",
                stacklevel=3,
            )
        from raypipe.driver.cluster.helper_actors import helper_options

        self.reader = (
            ray.remote(DatasetReader)
            .options(num_cpus=0, max_restarts=0, **helper_options(group.run_name, "dataset-reader"))
            .remote(dataset, batch_size, collate, c.dp, c.microbatches, group.loss_fn, cpus=free)
        )
        self.group, self.asked = group, {}  # step -> ((dp, microbatches) it was cut for, its reference)
        self.timeout = c.step_timeout

    def get(self, step: int) -> Prepared:
        import ray

        cut = (self.group.config.dp, self.group.config.microbatches)  # an elastic shrink changes them
        for ahead in (step, step + 1):  # the reader answers in order: the next batch is read meanwhile
            if self.asked.get(ahead, (cut,))[0] != cut:
                del self.asked[ahead]
            if ahead not in self.asked:
                self.asked[ahead] = (cut, self.reader.batch.remote(ahead, cut))
        try:
            return ray.get(self.asked.pop(step)[1], timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            raise BatchError(
                f"the dataset gave no batch for step {step + 1} within {self.timeout:.0f} s "
                f"(TrainConfig.step_timeout); {ray.available_resources().get('CPU', 0.0):g} CPUs are "
                f"free for Ray Data's tasks"
            ) from None
        except ray.exceptions.RayTaskError as error:
            if isinstance(error.cause, (BatchError, ConfigError)):  # the dataset's fault: said plainly
                raise error.cause from None
            raise

    def reader_for_actors(self) -> object:
        """The reader, which the actors of an actor-driven run ask themselves."""
        return self.reader

    def kept_from(self, step: int) -> None:
        pass

    def close(self) -> None:
        """Stops the reader, after the batch it may still be reading ahead (at most `timeout` s), so
        that it does not die in the middle of Ray Data's work and report that."""
        import ray

        pending, self.asked = [ref for _, ref in self.asked.values()], {}
        if pending:
            ray.wait(pending, num_returns=len(pending), timeout=min(self.timeout, 30.0))
        try:  # it ends its read and exits; killed only when it does not within 30 s
            ray.get(self.reader.stop.remote(), timeout=30.0)
        except Exception:  # noqa: BLE001 - exiting ends the call with the actor's death: expected
            pass
        ray.kill(self.reader)


def make_feed(group: ActorGroup, batches: object, batch_size: int | None, collate: Callable | None) -> Feed:
    """The feed for what `Trainer.fit` was given, cut for `group`'s actors (an `ActorGroup`). Under
    an objective each step's records (pairs, examples) become its rows and the answers of the
    passes it declares (`inference.objective.objective_batch`) as the feed takes them; an objective
    that generates its rows (GRPO) generates from and scores each batch of prompt records first
    (`inference.rollout.GenerationBatches`)."""
    if group.config.objective is not None:
        from raypipe.driver.inference.objective import objective_batch
        from raypipe.objectives import objective_for

        objective = objective_for(group.config.objective)
        owned: RecordLists | None = None
        if _is_dataset(batches):  # its rows are the records, read in order on the driver
            batches = owned = records_of(batches, batch_size, objective.record)
        if objective.generates:
            from raypipe.driver.inference.rollout import GenerationBatches

            feed = FunctionFeed(group, GenerationBatches(group, group.model.kv_cache, batches))
        elif callable(batches):
            feed = FunctionFeed(group, lambda k, records=batches: objective_batch(group, records(k)))
        elif _iterable(batches):
            feed = IterableFeed(group, (objective_batch(group, records) for records in batches))
        else:
            raise _not_batches(batches)
        feed.owned = owned
        return feed
    if _is_dataset(batches):
        return DatasetFeed(group, batches, batch_size, collate)
    if callable(batches):
        return FunctionFeed(group, batches)
    if _iterable(batches):
        return IterableFeed(group, batches)
    raise _not_batches(batches)


def _iterable(batches: object) -> TypeGuard[Iterable]:
    return isinstance(batches, Iterable) and not isinstance(batches, (str, bytes))


def _not_batches(batches: object) -> TypeError:
    return TypeError(
        f"fit takes batches(step) -> (x, y), an iterable of (x, y), or a ray.data.Dataset; got {type(batches).__name__}"
    )


def records_of(dataset: Dataset, size: int | None, kind: str) -> RecordLists:
    """A Ray Dataset's rows as lists of `size` records (a DPO step's pairs, a GRPO generation
    batch's prompts), in order, their arrays as lists; a last shorter list is left out.

    Raises:
        ConfigError: no `size` was given.
    """
    if not size:
        raise ConfigError(f"fit(a ray.data.Dataset of {kind} records) needs batch_size: the {kind}s of each step")
    chunk: list[dict[str, object]] = []
    for row in dataset.iter_rows():
        chunk.append({k: v.tolist() if hasattr(v, "tolist") else v for k, v in row.items()})
        if len(chunk) == size:
            yield chunk
            chunk = []


def _is_dataset(value: object) -> TypeGuard[Dataset]:
    """Whether `value` is a `ray.data.Dataset`, without importing Ray Data where nothing has (0.7 s
    on 2 cores, paid by every first `fit` of a function or a list): a Dataset exists only once it has."""
    dataset = getattr(sys.modules.get("ray.data"), "Dataset", None)
    return dataset is not None and isinstance(value, dataset)
