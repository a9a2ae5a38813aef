"""The cluster files pass Ray's own validation, and their nodes advertise what raypipe places on."""

import copy
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from raypipe.core.devices import LABEL_KIND

ROOT = Path(__file__).parents[2]
FILES = [ROOT / "cluster.yaml", *sorted((ROOT / "examples/clusters").glob("*.yaml"))]


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_ray_validates_the_cluster_file(path):
    config = yaml.safe_load(path.read_text())
    validate_config(prepare_config(copy.deepcopy(config)))


def test_on_prem_hosts_advertise_what_node_resources_detects():
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    assert config["provider"]["type"] == "local" and config["provider"]["worker_ips"]
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert "raypipe.cli node-resources)" in config[key][-1], key
    assert "--dashboard-host=127.0.0.1" in config["head_start_ray_commands"][-1]


def test_a_mac_worker_may_join_and_every_host_gets_the_same_ray():
    """`ray start --address` on macOS aborts unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 is set in its
    environment; and Ray refuses nodes whose Ray version differs from the head's."""
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    start = config["worker_start_ray_commands"][-1]
    assert "export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1;" in start and start.index("export") < start.index("ray start")
    assert all("-c ~/raypipe/constraints.txt" in c for c in config["setup_commands"] if "pip install" in c)
    assert any(line.startswith("ray==") for line in (ROOT / "constraints.txt").read_text().splitlines())


def test_cloud_node_types_declare_the_resource_and_label_stages_ask_for():
    from raypipe.core.devices import ray_options

    config = yaml.safe_load((ROOT / "examples/clusters/aws-nvidia-amd.yaml").read_text())
    types = config["available_node_types"]
    kinds = {t["labels"][LABEL_KIND]: t for name, t in types.items() if name != config["head_node_type"]}
    assert set(kinds) == {"cuda", "rocm"}
    for kind, node_type in kinds.items():
        asked = ray_options(kind)
        assert all(node_type["resources"].get(r, 0) >= n for r, n in asked["resources"].items())
        assert node_type["resources"].get("GPU", 0) >= asked["num_gpus"]
        assert all(node_type["labels"].get(k) == v for k, v in asked["label_selector"].items())


def test_every_host_gets_the_token_and_the_head_runs_the_autoscaler_that_starts_every_worker():
    """What `tests/cluster/test_ray_up.py` found against real hosts: workers without the head's token and
    auth mode cannot join, and Ray 2.60's autoscaler v2 counts the head among min_workers."""
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert any("export RAY_AUTH_MODE=token' >> ~/.bashrc" in c for c in config["setup_commands"])
    assert "export RAY_enable_autoscaler_v2=0;" in config["head_start_ray_commands"][-1]
    assert config["min_workers"] == config["max_workers"] == len(config["provider"]["worker_ips"])


@pytest.mark.parametrize("path", ["cluster.yaml", "examples/clusters/aws-nvidia-amd.yaml"])
def test_every_cluster_file_carries_the_token_and_the_pinned_versions(path):
    """Both shipped cluster files: the token on every host, token mode in every shell, and the
    pinned versions (a node of another Ray cannot join; an unpinned torch pulls what it likes)."""
    config = yaml.safe_load((ROOT / path).read_text())
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert any("export RAY_AUTH_MODE=token' >> ~/.bashrc" in c for c in config["setup_commands"])
    installs = [c for c in config["setup_commands"] if "pip install" in c]
    assert installs and all("-c ~/raypipe/constraints.txt" in c for c in installs)
