"""Measuring the link between two stage actors: its latency, and its rate each way, over the
world's gloo, the transport boundary values take between nodes (issue 36).

Both actors run `probe_link` at once, in lockstep. First a few one-byte round trips (latency: half
the median). Then, each direction in turn, the sender sends payloads doubling from
`FIRST_BYTES` until one takes `min_seconds` or reaches `max_bytes`, each announced by its size and
answered by one byte once it has all arrived; the rate is the last payload's bytes over its time
less one round trip. Doubling lets a fast link be timed on a payload large enough to be timed,
and a slow one be timed in a fraction of a second: 1 MiB at 50 Mbit/s, 8 MiB at 1 Gbit/s.
Each direction alone: a home Wi-Fi link is often slower one way than the other.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

PROBE_TAG = 1 << 28  # above every stream's tags (`StepLinks.tag`, gloo's PAYLOAD_TAG)
FIRST_BYTES = 64 * 1024
ROUNDS = 5


def probe_link(peer: int, first: bool, min_seconds: float = 0.1, max_bytes: int = 16 << 20) -> dict[str, object]:
    """The link to world rank `peer`, measured together with it (`first` on exactly one end).

    Returns:
        `latency_s` (one way), `to_peer_bytes_per_s`, `from_peer_bytes_per_s`, and the bytes each
        way the probe sent (`probe_bytes`).
    """
    tiny = torch.zeros(1, dtype=torch.uint8)
    trips = []
    for _ in range(ROUNDS + 1):  # the first round trip also opens the connection: not counted
        started = time.perf_counter()
        if first:
            dist.send(tiny, peer, tag=PROBE_TAG)
            dist.recv(tiny, peer, tag=PROBE_TAG)
        else:
            dist.recv(tiny, peer, tag=PROBE_TAG)
            dist.send(tiny, peer, tag=PROBE_TAG)
        trips.append(time.perf_counter() - started)
    round_trip = statistics.median(trips[1:])
    ahead, sent_ahead = _direction(peer, first, round_trip, min_seconds, max_bytes)  # first -> second
    back, sent_back = _direction(peer, not first, round_trip, min_seconds, max_bytes)  # second -> first
    (to_peer, sent), from_peer = ((ahead, sent_ahead), back) if first else ((back, sent_back), ahead)
    return {
        "latency_s": round_trip / 2,
        "to_peer_bytes_per_s": to_peer,
        "from_peer_bytes_per_s": from_peer,
        "probe_bytes": sent,
    }


def _direction(peer: int, sending: bool, round_trip: float, min_seconds: float, max_bytes: int) -> tuple[float, int]:
    """One direction's rate: on the sender, (bytes per second, bytes sent); the receiver's copy of
    the rate comes from the sender, so both ends return the same figure."""
    size, rate, sent = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.float64), 0
    tiny = torch.zeros(1, dtype=torch.uint8)
    nbytes = FIRST_BYTES
    while True:
        if sending:
            payload = torch.ones(nbytes, dtype=torch.uint8)
            started = time.perf_counter()
            size[0] = nbytes
            dist.send(size, peer, tag=PROBE_TAG)
            dist.send(payload, peer, tag=PROBE_TAG)
            dist.recv(tiny, peer, tag=PROBE_TAG)
            seconds = time.perf_counter() - started
            sent += nbytes
            done = seconds >= min_seconds or 2 * nbytes > max_bytes
            rate[0] = nbytes / max(seconds - round_trip, seconds / 2) if done else 0.0
            dist.send(rate, peer, tag=PROBE_TAG)  # 0: another, larger payload follows
        else:
            dist.recv(size, peer, tag=PROBE_TAG)
            dist.recv(torch.empty(int(size[0]), dtype=torch.uint8), peer, tag=PROBE_TAG)
            dist.send(tiny, peer, tag=PROBE_TAG)
            dist.recv(rate, peer, tag=PROBE_TAG)
        if rate[0] > 0:
            return float(rate[0]), sent
        nbytes *= 2
