"""A progress bar over training steps that fits where the code runs.

On a terminal or in a notebook, a `tqdm.auto` bar (an HTML widget in Jupyter) shows
the step, loss and tokens/s. Anywhere else, as under `ray job submit` where the
output is a log file, there is no bar and the job's plain log lines tell the story.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


def interactive() -> bool:
    """True on a terminal or in a Jupyter kernel, where a live bar renders."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if getattr(shell, "kernel", None) is not None:  # running inside a notebook's kernel
        return True
    return bool(getattr(sys.stdout, "isatty", lambda: False)())


class Progress:
    """A bar over `total` steps starting at `initial`, or nothing when disabled or not interactive."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True) -> None:
        self.bar = None
        if enabled and interactive():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, desc="raypipe")

    def update(self, metrics: dict[str, object]) -> None:
        if self.bar is None:
            return
        postfix = {"loss": f"{metrics['loss']:.4f}"}
        if "tokens_per_s" in metrics:
            postfix["tok/s"] = f"{metrics['tokens_per_s']:,.0f}"
        else:
            postfix["samples/s"] = f"{metrics['samples_per_s']:,.0f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(metrics["step"] - self.bar.n)

    def moved_to(self, step: int) -> None:
        """After a recovery the count goes back to the restored step."""
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def writer(self, log: Callable[[str], None]) -> Callable[[str], None]:
        """`log`, or a writer that prints above the bar while one is shown."""
        if self.bar is None:
            return log
        from tqdm.auto import tqdm

        return lambda line: tqdm.write(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
