"""Train the reference GPT with raypipe: `python examples/train.py --config examples/configs/gpt_pp2.yaml`.

Runs on an embedded local Ray when RAY_ADDRESS is unset, on that cluster otherwise
(as under `ray job submit`). Override any field with `--set key=value`.
"""

import sys

from raypipe.job import main

if __name__ == "__main__":
    sys.exit(main())
