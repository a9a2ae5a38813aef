"""What runs a step, on the driver and between the actors.

- `connect`: joining Ray (or starting an embedded one) and shipping the user's code.
- `refs`, `p2p`, `compiled`: the three engines on the driver; `results`: waiting for a
  step, timeouts that name what is pending, the root cause of a failed step; `trace`:
  RAYPIPE_TRACE.
- `collective`: the trainer's torch.distributed world, its dp and tp groups, the dp all-reduce.
- `links`: which way each pipeline link goes, from where the actors run (NCCL between GPUs
  of their own, host memory otherwise), and each collective group's backend.
- `transport/`: how boundary tensors cross between neighbouring stages (NCCL streams between
  GPUs, shared memory on one node, gloo across nodes), the step's closing agreement, and the
  wire format.
"""

from raypipe.runtime.connect import connect, ship_user_code

__all__ = ["connect", "ship_user_code"]
