"""Placement by accelerator kind on a fake mixed cluster (its own process and Ray), and configs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raypipe import ConfigError, TrainConfig

HERE = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def hetero(fork_env):
    result = subprocess.run(
        [sys.executable, str(HERE / "hetero_cluster_run.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=HERE.parent,
        env={**os.environ, **fork_env},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_each_stage_lands_on_a_node_of_its_kind_and_trains_with_parity(hetero):
    placed = hetero["placed"]
    assert [(p["name"], p["node_kind"], p["device_kind"]) for p in placed] == [
        ("stage0-dp0-tp0", "cuda", "cuda"),
        ("stage1-dp0-tp0", "rocm", "rocm"),
        ("stage2-dp0-tp0", "mps", "mps"),
    ]
    assert all(p["cpu_fallback"] and p["device"] == "cpu" for p in placed)  # fake nodes: reported, allowed
    assert hetero["losses"] == pytest.approx(hetero["ref_losses"], rel=1e-5, abs=4e-5)
    assert hetero["max_weight_diff"] < 4e-5


def test_a_kind_no_node_has_fails_fast_naming_stage_request_and_offer(hetero):
    message = hetero["placement_error"]
    print(f"\nPlacementError {hetero['placement_seconds']:.1f} s after the trainer began (actor_start_timeout 6)")
    assert "stage2-dp0-tp0 (stage 2) asked for" in message and "'mps': 1.0" in message
    assert "'label_selector': {'raypipe.io/accelerator': 'mps'}" in message
    assert "'cuda': 1.0} {'raypipe.io/accelerator': 'cuda'}" in message  # what the cluster offers
    assert "stage0-dp0-tp0" not in message.split("The cluster offers")[0]  # placed stages are not blamed


def test_an_accelerator_stage_never_silently_runs_on_the_cpu(hetero):
    message = hetero["no_fallback_error"]
    assert "stage0-dp0-tp0" in message and "placed for cuda" in message and "allow_cpu_fallback=True" in message


def test_device_configs_are_checked():
    assert TrainConfig(pp=2, devices="cuda", gpus_per_actor=0.5).devices == "cuda"
    with pytest.raises(ConfigError, match=r"devices=\['cuda'\] is invalid: it names 1 kinds but pp=2"):
        TrainConfig(pp=2, devices=["cuda"])
    with pytest.raises(ConfigError, match="Did you mean 'cpu'"):
        TrainConfig(devices="gpu")
    with pytest.raises(ConfigError, match="gpus_per_actor=0"):
        TrainConfig(gpus_per_actor=0)


def test_profile_partition_sizes_stages_to_their_device_speed(hetero):
    """rocm simulates a 2x slower device: the profiled split gives it a third of the work (4 + 2
    layers of 40 ms), predicted within 20 % of the ideal balanced step (never under it: the profile
    adds each layer's overhead to its sleeps, ~10 % on a loaded 2-core machine), and clearly
    faster than uniform in the same run."""
    balance = hetero["balance"]
    assert balance["uniform"]["plan"] == [[0, 3], [3, 6]]
    assert balance["profile"]["plan"] == [[0, 4], [4, 6]]
    per_microbatch = 6 / (1 / 0.04 + 1 / 0.08)  # all work split so both stages take equally long
    ideal = (8 + 2 - 1) * per_microbatch  # m + p - 1 slots of it
    assert 0.97 * ideal <= balance["profile"]["predicted"] <= 1.2 * ideal, (balance, ideal)
    # measured side by side in one run, so a slower machine slows both; the absolute step time
    # against the ideal is a benchmark's (benchmarks/hetero_balance.py), not a test's
    assert balance["uniform"]["step_time"] >= 1.3 * balance["profile"]["step_time"]


def test_the_lora_sft_job_trains_on_a_cuda_node_in_4_bits_and_an_mps_node(hetero):
    import math

    job = hetero["lora_job"]
    assert len(job["losses"]) == 3 and all(math.isfinite(v) for v in job["losses"])
    assert any("pp=2" in line for line in job["log"])


def test_threads_share_each_node_among_the_actors_placed_on_it():
    """A node's CPUs are divided among the trainer's actors on it, never oversubscribed; the
    config's threads_per_actor overrides; the profiler counts the stages that pack onto a node."""
    from raypipe.planning.threads import fitting_threads, oversubscribed, packed_on_node, threads_by_node

    def nodes():
        return {"vm": 2.0, "box": 8.0, "mac": 10.0}

    assert threads_by_node(["vm"], None, nodes) == [2]  # this VM, pp = 1
    assert threads_by_node(["vm", "vm"], None, nodes) == [1, 1]  # pp = 2
    assert threads_by_node(["box", "box"], None, nodes) == [4, 4]  # an 8-CPU node with 2 stages
    assert threads_by_node(["box", "mac", "box", "box"], None, nodes) == [2, 10, 2, 2]
    assert threads_by_node(["vm"] * 3, None, nodes) == [1, 1, 1]  # at least one each
    assert threads_by_node(["box", "box"], 3, nodes) == [3, 3]
    assert fitting_threads(8, 3) * 3 <= 8
    assert [packed_on_node(2, 1.0, n) for n in (1, 2, 4)] == [1, 2, 2]
    assert packed_on_node(8, 0.5, 2) == 2 and fitting_threads(8, packed_on_node(8, 0.5, 2)) == 4

    # Ray told more CPUs than the machine has cores (`ray.init(num_cpus=4)` on 2 cores): the cores bound
    # the threads, whatever Ray says; an actor whose cores are unknown (0) keeps Ray's count
    def told_four():
        return {"vm": 4.0, "box": 8.0}

    assert threads_by_node(["vm"], None, told_four, cores=[2]) == [2]
    assert threads_by_node(["vm", "vm"], None, told_four, cores=[2, 2]) == [1, 1]
    assert threads_by_node(["vm", "box"], None, told_four, cores=[2, 0]) == [2, 8]
    assert fitting_threads(4, 1, cores=2) == 2 and fitting_threads(16, 4, cores=8) == 2
    # threads_per_actor that oversubscribes a node is named with the node's cores; one thread each is not
    assert oversubscribed(["vm", "vm"], [2, 2], [2, 2]) == [
        "the 2 actor(s) on node vm run 4 torch threads together on its 2 cores"
    ]
    assert oversubscribed(["vm"] * 4, [1] * 4, [2] * 4) == [] and oversubscribed(["vm"], [2], [2]) == []
