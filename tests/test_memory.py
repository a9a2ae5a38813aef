"""Peak resident memory as the stage actors report it, on Linux and on macOS."""

import resource
import sys

import torch

from raypipe.actors.memory import max_rss_bytes


def test_ru_maxrss_is_kib_on_linux_and_bytes_on_macos():
    assert max_rss_bytes(2048, "linux") == 2 * 2**20
    assert max_rss_bytes(2 * 2**20, "darwin") == 2 * 2**20
    assert max_rss_bytes(2048, "freebsd14") == 2 * 2**20


def test_this_process_peak_is_plausible():
    """Allocate and touch 256 MiB: the peak reported must be at least that and under the machine's memory."""
    block = torch.ones(64 * 2**20)  # 256 MiB of fp32, written
    peak = max_rss_bytes(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, sys.platform)
    del block
    assert 256 * 2**20 <= peak < 64 * 2**30
