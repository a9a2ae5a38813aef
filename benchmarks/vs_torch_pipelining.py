"""raypipe vs torch.distributed.pipelining on the same simulated stages, side by side in one run.

p = 4 actors (torch: 4 ranks joined by gloo on CPU), m = 16 microbatches, every schedule
paired with torch's of the same kind:

    gpipe - ScheduleGPipe                  1f1b - Schedule1F1B
    interleaved-1f1b - ScheduleInterleaved1F1B (2 chunks per actor)
    zb-h1 - ScheduleInterleavedZeroBubble (one stage per rank: its ZB-H1)
    zb-v - ScheduleZBVZeroBubble (2 chunks per actor in a V)
    dualpipe-v - ScheduleDualPipeV (the same V, forwards paired with the other chunk's backwards)

The model is 2p `SimulatedCompute` layers whose backward is split into an input-gradient
part and a weight-gradient part (`weight_s`), each layer sleeping t/2 in its forward, its
input gradient and its weight gradient: a stage of one chunk (two layers) costs tf = tb =
tw = t per microbatch, a chunk of the chunked schedules half that, so every schedule runs
the same model. t in {10, 2} ms. The two frameworks alternate, schedule by schedule,
`--rounds` times; the report gives the median step time of each (a step run alone, all
torch ranks lined up before and after; raypipe's `Trainer.step`), their ratio (below 1:
raypipe faster), each round's ratio, the same for steps back to back (torch's ranks
looping; raypipe's `Trainer.fit`), raypipe's planned bubble and the bubble measured from
its actors' own timestamps (idle share of the step's action span, all actors), and where
raypipe's step went (`Timeline.breakdown`: the busiest actor's actions, the idle time the
schedule leaves with those durations, waits for messages beyond it, and the time around the
actions: the call, the closing agreement, the optimizer step, the reply). The planned
bubble is the always-early one: a whole backward hands its input gradient on before its weight
gradients, which each actor does where its timings of both ways, run through the schedule,
say it pays (`raypipe.actors.step.hand_on`; `--late-gradients` also runs raypipe always sending it
after them, as torch does).

`--classic` runs the earlier comparison instead: one layer per stage, tf = tb, no split
backward, GPipe and 1F1B only.

    python benchmarks/vs_torch_pipelining.py [--steps 5] [--rounds 3] [--only zb-v,1f1b] [--times 10,2] [--classic]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # modules shared with the tests
import json_out  # noqa: E402

P, M = 4, 16
TORCH = {
    "gpipe": ("ScheduleGPipe", "loop", 1),
    "1f1b": ("Schedule1F1B", "loop", 1),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", "loop", 2),
    "zb-h1": ("ScheduleInterleavedZeroBubble", "loop", 1),
    "zb-v": ("ScheduleZBVZeroBubble", "v", 2),
    "dualpipe-v": ("ScheduleDualPipeV", "v", 2),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def layers(t: float, classic: bool) -> list:
    """The model: p layers of (t, t) for the classic rows, else 2p of (t/2, t/2, weight t/2)."""
    from raypipe import LayerSpec
    from raypipe.models.simulated import SimulatedCompute

    if classic:
        return [LayerSpec(SimulatedCompute, t, t) for _ in range(P)]
    return [LayerSpec(SimulatedCompute, t / 2, t / 2, weight_s=t / 2) for _ in range(2 * P)]


def _torch_rank(rank: int, port: int, schedule: str, t: float, steps: int, classic: bool, out) -> None:
    import torch.distributed as dist
    from torch.distributed import pipelining

    from raypipe import build_layers

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=P)
    name, style, chunks = TORCH[schedule]
    model = build_layers(layers(t, classic), 0)
    per = len(model) // (P * chunks)
    indices = [rank] if chunks == 1 else [rank, rank + P] if style == "loop" else [rank, 2 * P - 1 - rank]
    modules = [torch.nn.Sequential(*model[i * per : (i + 1) * per]) for i in indices]
    stages = [pipelining.PipelineStage(mod, i, P * chunks, torch.device("cpu")) for mod, i in zip(modules, indices)]
    cls = getattr(pipelining.schedules, name)
    single = name in ("ScheduleGPipe", "Schedule1F1B")  # the others take a list of the rank's stages
    pipe = cls(stages[0] if single else stages, M, loss_fn=torch.nn.functional.mse_loss)
    params = [p for mod in modules for p in mod.parameters()]
    opt = torch.optim.SGD(params, lr=1e-3)
    x, y = torch.randn(M, 8), torch.randn(M, 8)
    first, last = 0 in indices, P * chunks - 1 in indices

    def train_step() -> None:
        opt.zero_grad()
        kwargs = {"target": y, "losses": []} if last else {}
        pipe.step(*([x] if first else []), **kwargs)
        opt.step()

    times = []
    for k in range(steps + 2):  # one step at a time, all ranks lined up before and after each
        dist.barrier()
        started = time.perf_counter()
        train_step()
        dist.barrier()
        if k >= 2:
            times.append(time.perf_counter() - started)
    dist.barrier()  # then `steps` steps back to back, as a training loop runs them
    started = time.perf_counter()
    for _ in range(steps):
        train_step()
    dist.barrier()
    loop = (time.perf_counter() - started) / steps
    if rank == 0:
        out.put((statistics.median(times), loop))
    dist.destroy_process_group()


def torch_step_time(schedule: str, t: float, steps: int, classic: bool) -> tuple[float, float]:
    """(median time of a step run alone, time per step of `steps` steps back to back)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_torch_rank, args=(r, port, schedule, t, steps, classic, out)) for r in range(P)]
    for proc in procs:
        proc.start()
    try:
        return out.get(timeout=300)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()


