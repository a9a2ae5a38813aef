"""`raypipe` on the command line: train, show a shard plan, draw the architecture, show a schedule,
print this machine's `ray start` arguments."""

from __future__ import annotations

import argparse
import json
import sys

from raypipe.core.errors import ConfigError, RaypipeError
from raypipe.schedules import SCHEDULES


def _train(args: argparse.Namespace) -> int:
    from raypipe.job import JobConfig, run

    config = JobConfig.from_yaml(args.config, args.set)
    run(config, log=lambda line: print(line, flush=True), resume=args.resume, resume_step=args.resume_step)
    return 0


def _schedule(args: argparse.Namespace) -> int:
    from raypipe.schedules import (
        OVERLAPPED,
        bubble,
        build_schedule,
        format_schedule,
        overlapped_pairs,
        peak_in_flight,
        virtual_stages,
    )

    if args.name not in SCHEDULES:
        raise ConfigError(f"schedule {args.name!r} is unknown: choose one of {', '.join(SCHEDULES)}.")
    schedule = build_schedule(args.name, args.pp, args.microbatches, args.chunks, sequence_chunks=args.sequence_chunks)
    print(format_schedule(schedule))
    print("virtual stages per actor:", virtual_stages(schedule))
    print("peak (chunk) microbatches in flight per actor:", [peak_in_flight(a) for a in schedule])
    print(f"planned bubble with F = I = W: {bubble(schedule, {'F': 1, 'I': 1, 'W': 1}):.3f}")
    if SCHEDULES[args.name].overlapped:
        pairs = sum(len(overlapped_pairs(a)) for a in schedule)
        as_blocks = bubble(schedule, {"F": 1, "I": 1, "W": 1, OVERLAPPED: 3})
        print(f"overlapped F&B pairs: {pairs}; planned bubble with each pair one block (F&B = F + B): {as_blocks:.3f}")
    if args.output:
        from raypipe.observe.timeline import Timeline

        title = f"{args.name}, p={args.pp}, m={args.microbatches} (planned; backward = {args.backward:g} x forward)"
        path = Timeline.planned(schedule, 1.0, args.backward, title).save(args.output)
        print(f"wrote {path}")
    return 0


