"""Training metrics: per-stage timing from the actors' own timestamps, and the Ray dashboard's series
(the experiment loggers, TensorBoard among them, are `raypipe.observe.loggers`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from raypipe.core.protocol import StepReport


def stage_metrics(reports: Sequence[StepReport]) -> list[dict[str, float]]:
    """Per stage: `forward_s`, `backward_s`, `bubble` (idle fraction of the pipeline's compute
    window), `peak_memory_bytes` and `memory` (it split into parameters / gradients / optimizer
    state / activations / other), `peak_stashed_microbatches` (kept for backward; a split
    backward's microbatch until its weight gradient), `peak_awaiting_weight_grad` (between input
    and weight gradient), `sent_bytes` (activations and input gradients sent to the neighbouring
    stages, in `boundary_dtype`; `fp32_sent_bytes` those of them in float32), with
    `measure_activations` `peak_stashed_bytes`, with `compile` `compiled` (graphs and graph
    breaks so far), and in a model
    with MoE layers `all_to_all_s`, `all_to_all_bytes` and `experts` (routed and dropped).

    The bubble of a stage is the share of the pipeline's compute window (first action
    start to last action end, over all stages) in which that stage ran nothing. The
    timestamps are each actor's wall clock, so across machines clock skew blurs it.
    """
    timings = [r.timing for r in reports]
    starts = [t.first_start for t in timings if t.forward_s > 0]
    ends = [t.last_end for t in timings if t.forward_s > 0]
    window = (max(ends) - min(starts)) if starts else 0.0
    result = []
    for report, t in zip(reports, timings):
        busy = t.forward_s + t.backward_s
        result.append(
            {
                "forward_s": t.forward_s,
                "backward_s": t.backward_s,
                "bubble": max(0.0, 1.0 - busy / window) if window > 0 else 0.0,
                "peak_memory_bytes": float(report.peak_memory_bytes),
                # the peak split: parameters, gradients, optimizer_state, activations, other
                "memory": dict(report.memory),
                "peak_stashed_microbatches": int(t.peak_stashed),
                # split backwards: microbatches between their input and weight gradients at once
                "peak_awaiting_weight_grad": int(t.peak_awaiting_weight),
                "sent_bytes": int(t.sent_bytes),
                "fp32_sent_bytes": int(t.fp32_sent_bytes),  # of them, in float32 (what bf16 would halve)
                **({"peak_stashed_bytes": float(t.peak_stashed_bytes)} if t.peak_stashed_bytes is not None else {}),
                # TrainConfig.compile: the actor's compiled graphs and graph breaks so far
                **({"compiled": dict(t.compiled)} if t.compiled is not None else {}),
                # MoE layers: seconds in all-to-all, bytes it sent, and per layer the assignments each
                # expert received and those dropped over capacity (as this actor routed them)
                **(
                    {"all_to_all_s": t.all_to_all_s, "all_to_all_bytes": int(t.all_to_all_bytes), "experts": t.experts}
                    if t.experts is not None
                    else {}
                ),
            }
        )
    return result


def step_metrics(
    step: int,
    losses: Sequence[float],
    seconds: float,
    samples: int,
    tokens: int | None,
    report: StepReport,
    lead_reports: Sequence[StepReport],
    fp16: bool,
) -> dict[str, Any]:
    """What `Trainer.step` returns for step `step` (1-based): the loss (mean of the microbatch
    losses), lr, global gradient norm, time and throughput, and per stage `stage_metrics`
    from each stage's lead actor; `loss_scale` under fp16."""
    metrics = {
        "step": step,
        "loss": sum(losses) / len(losses),
        "lr": report.lr,
        "grad_norm": report.grad_norm,
        "step_time": seconds,
        "samples": samples,
        "samples_per_s": samples / seconds,
    }
    if tokens is not None:
        metrics["tokens"] = tokens
        metrics["tokens_per_s"] = tokens / seconds
    metrics["skipped"] = report.skipped
    metrics["stages"] = stage_metrics(lead_reports)
    if fp16:
        metrics["loss_scale"] = report.loss_scale
    return metrics


class RayMetrics:
    """Exports each step through `ray.util.metrics`, for the Ray dashboard and Prometheus.

    Series (Prometheus adds Ray's `ray_` prefix): `raypipe_steps` (counter),
    `raypipe_step_seconds` (histogram), `raypipe_tokens_per_second` (or
    `raypipe_samples_per_second`), `raypipe_loss` (gauges), tagged with the run; and
    `raypipe_stage_busy_fraction` per stage, tagged with run, stage and the actor's rank.
    """

    BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]

    def __init__(self, run: str) -> None:
        from ray.util.metrics import Counter, Gauge, Histogram

        self.run = run
        tags = {"run": run}
        self.steps = Counter("raypipe_steps", "optimizer steps taken", tag_keys=("run",))
        self.step_seconds = Histogram(
            "raypipe_step_seconds",
            "wall time of a training step, seconds",
            boundaries=self.BOUNDARIES,
            tag_keys=("run",),
        )
        self.tokens = Gauge("raypipe_tokens_per_second", "training throughput, tokens/s", tag_keys=("run",))
        self.samples = Gauge("raypipe_samples_per_second", "training throughput, samples/s", tag_keys=("run",))
        self.loss = Gauge("raypipe_loss", "the last step's mean loss", tag_keys=("run",))
        self.busy = Gauge(
            "raypipe_stage_busy_fraction",
            "share of the step's compute window a stage spent in forward and backward",
            tag_keys=("run", "stage", "rank"),
        )
        for metric in (self.steps, self.step_seconds, self.tokens, self.samples, self.loss):
            metric.set_default_tags(tags)

    def log(self, metrics: dict[str, Any], ranks: list[int]) -> None:
        """Records one step; `ranks` are the actor ranks whose timings `metrics["stages"]` holds."""
        self.steps.inc()
        self.step_seconds.observe(metrics["step_time"])
        if "tokens_per_s" in metrics:
            self.tokens.set(metrics["tokens_per_s"])
        self.samples.set(metrics["samples_per_s"])
        self.loss.set(metrics["loss"])
        for s, (stage, rank) in enumerate(zip(metrics.get("stages", []), ranks)):
            self.busy.set(1.0 - stage["bubble"], tags={"run": self.run, "stage": str(s), "rank": str(rank)})
