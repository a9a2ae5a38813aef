"""What the GPU check (`benchmarks/gpu_check.py`) reads and judges, apart from running its parts:
its part names, each ratio's expected band per device, pytest's summary and a part's JSON as
they print, and each ratio set beside its band. The tooling tests check these without running a
benchmark."""

from __future__ import annotations

import json

PARTS = ("pytest_gpu", "gpt", "llm_lora", "compile", "hop", "qlora", "preference")


# The band each ratio is expected in (raypipe over its baseline, on that device). At pp = 1 both
# sides do the same work on the same threads (CPU) or device (GPU): near 1, raypipe paying its
# calls and hops. At pp = 2 on a CPU the two stages compute on two cores against the baseline's
# one, but the tiny dry run's LLM steps four one-row microbatches, so its calls dominate (0.58
# on a quiet machine, 0.32 beside a test run); on a GPU they share the device. A figure outside
# its band is a measurement to distrust (the old baselines read 0.18x to 22.7x).
EXPECTED = {
    "cpu": {
        "gpt": {"raypipe_pp1_m1_over_plain": (0.5, 1.5), "raypipe_pp1_m4_over_plain": (0.5, 1.5),
                "raypipe_pp2_m4_over_plain": (0.4, 2.2)},
        "llm_lora": {"raypipe_pp1_over_peft": (0.5, 2.0), "raypipe_pp2_over_peft": (0.25, 2.2)},
        "preference": {"generation_raypipe_pp1_over_transformers": (0.3, 2.0)},
    },
    "cuda": {
        "gpt": {"raypipe_pp1_m1_over_plain": (0.6, 1.15), "raypipe_pp1_m4_over_plain": (0.6, 1.15),
                "raypipe_pp2_m4_over_plain": (0.3, 1.15)},
        "llm_lora": {"raypipe_pp1_over_peft": (0.6, 1.25), "raypipe_pp2_over_peft": (0.3, 1.25)},
        "preference": {"generation_raypipe_pp1_over_transformers": (0.3, 2.0)},
    },
}  # fmt: skip


def sanity(part: str, device: str, result: dict | None) -> dict:
    """Each ratio the part reported beside the band it is expected in on `device`."""
    expected = EXPECTED.get(device, {}).get(part, {})
    checked = {}
    for name, band in expected.items():
        ratio = (result or {}).get("ratios", {}).get(name)
        if ratio is not None:
            checked[name] = {**ratio, "band": list(band), "within": band[0] <= ratio["median"] <= band[1]}
    return checked


def pytest_counts(output: str, code: int | None) -> dict:
    """passed / failed / skipped from pytest's summary line, and the skip reasons."""
    import re

    counts = {k: 0 for k in ("passed", "failed", "skipped", "error")}
    for number, what in re.findall(r"(\d+) (passed|failed|skipped|errors?)", output.splitlines()[-1] if output else ""):
        counts["error" if what.startswith("error") else what] += int(number)
    reasons = [line.split("] ", 1)[-1] for line in output.splitlines() if line.startswith("SKIPPED")]
    return {**counts, "exit_code": code, "skip_reasons": sorted(set(reasons))}


def last_json(text: str) -> dict | None:
    """The last JSON object a part printed (a line starting with "{" where one begins)."""
    decoder, found = json.JSONDecoder(), None
    at = 0
    for line in text.splitlines(keepends=True):
        if line.startswith("{"):
            try:
                found = decoder.raw_decode(text[at:])[0]
            except ValueError:
                pass
        at += len(line)
    return found


def bands(checked: dict) -> str:
    """Each ratio as median [lowest-highest pair] and whether it sits in its expected band."""
    cells = []
    for name, r in checked.items():
        lo, hi = r["band"]
        verdict = "ok" if r["within"] else f"OUT OF BAND {lo:g}-{hi:g}"
        cells.append(f"{name} {r['median']:.2f} [{r['spread'][0]:.2f}-{r['spread'][1]:.2f}] {verdict}")
    return "; ".join(cells)
