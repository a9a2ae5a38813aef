"""`ray start --head $(raypipe node-resources)` through a real shell, on a node that advertises
cuda, rocm or mps (RAYPIPE_FAKE_ACCELERATOR), and what Ray itself then reports for the node:
the argument line that cluster.yaml's start commands run on every GPU host and Mac."""

import json

import pytest

from raypipe.core.devices import LABEL_KIND, LABEL_MODEL

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
def test_ray_start_takes_node_resources_output_on_a_gpu_or_mac_host(tmp_path):
    """A cuda, a rocm and a Mac host, each a head: each starts once the one before has started,
    and is read while the next starts (three starting at once on two busy cores outran Ray's own
    startup timeout in CI)."""
    from concurrent.futures import ThreadPoolExecutor

    def read(node: RayHead) -> dict:
        result = node.run_python(READ_NODE.format(address=node.address), timeout=120)
        assert result.returncode == 0, result.stderr[-2000:] + node.log_tail()
        return json.loads(result.stdout.strip().splitlines()[-1])

    heads, reads = {}, {}
    try:
        with ThreadPoolExecutor(len(CASES)) as pool:
            for kind, (fake, _, _) in CASES.items():
                env = head_env(RAYPIPE_FAKE_ACCELERATOR=fake)
                heads[kind] = RayHead("$(raypipe node-resources)", env, tmp_path / f"{kind}.log", num_cpus=1)
                heads[kind].wait_started(timeout=120)
                reads[kind] = pool.submit(read, heads[kind])
            seen = {kind: future.result(timeout=240) for kind, future in reads.items()}
    finally:
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(RayHead.stop, heads.values()))
    for kind, (_, resources, model) in CASES.items():
        found = {k: v for k, v in seen[kind]["resources"].items() if k in ("cuda", "rocm", "mps", "GPU")}
        assert found == resources, (kind, seen[kind])
        assert seen[kind]["labels"][LABEL_KIND] == kind and seen[kind]["labels"][LABEL_MODEL] == model


PRELOADED = """
import sys, ray
from raypipe.driver.cluster.connect import connect
connect()  # an embedded local Ray, as a script's Trainer starts one
@ray.remote(num_cpus=0)
def preloaded():  # pickled by value from __main__: the worker imports nothing for it
    return sorted(m for m in ("torch", "raypipe.actors.stage_actor") if m in sys.modules)
print("PRELOADED", ray.get(preloaded.remote(), timeout=120))
"""


def test_raypipe_preload_has_the_local_rays_idle_workers_import_the_stage_code():
    """RAYPIPE_PRELOAD reaches Ray's `preload_python_modules`: a worker that runs a task needing
    nothing has torch and the stage actor's code imported already."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "RAYPIPE_PRELOAD": "torch,raypipe.actors.stage_actor", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-c", PRELOADED], env=env, capture_output=True, text=True, timeout=180)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PRELOADED")]
    assert lines == ["PRELOADED ['raypipe.actors.stage_actor', 'torch']"], done.stdout[-2000:] + done.stderr[-3000:]
