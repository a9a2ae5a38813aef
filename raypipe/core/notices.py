"""Third-party notices that ask nothing of a raypipe user, kept out of every run's output.

A first run should print raypipe's own lines and the warnings that ask the user to act. Three
notices did neither, on every run, in the driver and again in each actor:

- bitsandbytes (imported by peft whenever it is installed) logs that it could not load an
  optional CPU kernel from the `kernels` package, a download from a model hub, on runs that
  quantize nothing; its own kernels serve a run that does.
- peft asks transformers' `is_gradient_checkpointing`, which transformers 5 warns is renamed.
- Ray logs that the local cluster it starts for `ray.init()` turned token authentication on: the
  safe default raypipe wants (`raypipe.driver.cluster.connect` hides it for the Ray it starts;
  the warning that authentication is *off* is left alone).

Each is matched by its own words, so a notice's other messages still show. Importing `raypipe`
hides the first two (`quiet_third_party`), in the driver and in every actor, before either
library is imported.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

_BITSANDBYTES_CPU = "bitsandbytes.backends.cpu.ops"
_RAY_TOKEN_SETUP = "ray._private.authentication.authentication_token_setup"


class _Without(logging.Filter):
    """Drops a logger's records whose message starts with `words`."""

    def __init__(self, words: str) -> None:
        super().__init__()
        self.words = words

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.words)


def quiet_third_party() -> None:
    """Hides the bitsandbytes and peft notices in this process (the driver's and every actor's:
    `raypipe` imports this before either library is imported)."""
    logger = logging.getLogger(_BITSANDBYTES_CPU)
    if not any(isinstance(f, _Without) for f in logger.filters):
        logger.addFilter(_Without("Failed to load CPU gemm_4bit_forward from kernels-community"))
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


@contextlib.contextmanager
def token_auth_notice_hidden() -> Iterator[None]:
    """Within: Ray's notice that a new local cluster turned token authentication on is not logged."""
    logger = logging.getLogger(_RAY_TOKEN_SETUP)
    hidden = _Without("Token authentication is enabled for this Ray cluster")
    logger.addFilter(hidden)
    try:
        yield
    finally:
        logger.removeFilter(hidden)


quiet_third_party()
