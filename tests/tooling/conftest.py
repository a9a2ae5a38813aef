"""The tooling tests check the benchmarks' own machinery (the GPU check's parser, the paired
rounds, the mutation check's anchors), so they alone import from benchmarks/: no other test
depends on benchmark code."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
