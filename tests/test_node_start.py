"""`ray start --head $(raypipe node-resources)` through a real shell, on a node that advertises
cuda, rocm or mps (RAYPIPE_FAKE_ACCELERATOR), and what Ray itself then reports for the node:
the argument line that cluster.yaml's start commands run on every GPU host and Mac."""

import json

import pytest

from raypipe.devices import LABEL_KIND, LABEL_MODEL

from ray_head import RayHead, head_env

READ_NODE = """
import json, time, ray
ray.init(address={address!r}, logging_level="ERROR", log_to_driver=False)
deadline = time.monotonic() + 60
while not ray.cluster_resources().get("CPU") and time.monotonic() < deadline:
    time.sleep(0.5)
(node,) = ray.nodes()
print(json.dumps({{"resources": ray.cluster_resources(), "labels": node["Labels"]}}))
"""

CASES = {
    "cuda": ("cuda:2:NVIDIA H100 80GB HBM3", {"cuda": 2.0, "GPU": 2.0}, "NVIDIA-H100-80GB-HBM3"),
    "rocm": ("rocm:1:AMD Instinct MI300X", {"rocm": 1.0, "GPU": 1.0}, "AMD-Instinct-MI300X"),
    "mps": ("mps:1:Apple M2 Max", {"mps": 1.0}, "Apple-M2-Max"),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", CASES)
def test_ray_start_takes_node_resources_output_on_a_gpu_or_mac_host(kind, tmp_path):
    fake, resources, model = CASES[kind]
    node = RayHead(
        "$(raypipe node-resources)", head_env(RAYPIPE_FAKE_ACCELERATOR=fake), tmp_path / "ray.log", num_cpus=1
    )
    try:
        node.wait_gcs(timeout=120)
        result = node.run_python(READ_NODE.format(address=node.address), timeout=120)
        assert result.returncode == 0, result.stderr[-2000:] + node.log_tail()
        seen = json.loads(result.stdout.strip().splitlines()[-1])
    finally:
        node.stop()
    assert {k: v for k, v in seen["resources"].items() if k in ("cuda", "rocm", "mps", "GPU")} == resources
    assert seen["labels"][LABEL_KIND] == kind and seen["labels"][LABEL_MODEL] == model
