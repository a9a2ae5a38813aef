"""Where the actors run: joining Ray (`connect`), the placement group and its bundles
(`placement`), starting every actor together (`gang`), which actor is which rank (`topology`),
the nodes a lost actor ran on (`nodes`) and the trainers of this process (`live_trainers`)."""
