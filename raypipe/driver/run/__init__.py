"""The run controller: one step's life and the loop of `fit`, each in one place.

- `step`: a step submitted, waited for and booked (`book`), which comes to one typed `Outcome`;
  `train_step` is `Trainer.step`.
- `policy`: what a failure leads to (`RecoveryPolicy` -> `Decision`: raise, restart with new
  actors placed and restored as it says, or write a failed checkpoint again).
- `recovery`: carrying a restart out (new actors, their state from the survivors or a checkpoint).
- `sources`: where the loop's steps come from (the driver sends each, or the actors drive a run
  of them, `actor_runs`).
- `controller`: `fit` as a small state machine over those (`FitLoop`).
- `ending`: what a run leaves when it stops (an interrupt's checkpoint, the last step saved).
- `interrupts`: Ctrl-C and SIGTERM held while a step's calls go out, SIGTERM as an interrupt in `fit`.
"""
