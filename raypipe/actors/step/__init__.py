"""What a stage runs within a step: its action list, the executor of each forward and
backward (split backwards, early hand-ons, compiled layers, the memory they keep), the refs
engine's per-action calls, and the loop and board of actor-driven runs."""
