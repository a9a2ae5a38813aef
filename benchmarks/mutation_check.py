"""Does the suite catch real bugs? Injects one known bug at a time into a scratch copy of the
repository and runs the tests that should catch it; a mutation the tests pass is a hole.

    .venv/bin/python benchmarks/mutation_check.py                 # every mutation, ~6 min on 2 cores
    .venv/bin/python benchmarks/mutation_check.py --only fp16-unscale bf16-autocast --out m.json

Each run extracts a commit (HEAD unless --rev) to a temporary directory, replaces one exact piece of
source (it must occur exactly once, so a refactor that moves it fails loudly here rather
than silently testing nothing), and runs pytest there with that copy first on the path,
for the driver and for the Ray workers it starts. `--baseline` first runs each selected
test set unmutated, which must pass. JSON out: per mutation, whether the tests failed and
which test failed first.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "support"))  # the planted bugs, which the tooling tests check too

from mutations import MUTATIONS, Mutation  # noqa: E402


def copy_tree(dest: Path, rev: str) -> None:
    """The files of commit `rev`, as git archive gives them (the working tree may change meanwhile)."""
    archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def apply(mutation: Mutation, tree: Path) -> None:
    path = tree / mutation.path
    text = path.read_text()
    if text.count(mutation.old) != 1:
        raise SystemExit(
            f"{mutation.name}: the text to mutate occurs {text.count(mutation.old)} times in "
            f"{mutation.path}, not once; update this script"
        )
    path.write_text(text.replace(mutation.old, mutation.new))


def run_tests(tree: Path, tests: tuple[str, ...], timeout: float) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    where = subprocess.run(
        [sys.executable, "-c", "import raypipe; print(raypipe.__file__)"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout.strip()
    if not where.startswith(str(tree)):
        raise SystemExit(f"the scratch copy is not what Python imports ({where}); nothing would be tested")
    started = time.monotonic()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        out, code = result.stdout + result.stderr, result.returncode
    except subprocess.TimeoutExpired as expired:
        out, code = str(expired.stdout or ""), -1
    failed = re.findall(r"^FAILED (\S+)", out, re.MULTILINE)
    return {
        "tests_failed": code not in (0, 5),
        "returncode": code,
        "first_failure": failed[0] if failed else None,
        "seconds": round(time.monotonic() - started, 1),
        "tail": out.strip().splitlines()[-3:],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=[m.name for m in MUTATIONS], help="these mutations only")
    parser.add_argument("--baseline", action="store_true", help="first check each test set passes unmutated")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per pytest run")
    parser.add_argument("--rev", default="HEAD", help="the commit to mutate (default HEAD: commit first)")
    parser.add_argument("--out", help="write the JSON here too")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    results = []
    for mutation in chosen:
        row = {"mutation": mutation.name, "bug": mutation.what, "tests": list(mutation.tests)}
        with tempfile.TemporaryDirectory(prefix="rp-mut-") as tmp:
            tree = Path(tmp)
            copy_tree(tree, args.rev)
            if args.baseline:
                row["baseline"] = run_tests(tree, mutation.tests, args.timeout)
            apply(mutation, tree)
            row.update(run_tests(tree, mutation.tests, args.timeout))
        broken = args.baseline and row["baseline"]["tests_failed"]
        row["caught"] = caught = row["tests_failed"] and not broken
        verdict = "BASELINE FAILS" if broken else "caught" if caught else "MISSED"
        detail = (
            row["baseline"]["first_failure"] or row["baseline"]["tail"]
            if broken
            else row["first_failure"] or row["tail"]
        )
        print(f"{mutation.name:22s} {verdict:7s} {row['seconds']:6.1f} s  {detail}", flush=True)
        results.append(row)
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if all(r["caught"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
