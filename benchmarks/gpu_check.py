"""The first run on a lent GPU machine, as one command (`make gpu-check`): every GPU path of
raypipe once, with figures, in at most 8 minutes, written to `--out` as `gpu_check.json` and a
short table `gpu_check.md`.

Parts, each in a process of its own (a crash or a CUDA error in one leaves the others their
turn), each given what is left of `--budget-s`, the JSON rewritten after each so a run cut
short still says what it found:
- `pytest_gpu`: `pytest -m gpu` (stages sharing the GPU under both engines, parity with one
  CPU process);
- `gpt`: the main job's GPT (GPT-2 small's shape on a GPU) against plain PyTorch on the same
  device, pp = 1 and pp = 2 sharing it: tokens/s and MFU (`gpt_gpu.py`);
- `llm_lora`: Qwen3-8B's shape with random bf16 weights made here (no download), LoRA r = 16
  on the attention projections, peft in one process against raypipe at pp = 1 and pp = 2 (both
  stages on the GPU): tokens/s, each stage's peak device memory, the load times (`gpu_parts.py`);
- `compile`: torch.compile'd stages against eager on the GPT, pp = 1 and 2 (`gpu_parts.py`);
- `hop`: one boundary hop device -> host -> device between two actors for the boundary sizes
  of the runs above (`device_hop.py`);
- `qlora`: the LLM at pp = 1 over an nf4 base, when bitsandbytes is importable;
- `preference`: DPO and GRPO with LoRA on the LLM at pp = 1: a DPO step and its reference pass,
  GRPO's generation against transformers' `generate`, a GRPO step's parts (`gpu_preference.py`).

A part that cannot run here records `skipped` with the reason; one that failed, `error` with
the end of its output. Every ratio against a baseline (`ratios` in a part's result: raypipe's
tokens/s over the baseline's, pair by pair, the baseline computing with the threads one actor
gets) is set beside the band it is expected in on that device (`EXPECTED`), and the table marks
one outside it: a broken baseline shows before anyone reads the figure as a result.
`--device cpu --tiny` runs every part small on the CPU (the suite does:
tests/tooling/test_gpu_check.py), so the script cannot rot before a GPU is lent.

    make gpu-check                                         # on the GPU machine (docs/testing.md)
    python benchmarks/gpu_check.py --device cpu --tiny --out /tmp/gc
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SUPPORT = ROOT / "support"  # modules shared with the tests: what this check reads and judges
sys.path.insert(0, str(SUPPORT))

from gpu_report import PARTS, bands, last_json, pytest_counts, sanity  # noqa: E402

# the least time worth starting a part with (s): less than this left and it is skipped, said so
LEAST = {"pytest_gpu": 30, "gpt": 30, "llm_lora": 60, "compile": 30, "hop": 15, "qlora": 30, "preference": 60}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, choices=["cuda", "cpu"], help="cuda where there is one")
    parser.add_argument("--tiny", action="store_true", help="every part small: checks the script itself")
    parser.add_argument("--out", required=True, help="the folder gpu_check.json and gpu_check.md go to")
    parser.add_argument("--budget-s", type=float, default=480.0, help="for all parts together")
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS))
    args = parser.parse_args()
    device = args.device or ("cuda" if _cuda() else "cpu")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    work = Path(tempfile.mkdtemp(prefix="gpu_check-"))  # the LLM's files, shared by llm_lora and qlora
    ray_address = start_ray()
    report = {
        "check": "gpu_check",
        "device": device,
        "tiny": args.tiny,
        "machine": machine(device),
        **{part: skipped("not asked for (--only)") for part in PARTS},
    }
    try:
        for part in args.only:
            left = deadline - time.monotonic()
            if left < LEAST[part]:
                report[part] = skipped(f"out of time: {left:.0f} s of --budget-s {args.budget_s:.0f} left")
            else:
                report[part] = run_part(part, device, args.tiny, work, left, ray_address)
            write(out_dir, report)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        import ray

        ray.shutdown()
    report["seconds"] = round(args.budget_s - (deadline - time.monotonic()), 1)
    report["failed"] = [p for p in PARTS if report[p]["error"] is not None]
    report["out_of_band"] = [
        f"{p}: {name}" for p in PARTS for name, r in (report[p].get("sanity") or {}).items() if not r["within"]
    ]
    write(out_dir, report)
    print((out_dir / "gpu_check.md").read_text())


def start_ray() -> str:
    """A local Ray for every part, advertising this machine's accelerators as `raypipe
    node-resources` would; each part joins it (starting one per part cost ~5 s each)."""
    import ray

    from raypipe import driver

    driver.connect()
    return ray.get_runtime_context().gcs_address


def run_part(part: str, device: str, tiny: bool, work: Path, left: float, ray_address: str) -> dict:
    """One part in a process of its own, in the check's Ray, given at most `left` seconds."""
    command = part_command(part, device, tiny, work)
    if isinstance(command, str):
        return skipped(command)
    started = time.monotonic()
    paths = os.pathsep.join([str(HERE), str(SUPPORT), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "RAY_ADDRESS": ray_address, "PYTHONPATH": paths}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=left, cwd=ROOT, env=env)
        output, code = done.stdout, done.returncode
        stderr = done.stderr
    except subprocess.TimeoutExpired as timeout:
        output = _text(timeout.stdout)
        stderr, code = _text(timeout.stderr) + f"\n[gpu_check: stopped after {left:.0f} s]", None
    seconds = round(time.monotonic() - started, 1)
    result = last_json(output)
    if part == "pytest_gpu":
        result = pytest_counts(output, code)
        if result["passed"] + result["failed"] == 0 and code in (0, 5):
            return {**skipped(f"no test ran: {result['skip_reasons'] or 'none collected'}"), "seconds": seconds}
    error = None if code == 0 and result is not None else f"exit code {code}: ...{(output + stderr)[-3000:]}"
    return {
        "result": result,
        "skipped": None,
        "error": error,
        "seconds": seconds,
        "sanity": sanity(part, device, result),
    }


def part_command(part: str, device: str, tiny: bool, work: Path) -> list[str] | str:
    """The command running `part`, or why it cannot run here."""
    py = sys.executable
    if part == "pytest_gpu":
        return [py, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", "tests/parity/test_gpu.py"]
    if part == "gpt":
        small = ["--size", "tiny", "--rounds", "2", "--steps", "3"] if tiny else ["--rounds", "2", "--steps", "5"]
        return [py, str(HERE / "gpt_gpu.py"), "--device", device, *small]
    if part == "hop":
        sizes = ["0.25"] if tiny else [f"{mb:g}" for mb in boundary_mb(device)]
        counts = ["--rounds", "1", "--messages", "3"] if tiny else ["--rounds", "3", "--messages", "10"]
        return [py, str(HERE / "device_hop.py"), "--sizes-mb", *sizes, *counts]
    if part == "qlora":
        try:
            import bitsandbytes  # noqa: F401
        except Exception as error:  # noqa: BLE001 - any import failure is a reason to skip
            return (
                f"bitsandbytes cannot be imported here ({type(error).__name__}: {error}); it is ~70 MB: "
                f"carry its wheel in a call of its own (docs/testing.md)"
            )
    small = ["--tiny"] if tiny else []
    if part == "preference":
        return [py, str(HERE / "gpu_preference.py"), "--device", device, "--work", str(work), *small]
    return [py, str(HERE / "gpu_parts.py"), part, "--device", device, "--work", str(work), *small]


def boundary_mb(device: str) -> list[float]:
    """The boundary values of the runs here (MB): the GPT's microbatch of hidden states (2 x 1024
    x 768, fp32) and the LLM's (1 x 1024 x 4096, bf16)."""
    return [2 * 1024 * 768 * 4 / 2**20, 1024 * 4096 * 2 / 2**20]


def skipped(reason: str) -> dict:
    return {"result": None, "skipped": reason, "error": None, "seconds": 0.0, "sanity": {}}


def machine(device: str) -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()}
    for name in ("ray", "transformers", "peft", "bitsandbytes"):
        try:
            info[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001
            info[name] = None
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1), "cuda": torch.version.cuda}
    return info


def write(out_dir: Path, report: dict) -> None:
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1))
    (out_dir / "gpu_check.md").write_text(table(report))


def table(report: dict) -> str:
    """The report as a short Markdown table: one row a part, what it found or why not."""
    m = report["machine"]
    rows = [
        f"gpu_check on {m.get('gpu', report['device'])} (torch {m['torch']}, Python {m['python']}, "
        f"ray {m['ray']}){' --tiny' if report['tiny'] else ''}",
        "",
        "| part | s | outcome | ratios against the baseline (expected band) |",
        "|---|---|---|---|",
    ]
    for part in PARTS:
        p = report[part]
        if p["skipped"] is not None:
            outcome = f"skipped: {p['skipped']}"
        elif p["error"] is not None:
            outcome = "FAILED: " + p["error"].strip().splitlines()[-1][:200]
        else:
            outcome = summary(part, p["result"])
        rows.append(f"| {part} | {p['seconds']} | {outcome} | {bands(p.get('sanity') or {})} |")
    return "\n".join(rows) + "\n"


def summary(part: str, r: dict) -> str:
    """A part's headline figures, in one cell."""

    def fmt(values: dict, digits: int = 0) -> str:
        return ", ".join(f"{k} {v:.{digits}f}" for k, v in values.items() if v is not None)

    if part == "pytest_gpu":
        return f"{r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped"
    if part == "gpt":
        mfu = f"; MFU {fmt(r['mfu'], 3)}" if r.get("mfu") else ""
        return f"tokens/s {fmt(r['tokens_per_s_best'])}{mfu}"
    if part == "llm_lora":
        return f"tokens/s {fmt(r['tokens_per_s'])}; peak GiB {r['peak_gib']}; load s {fmt(r['load_s'], 1)}"
    if part == "compile":
        ratios = [(row["pp"], row["compiled_over_eager_tokens_per_s"]) for row in r["rows"]]
        return "; ".join(f"pp {pp}: compiled/eager {ratio:.2f}" for pp, ratio in ratios)
    if part == "hop":
        return "; ".join(f"{link}: {fmt(sizes, 3)} ms" for link, sizes in r["hop_ms_median"].items())
    if part == "qlora":
        return f"tokens/s {r['tokens_per_s']:.0f}; peak GiB {r['peak_gib']}"
    if part == "preference":
        g, s = r["generation"], r["grpo_step"]
        return (
            f"DPO tokens/s {r['dpo']['tokens_per_s']:.0f} (reference pass {r['dpo']['reference_pass_s']:.2f} s); "
            f"generation tokens/s {fmt(g['tokens_per_s'])}; GRPO step {s['whole_step_s']:.2f} s "
            f"(generation {s['generation_s']:.2f}, training {s['step_time']:.2f})"
        )
    return json.dumps(r)[:200]


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


if __name__ == "__main__":
    main()
