"""What runs on the driver: everything between `Trainer` and the actors.

- `connect`: joining Ray (or starting an embedded one) and shipping the user's code.
- `run/`: the run controller: one step submitted and booked, the loop behind `Trainer.fit`, the
  recovery policy and restarts, interrupts; `feeds`: where each step's batch comes from;
  `replicas`, `elastic`: restoring from the survivors' memory, shrinking and growing back.
- `engines/`: `p2p`, `compiled` and `refs`, the three ways a step reaches the actors;
  `results`: waiting for a step, timeouts that name what is pending, the root cause of a
  failed step; `trace`: RAYPIPE_TRACE.
- `placement`, `gang`, `nodes`, `topology`: which actor runs where; `links`: which way each
  pipeline link goes (NCCL between GPUs of their own, host memory otherwise).
- `checkpoints`, `weights`, `chunks`, `generation`, `registry`: saving and loading across the
  actors, gathering weights, model chunks, generation, the trainers of this process.

Actor-side code (`raypipe.actors`, `raypipe.transport`) never imports this package.
"""

from raypipe.driver.connect import connect, ship_user_code

__all__ = ["connect", "ship_user_code"]
