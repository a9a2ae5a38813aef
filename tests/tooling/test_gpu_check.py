"""`make gpu-check`'s script cannot rot before a GPU is lent: on the CPU with tiny sizes every part
runs for real (pytest -m gpu, the GPT against plain PyTorch, a Llama with LoRA against peft at
pp 1 and 2, compiled against eager stages, the boundary hop, QLoRA, DPO and GRPO) and writes the same JSON keys
and table the GPU run writes."""

import json
import subprocess
import sys
from pathlib import Path

from gpu_report import EXPECTED, PARTS, last_json, pytest_counts

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_every_part_tiny_on_the_cpu_and_writes_its_report(tmp_path, clean_env):
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--tiny", "--out", str(tmp_path)],
        cwd=ROOT,
        env=clean_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["device"] == "cpu" and report["tiny"] and report["failed"] == []
    for part in PARTS:
        assert set(report[part]) == {"result", "skipped", "error", "seconds", "sanity"}, part
        assert report[part]["error"] is None, (part, report[part]["error"])
    # every expected ratio was measured and set beside its band (whether it sits inside is a
    # timing figure: the dry run prints it, docs/BENCHMARKS.md records it, no test asserts it)
    for part, expected in EXPECTED["cpu"].items():
        assert set(report[part]["sanity"]) == set(expected), part
        for name, ratio in report[part]["sanity"].items():
            assert ratio["spread"][0] <= ratio["median"] <= ratio["spread"][1] and ratio["pairs"] >= 2, (part, name)
    assert isinstance(report["out_of_band"], list)
    assert report["pytest_gpu"]["result"] is None and "CUDA" in report["pytest_gpu"]["skipped"]
    for part in PARTS[1:]:  # everything else ran
        assert report[part]["skipped"] is None and report[part]["result"] is not None, part
    gpt = report["gpt"]["result"]
    assert set(gpt["tokens_per_s_best"]) == {
        "plain_torch_m1",
        "plain_torch_m4",
        "raypipe_pp1_m1",
        "raypipe_pp1_m4",
        "raypipe_pp2_m4",
    }
    llm = report["llm_lora"]["result"]
    assert set(llm["tokens_per_s"]) == {"peft", "raypipe_pp1", "raypipe_pp2"} and min(llm["tokens_per_s"].values()) > 0
    assert [len(llm["peak_gib"][k]) for k in ("peft", "raypipe_pp1", "raypipe_pp2")] == [1, 1, 2]
    assert llm["runs"]["raypipe_pp2"]["devices"] == ["cpu", "cpu"]
    assert report["compile"]["result"]["rows"][0]["compiled_over_eager_tokens_per_s"] > 0
    assert "shm" in report["hop"]["result"]["hop_ms_median"]
    assert report["qlora"]["result"]["tokens_per_s"] > 0
    preference = report["preference"]["result"]
    assert preference["dpo"]["tokens_per_s"] > 0 and preference["grpo_step"]["generation_s"] > 0
    assert set(preference["generation"]["tokens_per_s"]) == {"transformers", "raypipe_pp1"}
    table = (tmp_path / "gpu_check.md").read_text()
    assert all(f"| {part} |" in table for part in PARTS) and "FAILED" not in table


def test_the_check_reads_what_its_parts_print():
    printed = 'warming up\n{"a": 1}\nnoise {"b": 2}\n{\n "c": [1,\n  2]\n}\ntrailing words\n'
    assert last_json(printed) == {"c": [1, 2]}
    assert last_json("no json here") is None
    summary = "SKIPPED [1] tests/parity/test_gpu.py:19: needs a CUDA or ROCm GPU\n1 passed, 2 skipped, 1 error in 3.1s"
    counts = pytest_counts(summary, 1)
    assert (counts["passed"], counts["skipped"], counts["error"], counts["failed"]) == (1, 2, 1, 0)
    assert counts["skip_reasons"] == ["tests/parity/test_gpu.py:19: needs a CUDA or ROCm GPU"]


def test_make_gpu_check_unpacks_the_ray_bundle_where_ray_is_missing_then_runs_the_check():
    dry = subprocess.run(["make", "-n", "gpu-check", "OUT=/out"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert dry.returncode == 0, dry.stderr
    assert "tar xJf .devbundle/site.tar.xz" in dry.stdout and "benchmarks/gpu_check.py --out /out" in dry.stdout
