"""Checkpoint saves that break, for the recovery tests and `benchmarks/faults.py`: layers whose
actor dies or whose write fails as its weights are saved, and a local S3 server (moto) to save to.
Not installed: a trainer ships these layers to its actors by value."""

from __future__ import annotations

import contextlib
import subprocess
import time

import torch
from torch import nn


class KillOnSave(nn.Module):
    """Identity whose process SIGKILLs itself when its weights are saved while `flag` exists
    (removing it first): an actor that dies in the middle of writing a checkpoint."""

    def __init__(self, flag: str) -> None:
        super().__init__()
        self.flag = flag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def state_dict(self, *args, **kwargs):
        import os

        if os.path.exists(self.flag):
            os.remove(self.flag)
            self.break_save()
        return super().state_dict(*args, **kwargs)

    def break_save(self) -> None:
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


class FailOnSave(KillOnSave):
    """As KillOnSave, but the write fails (an OSError, as a full disk or an object store's 503
    would raise) and the actor lives: one actor's save breaks after the others may have written."""

    def break_save(self) -> None:
        raise OSError(f"simulated storage error writing {self.flag}")


@contextlib.contextmanager
def moto_s3(bucket: str, log=subprocess.DEVNULL):
    """moto's S3 server on a free port of 127.0.0.1 with `bucket` made, stopped by its pid on
    leaving; yields the URI query that reaches it (`s3://KEY:SECRET@bucket/prefix?<query>`: moto
    takes any credentials).

    Raises:
        RuntimeError: the server did not start within 60 s.
    """
    import socket
    import sys

    from raypipe.checkpoint.storage import StoragePath

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"moto's server did not start on port {port}") from None
                time.sleep(0.2)
        query = f"endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1&allow_bucket_creation=true"
        StoragePath(f"s3://key:secret@{bucket}?{query}").mkdir()
        yield query
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=20)