def raypipe_trainer(schedule: str, t: float, classic: bool, engine: str | None, suffix: str = ""):
    from raypipe import TrainConfig, Trainer

    name, _, transport = (engine or TrainConfig.engine).partition(":")
    config = TrainConfig(
        pp=P,
        schedule=schedule,
        microbatches=M,
        optimizer={"name": "sgd", "lr": 1e-3},
        cpus_per_actor=0.01,
        threads_per_actor=1,
        engine=name,
        same_node_transport=transport or TrainConfig.same_node_transport,
        name=f"vs-torch-{schedule}-{name}{suffix}",
    )
    return Trainer(layers(t, classic), torch.nn.functional.mse_loss, config)


@contextlib.contextmanager
def late_gradients():
    """RAYPIPE_LATE_GRADIENTS=1 while a trainer starts or reconfigures (read on the driver then):
    its stages send a whole backward's input gradient after their weight gradients, as torch's."""
    os.environ["RAYPIPE_LATE_GRADIENTS"] = "1"
    try:
        yield
    finally:
        del os.environ["RAYPIPE_LATE_GRADIENTS"]


def measured_bubble(trainer) -> float:
    """The idle share of the last step's action span over all actors, from their timestamps."""
    line = trainer.timeline()
    return 1.0 - sum(line.busy()) / line.num_stages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="torch and raypipe alternate this many times per configuration; medians are reported",
    )
    parser.add_argument(
        "--engine",
        default=None,
        help="raypipe engine (p2p or compiled; p2p:gloo for gloo between same-node stages); default: TrainConfig's",
    )
    parser.add_argument("--only", default=None, help="comma-separated schedules (default: all six)")
    parser.add_argument(
        "--classic", action="store_true", help="the earlier rows: one layer per stage, tf = tb, no split"
    )
    parser.add_argument("--times", default="10,2", help="t in ms, comma-separated")
    parser.add_argument(
        "--late-gradients",
        action="store_true",
        help="also run raypipe sending each whole backward's input gradient after its weight gradients, as torch does",
    )
    args = parser.parse_args()
    import ray
    from pipeline_efficiency import measure  # the same raypipe timing as the efficiency benchmark

    from raypipe import bubble, build_schedule

    schedules = ["gpipe", "1f1b"] if args.classic else (args.only.split(",") if args.only else list(TORCH))
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    rows = []
    for t in [float(v) / 1000 for v in args.times.split(",")]:
        for schedule in schedules:
            with contextlib.ExitStack() as stack:
                trainer = stack.enter_context(raypipe_trainer(schedule, t, args.classic, args.engine))
                late = None
                if args.late_gradients:
                    with late_gradients():
                        late = stack.enter_context(raypipe_trainer(schedule, t, args.classic, args.engine, "-late"))
                torch_rounds, raypipe_rounds, torch_loops, raypipe_loops, bubbles, lates = [], [], [], [], [], []
                breakdowns = []
                for _ in range(args.rounds):
                    single, loop = torch_step_time(schedule, t, args.steps, args.classic)
                    torch_rounds.append(single)
                    torch_loops.append(loop)
                    result = measure(trainer, schedule, M, args.steps, t)
                    raypipe_rounds.append(result["step_s"])
                    raypipe_loops.append(result["fit_step_s"])
                    trainer.step(torch.randn(M, 8), torch.randn(M, 8))
                    bubbles.append(measured_bubble(trainer))
                    breakdowns.append(trainer.timeline().breakdown.to_dict())
                    if late is not None:
                        with late_gradients():  # measure reconfigures: the setting is read again
                            lates.append(measure(late, schedule, M, args.steps, t)["step_s"])
                torch_s, raypipe_s = statistics.median(torch_rounds), statistics.median(raypipe_rounds)
                torch_loop, raypipe_loop = statistics.median(torch_loops), statistics.median(raypipe_loops)
                chunk = t / TORCH[schedule][2]  # one chunk's F, I and W
                costs = {"F": t, "B": t} if args.classic else {"F": chunk, "I": chunk, "W": chunk}
                planned = bubble(build_schedule(schedule, P, M), costs, early_gradients=True)
                work = M * (2 if args.classic else 3) * t  # one actor's compute per step
                row = {
                    "engine": trainer.config.engine,
                    "same_node_transport": trainer.config.same_node_transport,
                    "schedule": schedule,
                    "torch_schedule": TORCH[schedule][0],
                    "p": P,
                    "m": M,
                    "t_ms": 1000 * t,
                    "split_backward": not args.classic,
                    "ideal_s": work / (1 - planned),
                    "planned_bubble": planned,
                    "measured_bubble": statistics.median(bubbles),
                    # where raypipe's step went (`Timeline.breakdown`), medians over the rounds, ms
                    "breakdown_ms": {
                        key: statistics.median(max(b[key]) if key == "busy_ms" else b[key] for b in breakdowns)
                        for key in ("step_ms", "busy_ms", "schedule_idle_ms", "messages_ms", "outside_ms")
                    },
                    "torch_step_s": torch_s,
                    "raypipe_step_s": raypipe_s,
                    "ratio_raypipe_over_torch": raypipe_s / torch_s,
                    "ratio_per_round": [r / q for r, q in zip(raypipe_rounds, torch_rounds)],
                    "torch_loop_step_s": torch_loop,
                    "raypipe_fit_step_s": raypipe_loop,
                    "ratio_loop_raypipe_over_torch": raypipe_loop / torch_loop,
                    "ratio_loop_per_round": [r / q for r, q in zip(raypipe_loops, torch_loops)],
                }
                if lates:
                    row["raypipe_late_gradients_step_s"] = statistics.median(lates)
                    row["ratio_early_over_late"] = raypipe_s / statistics.median(lates)
                    row["ratio_early_over_late_per_round"] = [r / q for r, q in zip(raypipe_rounds, lates)]
                rows.append(row)
                json_out.emit(row)
    ray.shutdown()
    json_out.emit({"benchmark": "vs_torch_pipelining", "rows": rows})


if __name__ == "__main__":
    json_out.run(main)
