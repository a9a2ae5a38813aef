"""A link between two neighbouring stages as the planner sees it: its measured rate and latency
each way (`raypipe.driver.links.measure` measures them), and the time a boundary value takes on it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raypipe.config import TrainConfig


@dataclass(frozen=True)
class Link:
    """One direction of the link between two neighbouring stages.

    Attributes:
        sender, receiver: the stages (actors, by stage number) at its ends.
        transport: how boundary values travel it between nodes ("gloo", "gloo (ordered)", "nccl"),
            "memory" on one node (shared memory, loopback or the device), "ray" through Ray's
            object store (engine="refs").
        bytes_per_s, latency_s: as measured; None where nothing was measured (one node, or no world).
    """

    sender: int
    receiver: int
    transport: str
    bytes_per_s: float | None = None
    latency_s: float | None = None

    @property
    def measured(self) -> bool:
        return self.bytes_per_s is not None

    def seconds(self, nbytes: float) -> float:
        """The time `nbytes` take on this link (no time for a link that was not measured)."""
        if self.bytes_per_s is None:
            return 0.0
        return (self.latency_s or 0.0) + nbytes / self.bytes_per_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mbit_per_s": None if self.bytes_per_s is None else self.bytes_per_s * 8e-6}

    def __str__(self) -> str:
        rate = (
            f"{self.bytes_per_s * 8e-6:,.0f} Mbit/s, latency {1e3 * (self.latency_s or 0):.2f} ms"
            if self.measured
            else "one node, not measured"
            if self.transport == "memory"
            else "not measured"
        )
        return f"stage {self.sender} -> stage {self.receiver} over {self.transport}: {rate}"


def link_map(links: Sequence[Link]) -> dict[tuple[int, int], Link]:
    """The measured links by (sender stage, receiver stage), as the planner takes them."""
    return {(link.sender, link.receiver): link for link in links if link.measured}


def narrow_boundaries(config: TrainConfig) -> bool:
    """Whether `config` sends its floating boundaries in 16 bits (`boundary_dtype` "bf16" or "fp16");
    "auto" sends them as computed until the run chooses bf16 (`driver.links.advice`)."""
    return config.boundary_dtype in ("bf16", "fp16")


def boundary_bytes(profile: dict[str, Any], end: int, config: TrainConfig) -> tuple[float, float]:
    """(activation bytes, gradient bytes) of the value a (virtual) stage ending before layer `end`
    sends on, from a profile's output sizes (`LayerProfiler.profile`) and how `config` (a
    `TrainConfig`) sends boundaries: floating leaves go both ways, in 2 bytes each under a 16-bit
    `boundary_dtype`, 1 under compression (`compress_activations`, `compress_gradients`; their
    scales left out); the others go forward only."""
    i = end - 1
    elements, as_is = profile["output_float_elements"][i], profile["output_float_bytes"][i]
    floats = elements * 2 if narrow_boundaries(config) else as_is
    forward = elements if config.compress_activations != "none" else floats
    backward = elements if config.compress_gradients != "none" else floats
    return forward + profile["output_other_bytes"][i], backward


def message_seconds(
    links: Mapping[tuple[int, int], Link],
    profiles: Sequence[dict[str, Any]],
    plan: Sequence[tuple[int, int]],
    config: TrainConfig,
) -> Callable[[int, int, str, int], float]:
    """`schedules.timed`'s `transfer`: the seconds each boundary message of `plan` (per virtual
    stage, `profiles` likewise) takes on the measured link between its actors; none off them."""

    def seconds(sender: int, receiver: int, what: str, v: int) -> float:
        link = links.get((sender, receiver))
        if link is None:
            return 0.0
        forward, backward = boundary_bytes(profiles[v - (what == "G")], plan[v - (what == "G")][1], config)
        return link.seconds(forward if what == "F" else backward)

    return seconds
