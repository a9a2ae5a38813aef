"""What runs on the driver: everything between `Trainer` and the actors.

- `run/`: the run controller: a step submitted, waited for and booked (`step`), the loop behind
  `Trainer.fit` (`controller`), what a failure leads to (`policy`) and a restart (`recovery`,
  from the survivors' memory `replicas`, shrinking and growing back `elastic`), interrupts.
- `engines/`: `p2p`, `compiled` and `refs`, the three ways a step reaches the actors;
  `results`: waiting for a step, timeouts that name what is pending, the root cause of a
  failed step; `trace`: RAYPIPE_TRACE.
- `cluster/`: joining Ray (`connect`), which actor runs where (`placement`, `gang`, `topology`),
  the nodes a lost actor ran on (`nodes`), the trainers of this process (`live_trainers`).
- `links/`: which way each pipeline link goes (`ways`: NCCL between GPUs of their own, host
  memory otherwise), measured (`measure`) and planned for (`replan`).
- `inference/`: forward passes (`forward`) and generation with a KV cache (`generation`).
- `actor_group`: the running actors as one object; `run_state`: what a run knows of itself;
  `feeds`: where each step's batch comes from; `checkpoints`, `whole_weights`, `chunks`:
  saving and loading across the actors, the whole model's weights, model chunks; `planned`:
  the plan a trainer starts with; `outputs`: what a run writes.

Actor-side code (`raypipe.actors`, `raypipe.transport`) never imports this package.
"""

from raypipe.driver.cluster.connect import connect, ship_user_code

__all__ = ["connect", "ship_user_code"]
