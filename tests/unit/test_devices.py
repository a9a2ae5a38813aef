"""Accelerator detection and the `ray start` arguments raypipe prints for a machine."""

import json
import os
import subprocess
import sys

import pytest
from ray._private.label_utils import parse_node_labels_string, validate_node_label_syntax

from raypipe import ConfigError
from raypipe.core.devices import LABEL_KIND, LABEL_MODEL, Accelerator, detect, label_value


def test_this_machine_is_a_cpu_node():
    acc = detect()
    assert acc.kind == "cpu" and acc.count == os.cpu_count() and acc.torch_device() == "cpu"
    assert acc.memory_bytes > 2**30 and "fp32" in acc.dtypes
    assert acc.ray_resources() == {}  # Ray counts CPUs itself


def test_gpu_kinds_get_a_resource_num_gpus_and_labels_ray_accepts():
    cases = {
        Accelerator("cuda", 2, "NVIDIA H100 80GB HBM3", 80 * 2**30, ("fp32", "fp16", "bf16")): "NVIDIA-H100-80GB-HBM3",
        Accelerator("rocm", 8, "AMD Instinct MI300X", 192 * 2**30, ("fp32", "fp16", "bf16")): "AMD-Instinct-MI300X",
        Accelerator("mps", 1, "arm", 32 * 2**30, ("fp32", "fp16")): "arm",
    }
    for acc, model in cases.items():
        args = acc.ray_start_args()
        labels = parse_node_labels_string(next(a for a in args if a.startswith("--labels="))[len("--labels=") :])
        validate_node_label_syntax(labels)  # what `ray start --labels` runs
        assert labels == {LABEL_KIND: acc.kind, LABEL_MODEL: model}
        resources = json.loads(next(a for a in args if a.startswith("--resources="))[len("--resources=") :])
        assert resources == {acc.kind: float(acc.count)}
        assert (f"--num-gpus={acc.count}" in args) == (acc.kind in ("cuda", "rocm"))
    assert Accelerator("rocm", 1, "x", 1, ()).torch_device(0) == "cuda:0"  # torch names ROCm devices cuda


def test_label_values_are_cleaned_to_rays_rules():
    assert label_value("Intel(R) Xeon(R) CPU @ 2.20GHz") == "Intel-R-Xeon-R-CPU-2.20GHz"
    assert len(label_value("x" * 100)) == 63
    assert label_value("((()))") == "unknown"


def node_resources(*args, **env):
    return subprocess.run(
        [sys.executable, "-m", "raypipe.cli", "node-resources", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def test_node_resources_command_prints_the_arguments():
    out = node_resources()
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == detect().ray_start_args()
    data = json.loads(node_resources("--json").stdout)
    assert data["kind"] == "cpu" and data["labels"][LABEL_KIND] == "cpu"


def test_printed_arguments_survive_command_substitution_unchanged():
    """`ray start $(raypipe node-resources)`: bash splits the output on white space and globs each word,
    and removes no quotes, so every argument must be one word with no quote or glob character."""
    out = node_resources(RAYPIPE_FAKE_ACCELERATOR="cuda:2:NVIDIA H100 80GB HBM3")
    assert out.returncode == 0, out.stderr
    split = subprocess.run(
        ["bash", "-c", 'printf "%s\\n" $(cat)'], input=out.stdout, capture_output=True, text=True, timeout=30
    ).stdout.splitlines()
    assert split == Accelerator("cuda", 2, "NVIDIA H100 80GB HBM3", 1, ()).ray_start_args()
    assert split[:2] == ["--num-gpus=2", '--resources={"cuda":2.0}'], split
    assert not any(c in out.stdout for c in "'*?["), out.stdout


def test_fake_accelerator_override_is_what_detect_reports(monkeypatch):
    monkeypatch.setenv("RAYPIPE_FAKE_ACCELERATOR", "rocm:8:AMD Instinct MI300X")
    acc = detect()
    assert (acc.kind, acc.count, acc.model) == ("rocm", 8, "AMD Instinct MI300X")
    assert acc.ray_labels()[LABEL_MODEL] == "AMD-Instinct-MI300X" and "bf16" in acc.dtypes
    monkeypatch.setenv("RAYPIPE_FAKE_ACCELERATOR", "mps:1:Apple M3 Max")
    assert detect().ray_resources() == {"mps": 1.0} and "bf16" not in detect().dtypes
    for bad in ("cuda", "cuda:0:x", "tpu:1:x", "cuda:two:x", "cuda:1:"):
        monkeypatch.setenv("RAYPIPE_FAKE_ACCELERATOR", bad)
        with pytest.raises(ConfigError, match="RAYPIPE_FAKE_ACCELERATOR=.*KIND:COUNT:MODEL"):
            detect()
    out = node_resources(RAYPIPE_FAKE_ACCELERATOR="gpu:1:x")
    assert out.returncode == 2 and "KIND:COUNT:MODEL" in out.stderr