def _diagram(args: argparse.Namespace) -> int:
    import torch

    from raypipe.job import JobConfig
    from raypipe.observe.diagram import Architecture

    config = JobConfig.from_yaml(args.config, args.set)
    train, model = config.train, config.model
    rows = max(1, config.job.batch_size // (train.dp * train.microbatches))
    sample = torch.zeros(rows, model.block_size, dtype=torch.long, device="meta")  # one microbatch
    arch = Architecture.from_config(
        model.build().layers,
        train,
        sample,
        title=f"{args.config}: {model.describe()}, "
        f"pp={train.pp} x dp={train.dp}{f' (ep={train.ep})' if train.ep > 1 else ''} x tp={train.tp}, {train.schedule}, "  # noqa: E501
        f"{train.microbatches} microbatches of {rows}",
    )
    print(f"wrote {arch.save(args.output)}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from raypipe.core.layers import parameter_counts
    from raypipe.job import JobConfig
    from raypipe.planning.partition import is_profiled, make_plan
    from raypipe.schedules import build_schedule, owners

    config = JobConfig.from_yaml(args.config, args.set)
    specs = config.model.build().layers
    counts = parameter_counts(specs)
    train = config.train
    how = "shard_plan" if train.shard_plan is not None else f"partition={train.partition}"
    print(f"{len(specs)} layers, {sum(counts):,} parameters, pp={train.pp} ({how})")
    if args.links:  # starts the stages where the run would, measures their links, plans for them
        train, plan, report = _linked_plan(config)
    elif is_profiled(train):
        train, report = _profiled_plan(config, specs)  # prints what it found; "auto" also picks the schedule
        plan = report.plan
    else:
        plan = make_plan(len(specs), train.pp * train.num_chunks(), train.partition, train.shard_plan, counts)
        report = None
    on = owners(
        build_schedule(
            train.schedule, train.pp, train.microbatches, train.chunks, train.extra_warmup, train.sequence_chunks
        )
    )
    for v, (start, end) in enumerate(plan):
        name = f"stage {v}" if train.num_chunks() == 1 else f"virtual stage {v} (stage {on[v]})"
        print(f"{name}: layers [{start}, {end})  {sum(counts[start:end]):>12,} parameters")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict() if report else {"plan": [list(r) for r in plan]}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _linked_plan(config):
    """Starts the job's stages on the cluster (without checkpoints or loggers), which measure the
    links between them, and with a profiled plan plan again for those links; prints the links and
    returns (the train config, the plan, the plan report or None)."""
    from raypipe.trainer import Trainer

    train = config.train.replace(checkpoint_dir=None, resume=False, loggers=[], name=None)
    with Trainer(config.model.build(), config=train, sample=_sample(config), log=print) as trainer:
        print("links between neighbouring stages:")
        for link in trainer.group.links:
            print(f"  {link}")
        return trainer.config, trainer.plan, trainer.plan_report


def _profiled_plan(config, specs):
    """Times each layer on every device kind of the job (on the cluster it connects to) and splits by
    it, choosing the schedule too under `schedule="auto"`; returns (the train config, the report)."""
    from raypipe import driver
    from raypipe.planning.autoschedule import plan_run

    train = config.train
    loss_fn = config.model.build().loss_fn
    driver.connect()
    driver.ship_user_code([loss_fn] + [s.factory for s in specs])
    return plan_run(specs, loss_fn, _sample(config), train, train.cpus_per_actor or 1.0, print)


def _sample(config):
    """The job's first batch and its targets: what a profiled plan times the layers on."""
    x, y = config.data.dataset(config.model.block_size).batch(0, config.job.batch_size, seed=config.train.seed)
    return x, config.model.targets(x, y)


def _node_resources(args: argparse.Namespace) -> int:
    from raypipe.core.devices import detect

    acc = detect()
    if args.json:
        print(
            json.dumps(
                {
                    "kind": acc.kind,
                    "count": acc.count,
                    "model": acc.model,
                    "memory_bytes": acc.memory_bytes,
                    "dtypes": list(acc.dtypes),
                    "torch_device": acc.torch_device(),
                    "resources": acc.ray_resources(),
                    "labels": acc.ray_labels(),
                    "ray_start_args": acc.ray_start_args(),
                },
                indent=1,
            )
        )
    else:  # for `ray start ... $(raypipe node-resources)`: no argument holds a space, a quote or a glob
        print(" ".join(acc.ray_start_args()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from raypipe.job import add_resume_arguments  # the job module imports torch: only when parsing

    parser = argparse.ArgumentParser(prog="raypipe", description="Pipeline-parallel PyTorch training on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p: argparse.ArgumentParser) -> None:
        p.add_argument("config", help="job YAML, e.g. examples/configs/gpt_pp2.yaml")
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a field, e.g. --set microbatches=8 --set model.n_layer=2",
        )

    train = sub.add_parser("train", help="train the reference GPT as a job file says")
    with_config(train)
    add_resume_arguments(train)
    train.set_defaults(func=_train)

    plan = sub.add_parser(
        "plan",
        help="show how a job's model is split into stages, without training "
        "(partition=profile: times the layers on the cluster's devices first)",
    )
    with_config(plan)
    plan.add_argument("--json", metavar="PATH", help="also write the plan (and, profiled, every layer's times) as JSON")
    plan.add_argument(
        "--links",
        action="store_true",
        help="start the stages where the run would, measure the links between them and plan for those "
        "(partition=profile or schedule=auto)",
    )
    plan.set_defaults(func=_plan)

    diagram = sub.add_parser("diagram", help="draw a job's stages, actors and boundary tensors (no cluster needed)")
    with_config(diagram)
    diagram.add_argument(
        "-o", "--output", required=True, help="arch.png, .svg, .pdf (Graphviz), .dot or .mmd (Mermaid)"
    )
    diagram.set_defaults(func=_diagram)

    node = sub.add_parser(
        "node-resources", help="print the `ray start` arguments advertising this machine's accelerators"
    )
    node.add_argument("--json", action="store_true", help="everything detected, as JSON")
    node.set_defaults(func=_node_resources)

    sched = sub.add_parser("schedule", help="print a pipeline schedule's stage x time grid")
    sched.add_argument("name", nargs="?", default="1f1b", help=", ".join(SCHEDULES))
    sched.add_argument("--chunks", type=int, default=None, help="model chunks per actor (interleaved-1f1b)")
    sched.add_argument("--pp", type=int, default=4, help="pipeline stages")
    sched.add_argument("--microbatches", "-m", type=int, default=8)
    sched.add_argument(
        "--sequence-chunks", "-k", type=int, default=1, help="units per microbatch along the sequence (gpipe, 1f1b)"
    )
    sched.add_argument("-o", "--output", help="also draw its timeline: .svg, .png, .pdf or .json (Chrome trace)")
    sched.add_argument("--backward", type=float, default=2.0, help="backward time relative to forward, for -o")
    sched.set_defaults(func=_schedule)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, RaypipeError, ValueError) as error:
        print(f"raypipe: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:  # Ctrl-C, `ray job stop`: one line, no traceback
        from raypipe.job import stop_code

        return stop_code(stop)


if __name__ == "__main__":
    sys.exit(main())
