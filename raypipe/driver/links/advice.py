"""After the first steps of stages across nodes: whether a measured link bounds the step, what
raypipe does about it with `boundary_dtype` left to it, and which settings would shorten it further,
said once in the run's log.

With nothing set, raypipe hides a slow link as far as the order of actions can (`replan.overlap_links`:
one more forward in flight, so activations keep crossing). What is left then is the wire time of the
bytes the split, microbatches and boundary precision make, plus the last microbatch's gradient
crossing back after every activation has crossed (docs/BENCHMARKS.md, "slow link"). Of those, the
precision is the link's to ask (issue 76): with `boundary_dtype="auto"` (the default) a step whose
wire time on one link is `BOUND_SHARE` of it or more, float32 most of what crossed, makes the run
send bf16 boundaries from the next step on, halving the bytes. Boundaries on one node, or on links
that keep up, stay as computed (exact); `boundary_dtype="fp32"` keeps them so on any link. The split
and the microbatches are the user's: the log names them with what they would save.

A warm-up step (the first after the actors start or are reconfigured) takes longer than the steps
after it, so a link that bounds it bounds them too: narrowing is decided there already where it can
be; otherwise the first timed step decides, and the word is said then.

Each direction's bytes come from the stages' `sent_bytes`: a stage sends its activations to the next
stage and its input gradients to the one before, and a gradient is as large as the activation it is
the gradient of, but for the bytes per element each way (`boundary_dtype`, compression); so stage 0's
bytes are its activations, and each later stage's, less the gradient it returned, are its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from raypipe.config import TrainConfig
from raypipe.driver.actor_group import ActorGroup
from raypipe.planning.links import Link, link_map, narrow_boundaries

BOUND_SHARE = 0.5  # a link's wire time over the step from which the link is said to bound the step
NARROW = "bf16"  # what "auto" narrows boundaries to: float32's range (activations and gradients stay in it)


@dataclass(frozen=True)
class Bound:
    """A link whose wire time took `BOUND_SHARE` of a step or more: the step's number and seconds,
    the link's busier direction, its bytes and their wire time."""

    step: int
    step_s: float
    link: Link
    nbytes: float
    wire_s: float


def after_step(group: ActorGroup, metrics: dict[str, Any], queued: int = 0) -> bool:
    """Looks at the booked step of `metrics` for a link of `group` that bounds it: narrows the
    boundaries (`boundary_dtype="auto"`) and says so, or says what would shorten it. True once
    these links are done with (the first timed step; a warm-up step that narrowed). `queued`: the
    steps already sent to the actors behind it (`fit`'s overlap), which run as they were sent."""
    config = group.config
    found = bound(group.links, config, metrics)
    if found is not None and narrows(config, metrics) and group.actor_run is None:
        group.reconfigure(config.replace(boundary_dtype=NARROW))  # each actor takes it after its queued steps
        group.log(_said(found, group.config, narrowed=True, wide=False, first=found.step + 1 + queued))
        return True
    if metrics["warmup"]:
        return False
    if found is not None:
        group.log(_said(found, config, narrowed=False, wide=_mostly_fp32(metrics)))
    return True


def advice(links: Sequence[Link], config: TrainConfig, metrics: dict[str, Any]) -> str | None:
    """The log's word on the step of `metrics` (`Trainer.step`'s) where a measured link bounds it
    (`bound`) and nothing is narrowed, naming the link, its bytes and what would shorten it; else None."""
    found = bound(links, config, metrics)
    return None if found is None else _said(found, config, narrowed=False, wide=_mostly_fp32(metrics))


def bound(links: Sequence[Link], config: TrainConfig, metrics: dict[str, Any]) -> Bound | None:
    """The measured link whose wire time in the step of `metrics` is the longest, where it is at least
    `BOUND_SHARE` of the step; else None (links on one node, or not measured; an interleaved
    schedule, whose stages send both ways on every link)."""
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
    return Bound(int(metrics["step"]), step, link, nbytes, wire) if wire >= BOUND_SHARE * step else None


def narrows(config: TrainConfig, metrics: dict[str, Any]) -> bool:
    """Whether a bound step makes `boundary_dtype="auto"` narrow: left to raypipe, and at least half
    of what the stages sent was float32 (a model computing in 16 bits, or compressed boundaries,
    leaves bf16 little or nothing to halve)."""
    return config.boundary_dtype == "auto" and _mostly_fp32(metrics)


def _mostly_fp32(metrics: dict[str, Any]) -> bool:
    """Whether half or more of the bytes the stages sent in the step of `metrics` were float32."""
    sent = sum(int(s["sent_bytes"]) for s in metrics["stages"])
    wide = sum(int(s.get("fp32_sent_bytes", 0)) for s in metrics["stages"])
    return sent > 0 and wide >= 0.5 * sent


def _said(found: Bound, config: TrainConfig, narrowed: bool, wide: bool, first: int = 0) -> str:
    """The log line: the step, the link, its bytes; what was done and what else would shorten it
    (`wide`: float32 most of what crossed, which a narrower boundary would halve; `first`: the
    first step sent narrowed)."""
    m = config.microbatches
    head = (
        f"raypipe: step {found.step} took {found.step_s:.3f} s, {found.wire_s:.3f} s of it the wire time of "
        f"{found.link} ({found.nbytes / 1e6:.1f} MB): the link bounds the step"
    )
    if narrowed:
        done = (
            f", so from step {first} on the boundaries cross in {NARROW} (boundary_dtype='auto': "
            "activations and their gradients rounded on the way, half the bytes; boundary_dtype='fp32' keeps "
            "them exact on any link). "
        )
    else:
        done = (
            ", and no order of actions takes it below that wire time plus one of its "
            f"{m} microbatch{'es' if m > 1 else ''}' messages (the last gradient crosses back after every "
            "activation has crossed). "
        )
    return head + done + "What shortens it" + (" further: " if narrowed else ": ") + "; ".join(_remedies(config, wide))


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
    return 1.0 if codec != "none" else 2.0 if narrow_boundaries(config) else 4.0


def _remedies(config: TrainConfig, wide: bool) -> list[str]:
    """The settings that move the bound, those not set already (`wide`: as `_said`'s)."""
    out = []
    if wide and not narrow_boundaries(config) and config.compress_activations == "none":
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
