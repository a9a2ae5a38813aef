"""Training metrics: per-stage timing from the actors' own timestamps, and TensorBoard."""

from __future__ import annotations

from typing import Any, Sequence


def stage_metrics(reports: Sequence[dict[str, Any]]) -> list[dict[str, float]]:
    """Per stage: forward and backward seconds, idle (bubble) fraction and peak memory.

    The bubble of a stage is the share of the pipeline's compute window (first action
    start to last action end, over all stages) in which that stage ran nothing. The
    timestamps are each actor's wall clock, so across machines clock skew blurs it.
    """
    timings = [r["timing"] for r in reports]
    starts = [t["first_start"] for t in timings if t.get("forward_s", 0) > 0]
    ends = [t["last_end"] for t in timings if t.get("forward_s", 0) > 0]
    window = (max(ends) - min(starts)) if starts else 0.0
    result = []
    for report, t in zip(reports, timings):
        busy = t.get("forward_s", 0.0) + t.get("backward_s", 0.0)
        result.append({
            "forward_s": t.get("forward_s", 0.0),
            "backward_s": t.get("backward_s", 0.0),
            "bubble": max(0.0, 1.0 - busy / window) if window > 0 else 0.0,
            "peak_memory_bytes": float(report["peak_memory_bytes"]),
        })
    return result


class TensorBoardLogger:
    """Writes each step's metrics as TensorBoard scalars under `log_dir`.

    Tags: train/loss, train/lr, train/grad_norm, train/tokens_per_s (or
    train/samples_per_s), train/step_time, and per stage stage{s}/forward_s,
    stage{s}/backward_s, stage{s}/bubble_fraction, stage{s}/peak_memory_bytes.
    """

    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir)

    def log(self, metrics: dict[str, Any]) -> None:
        step = metrics["step"]
        rate = "tokens_per_s" if "tokens_per_s" in metrics else "samples_per_s"
        for key in ("loss", "lr", "grad_norm", rate, "step_time"):
            self.writer.add_scalar(f"train/{key}", metrics[key], step)
        for s, stage in enumerate(metrics.get("stages", [])):
            self.writer.add_scalar(f"stage{s}/forward_s", stage["forward_s"], step)
            self.writer.add_scalar(f"stage{s}/backward_s", stage["backward_s"], step)
            self.writer.add_scalar(f"stage{s}/bubble_fraction", stage["bubble"], step)
            self.writer.add_scalar(f"stage{s}/peak_memory_bytes", stage["peak_memory_bytes"], step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
