"""raypipe vs torch.distributed.pipelining on the same simulated stages, side by side in one run.

p = 4 stages, each one `SimulatedCompute` layer (forward sleeps tf, backward tb),
m = 16 microbatches, GPipe and 1F1B, tf = tb in {2, 10} ms. torch runs p processes
joined by gloo on CPU (`PipelineStage` + `ScheduleGPipe` / `Schedule1F1B`, then an
SGD step); raypipe runs its Trainer. The two alternate, configuration by
configuration, `--rounds` times, and the report gives each median step time, the
ratio raypipe / torch (below 1.0: raypipe is faster) and each round's ratio: for
steps run one at a time (torch's ranks line up before and after each; raypipe's
`Trainer.step`), and for steps run back to back as a training loop does (torch's
ranks looping; raypipe's `Trainer.fit`, which keeps the next step queued).

    python benchmarks/vs_torch_pipelining.py [--steps 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp

P, M = 4, 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torch_rank(rank: int, port: int, schedule: str, t: float, steps: int, out) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from raypipe.simulated import SimulatedCompute

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=P)
    module = SimulatedCompute(t, t)
    stage = PipelineStage(module, rank, P, torch.device("cpu"))
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    pipe = cls(stage, M, loss_fn=torch.nn.functional.mse_loss)
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    x, y = torch.randn(M, 8), torch.randn(M, 8)

    def train_step() -> None:
        opt.zero_grad()
        if rank == 0:
            pipe.step(x)
        elif rank == P - 1:
            pipe.step(target=y, losses=[])
        else:
            pipe.step()
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


def torch_step_time(schedule: str, t: float, steps: int) -> tuple[float, float]:
    """(median time of a step run alone, time per step of `steps` steps back to back)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_torch_rank, args=(r, port, schedule, t, steps, out)) for r in range(P)]
    for proc in procs:
        proc.start()
    try:
        return out.get(timeout=300)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3,
                        help="torch and raypipe alternate this many times per configuration; medians are reported")
    parser.add_argument("--engine", default=None, help="raypipe engine (refs, p2p or compiled; p2p:gloo for gloo between same-node stages); default: TrainConfig's")
    args = parser.parse_args()
    import ray
    from pipeline_efficiency import measure, simulated_trainer  # the same raypipe set-up and timing

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    rows = []
    for t in (0.010, 0.002):
        with simulated_trainer(t, *([args.engine] if args.engine else [])) as trainer:
            for schedule in ("gpipe", "1f1b"):
                torch_rounds, raypipe_rounds, torch_loops, raypipe_loops = [], [], [], []
                for _ in range(args.rounds):
                    single, loop = torch_step_time(schedule, t, args.steps)
                    torch_rounds.append(single)
                    torch_loops.append(loop)
                    result = measure(trainer, schedule, M, args.steps, t)
                    raypipe_rounds.append(result["step_s"])
                    raypipe_loops.append(result["fit_step_s"])
                torch_s, raypipe_s = statistics.median(torch_rounds), statistics.median(raypipe_rounds)
                torch_loop, raypipe_loop = statistics.median(torch_loops), statistics.median(raypipe_loops)
                ideal = (M + P - 1) * 2 * t
                row = {"engine": trainer.config.engine, "same_node_transport": trainer.config.same_node_transport, "schedule": schedule, "p": P, "m": M, "tf_ms": 1000 * t, "tb_ms": 1000 * t,
                       "ideal_s": ideal, "torch_step_s": torch_s, "raypipe_step_s": raypipe_s,
                       "torch_efficiency": ideal / torch_s, "raypipe_efficiency": ideal / raypipe_s,
                       "ratio_raypipe_over_torch": raypipe_s / torch_s,
                       "ratio_per_round": [r / q for r, q in zip(raypipe_rounds, torch_rounds)],
                       # training loops: torch's ranks looping, raypipe's Trainer.fit
                       "torch_loop_step_s": torch_loop, "raypipe_fit_step_s": raypipe_loop,
                       "torch_loop_efficiency": ideal / torch_loop, "raypipe_fit_efficiency": ideal / raypipe_loop,
                       "ratio_loop_raypipe_over_torch": raypipe_loop / torch_loop,
                       "ratio_loop_per_round": [r / q for r, q in zip(raypipe_loops, torch_loops)]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    ray.shutdown()
    print(json.dumps({"benchmark": "vs_torch_pipelining", "rows": rows}))


if __name__ == "__main__":
    main()
