"""After the first timed step of stages across nodes: whether a measured link bounds the step, and
which settings would shorten it, said once in the run's log.

With nothing set, raypipe hides a slow link as far as the order of actions can (`replan.overlap_links`:
one more forward in flight, so activations keep crossing). What is left then is the wire time of the
bytes the user's split, microbatches and precision make, plus the last microbatch's gradient crossing
back after every activation has crossed (docs/BENCHMARKS.md, "slow link"): only a setting shortens it,
and each such setting changes the split, the microbatches or the numbers, which raypipe does not
change by itself. So the first step that is not a warm-up says which link it waited on, for how
long, and what would move it.

Each direction's bytes come from the stages' `sent_bytes`: a stage sends its activations to the next
stage and its input gradients to the one before, and a gradient is as large as the activation it is
the gradient of, but for the bytes per element each way (`boundary_dtype`, compression); so stage 0's
bytes are its activations, and each later stage's, less the gradient it returned, are its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from raypipe.config import TrainConfig
from raypipe.planning.links import Link, link_map

BOUND_SHARE = 0.5  # a link's wire time over the step from which the link is said to bound the step


def advice(links: Sequence[Link], config: TrainConfig, metrics: dict[str, Any]) -> str | None:
    """The log's word on the step of `metrics` (`Trainer.step`'s) where a measured link's wire time
    is at least `BOUND_SHARE` of it, naming the link, its bytes and what would shorten it; else None
    (links on one node, or not measured; an interleaved schedule, whose stages send both ways on
    every link)."""
    measured = link_map(links)
    if not measured or config.num_chunks() > 1 or not metrics.get("stages") or not metrics.get("step_time"):
        return None
    step = float(metrics["step_time"])
    carried = direction_bytes([int(s["sent_bytes"]) for s in metrics["stages"]], config)
    waits = [
        (measured[pair].seconds(nbytes), nbytes, measured[pair]) for pair, nbytes in carried.items() if pair in measured
    ]
    if not waits:
        return None
    wire, nbytes, link = max(waits, key=lambda w: w[0])
    if wire < BOUND_SHARE * step:
        return None
    return (
        f"raypipe: step {metrics['step']} took {step:.3f} s, {wire:.3f} s of it the wire time of {link} "
        f"({nbytes / 1e6:.1f} MB): the link bounds the step, and no order of actions takes it below that "
        f"wire time plus one of its {config.microbatches} microbatch"
        f"{'es' if config.microbatches > 1 else ''}' messages (the last gradient crosses back after every "
        "activation has crossed). " + "What shortens it: " + "; ".join(_remedies(config))
    )


def direction_bytes(sent: Sequence[int], config: TrainConfig) -> dict[tuple[int, int], float]:
    """Bytes each direction between neighbouring stages carried in a step, from each stage's
    `sent_bytes` (activations on, input gradients back): (s, s + 1) the activations, (s + 1, s) the
    gradients, a gradient sized as its activation by the bytes per element each way takes."""
    ratio = _element_bytes(config.compress_gradients, config) / _element_bytes(config.compress_activations, config)
    carried: dict[tuple[int, int], float] = {}
    returned = 0.0  # the gradients the stage sends back (none from stage 0)
    for s, total in enumerate(sent[:-1]):
        forward = max(0.0, total - returned)
        carried[(s, s + 1)] = forward
        returned = forward * ratio
        carried[(s + 1, s)] = returned
    return carried


def _element_bytes(codec: str, config: TrainConfig) -> float:
    """Bytes per floating element one way, as the planner counts them (`links.boundary_bytes`)."""
    return 1.0 if codec != "none" else 4.0 if config.boundary_dtype == "fp32" else 2.0


def _remedies(config: TrainConfig) -> list[str]:
    """The settings that move the bound, those not set already."""
    out = []
    if config.boundary_dtype == "fp32" and config.compress_activations == "none":
        out.append(
            "boundary_dtype='bf16' halves those bytes (activations and their gradients rounded to bf16 on the way)"
        )
    if config.compress_activations == "none" or config.compress_gradients == "none":
        out.append(
            "compress_activations='fp8-row' and compress_gradients='fp8-row' quarter them (8 bits and a scale per row)"
        )
    out.append(f"more microbatches (now {config.microbatches}) make the last one's crossing shorter")
    if config.schedule != "auto":
        out.append(
            "schedule='auto' and partition='profile' with a sample plan the split, microbatches and warm-up for "
            "the measured link (a split at a narrower boundary sends fewer bytes)"
        )
    return out
