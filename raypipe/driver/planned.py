"""What a new trainer settles before any of its actors start: that its checkpoint_dir is its own,
its first split of the layers, Ray joined and the user's code reachable from the actors, and for
`partition="profile"` or `schedule="auto"` the split (and schedule) its profiled layers choose."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from raypipe.config import TrainConfig
from raypipe.core.layers import LayerSpec
from raypipe.driver import checkpoints
from raypipe.driver.cluster import placement
from raypipe.driver.cluster.connect import connect, ship_user_code
from raypipe.driver.cluster.topology import Topology
from raypipe.nn.plan import check_stages_split
from raypipe.observe.phases import Phase
from raypipe.planning.autoschedule import plan_run
from raypipe.planning.partition import first_plan
from raypipe.planning.profiling import PlanReport


def plan(
    specs: Sequence[LayerSpec],
    loss_fn: Callable,
    config: TrainConfig,
    sample: Any,
    log: Callable[[str], None],
    model: object = None,
) -> tuple[TrainConfig, list[tuple[int, int]], PlanReport | None]:
    """The config to run (with "auto" chosen, LoRA's targets resolved), the layer range of each
    (virtual) stage, and the profiled plan's report (None when the split was not profiled).

    Raises:
        CheckpointError: a new run's checkpoint_dir holds another run's checkpoints.
        ConfigError: the config does not fit the model.
    """
    checkpoints.check_new_run(config.checkpoint_dir, config.resume)  # before any actor (the profiler's) starts
    if config.lora is not None:  # "all-linear" made a list, and targets that match nothing refused, as peft does
        config = config.replace(lora=lora_targets(specs, config.lora, model))
    layer_plan, tp_splits, profiled = first_plan(specs, config, sample is not None)
    connect()
    ship_user_code(
        [loss_fn] + [s.factory for s in specs] + [type(a) for s in specs for a in (*s.args, *s.kwargs.values())]
    )
    if not profiled:
        return config, layer_plan, None
    # time every layer on each device kind of the run and split by those times
    cpus = placement.cpus_per_actor(config, len(Topology(config.pp, config.dp, config.tp, config.ep).names()))
    auto = [f"{k}=auto" for k in ("schedule", "sequence_chunks") if getattr(config, k) == "auto"]
    with Phase(f"profiling the layers to choose {' and '.join(auto) or 'the split'}", log):
        config, report = plan_run(specs, loss_fn, sample, config, cpus, log)
    check_stages_split(tp_splits, report.plan, config.tp)
    return config, report.plan, report


def lora_targets(specs: Sequence[LayerSpec], lora: dict[str, Any], model: Any) -> dict[str, Any]:
    """`lora.resolve` on the model's layers built on the meta device (and its transformers skeleton)."""
    import torch

    from raypipe.nn import lora as lora_

    with torch.device("meta"):
        layers = [spec.build() for spec in specs]
    whole = model.skeleton() if hasattr(model, "skeleton") else None  # a transformers model's whole, on meta
    return lora_.resolve(lora, layers, whole)
