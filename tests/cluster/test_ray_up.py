"""`ray up cluster.yaml` end to end (issue 22): the shipped cluster file, run by Ray's own
cluster launcher over SSH against three hosts on this machine.

Each host is an sshd in a network namespace of its own (`netns_cluster.start_ssh_host`), with a
pid namespace (so `ray stop` there stops only its own Ray), its own /dev/shm, and a home and
/tmp whose writes stay on it. The hosts advertise what cluster.yaml's story has: an NVIDIA head,
an AMD worker and a Mac (fake accelerators: RAYPIPE_FAKE_ACCELERATOR in each host's ~/.bashrc).

What the test changes in the file: the addresses, the SSH user and key, and the `pip install`
setup command, replaced by a check that raypipe imports (the hosts
share this machine's venv; installing torch three times would take minutes and gigabytes).
Everything else runs as shipped: the file mounts (the checkout rsynced to each host), the auth
setup command, the head's and the workers' start commands with `$(python3 -m raypipe.cli
node-resources)`, the autoscaler on the head starting the workers over SSH, then
`ray job submit` of the main job across the NVIDIA and AMD hosts, and `ray down`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from netns_cluster import NetnsCluster, available
from ray_head import BIN, RAY, head_env

ROOT = Path(__file__).parents[2]
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def missing() -> str | None:
    reason = available()
    if reason is None and not (os.path.exists(SSHD) and shutil.which("rsync")):
        reason = "sshd or rsync is not installed (apt-get install openssh-server rsync)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI must run the ray up test, not skip it", pytrace=False)
    return reason


pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
HOSTS = {"head": "cuda:1:NVIDIA-H100", "amd": "rocm:1:AMD-Instinct-MI300X", "mac": "mps:1:Apple M3 Max"}
PROBE = (
    "python3 -c \"import json, ray; ray.init(logging_level='ERROR'); print('NODES ' + json.dumps("
    "sorted([n['NodeManagerAddress'], {k: v for k, v in n['Resources'].items() if k in ('cuda', 'rocm', 'mps')}] "
    "for n in ray.nodes() if n['Alive'])))\""
)


def launcher(work: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs `ray <args>` from the checkout, as a user would on the machine they launch from: with
    RAY_AUTH_MODE=token and their token, which `ray get-auth-token --generate` made in ~/.ray
    (here `work`/.ray: this machine's own ~/.ray is left alone)."""
    env = {k: v for k, v in head_env().items() if k != "RAY_AUTH_MODE"}
    env.update(RAY_AUTH_MODE="token", HOME=str(work))
    return subprocess.run([RAY, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def sshd_config(work: Path) -> Path:
    for key in ("client_key", "host_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(work / key)], check=True)
    (work / "authorized_keys").write_text((work / "client_key.pub").read_text())
    path = work / "sshd_config"
    path.write_text(f"""Port 22
HostKey {work}/host_key
AuthorizedKeysFile {work}/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile none
""")
    return path


def cluster_file(work: Path, hosts: NetnsCluster) -> Path:
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    config["cluster_name"] = f"raypipe-test-{hosts.tag}"
    config["provider"]["head_ip"] = hosts.nodes["head"].ip
    config["provider"]["worker_ips"] = [hosts.nodes["amd"].ip, hosts.nodes["mac"].ip]
    config["auth"] = {"ssh_user": "root", "ssh_private_key": str(work / "client_key")}
    setup = config["setup_commands"]
    (install,) = [i for i, c in enumerate(setup) if "pip install" in c]
    setup[install] = "python3 -c 'import raypipe, ray, torch'"
    path = work / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    reason = missing()
    if reason:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("rayup")
    before = set(os.listdir("/tmp"))
    hosts = NetnsCluster(work)
    config = None
    try:
        token = launcher(work, "get-auth-token", "--generate")  # as the README says, before `ray up`
        assert token.returncode == 0 and (work / ".ray" / "auth_token").read_text().strip(), token.stderr[-2000:]
        sshd = sshd_config(work)
        for name, accelerator in HOSTS.items():
            profile = f"export PATH={BIN}:$PATH\nexport RAYPIPE_FAKE_ACCELERATOR='{accelerator}'"
            hosts.start_ssh_host(name, sshd, profile)
        config = cluster_file(work, hosts)
        up = launcher(work, "up", "-y", "--no-config-cache", str(config), timeout=600)
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]
        nodes, deadline = [], time.monotonic() + 360  # the head's autoscaler starts the two workers over SSH
        while time.monotonic() < deadline:
            probe = launcher(work, "exec", str(config), PROBE, timeout=120)
            found = [line for line in probe.stdout.splitlines() if line.startswith("NODES ")]
            nodes = json.loads(found[-1][6:]) if found else []
            if len(nodes) == 3:
                break
            time.sleep(3)  # each probe is a `ray exec` over SSH: seconds of its own
        yield {"work": work, "config": config, "hosts": hosts, "nodes": nodes, "up": up}
    finally:
        down = launcher(work, "down", "-y", str(config), timeout=300) if config is not None else None
        hosts.close()
        for name in set(os.listdir("/tmp")) - before:  # what the launcher left on this machine
            if name.startswith("ray-config-"):  # the launcher's cached copy of the cluster file
                os.remove(f"/tmp/{name}")
            elif name.startswith("ray_ssh_"):  # its SSH control sockets
                shutil.rmtree(f"/tmp/{name}", ignore_errors=True)
        for state in Path("/tmp/ray").glob(f"cluster-raypipe-test-{hosts.tag}*"):
            state.unlink()
        assert down is None or down.returncode == 0, down.stdout[-3000:] + down.stderr[-3000:]


def test_ray_up_starts_every_host_advertising_its_accelerator(launched):
    hosts = launched["hosts"]
    expected = sorted([hosts.nodes[name].ip, {HOSTS[name].split(":")[0]: 1.0}] for name in HOSTS)
    # every worker_ip joined: without the auth setup command the workers could not authenticate to
    # the head, and without RAY_enable_autoscaler_v2=0 the autoscaler started only one of them
    assert launched["nodes"] == expected, launched["nodes"]


def test_the_main_job_submitted_on_the_cluster_trains_across_the_nvidia_and_amd_hosts(launched):
    job = (
        "cd ~/raypipe && ray job submit --address http://127.0.0.1:8265 --working-dir . -- "
        "python3 examples/train.py --config examples/configs/tiny.yaml --set 'devices=[cuda, rocm]' "
        "--set allow_cpu_fallback=true "
        "--set job.steps=12 --set job.sample_tokens=0 --set name=rayup"
    )
    run = launcher(launched["work"], "exec", str(launched["config"]), job, timeout=400)
    out = run.stdout + run.stderr
    assert re.search(r"Job 'raysubmit_\w+' succeeded", out), out[-5000:]
    assert "data: 12 batches through Ray Data" in out  # on a cluster the job reads through Ray Data
    losses = [float(v) for v in re.findall(r"\| loss (\d+\.\d+)", out)]
    assert len(losses) >= 2 and losses[-1] < losses[0], losses


def test_the_head_refuses_a_job_submitted_without_the_token(launched):
    """Token authentication is on at the `ray up` head: the job API answers a request without the
    cluster's token with 401, and runs nothing (the same request with it is what `ray job submit` makes)."""
    probe = (
        'python3 -c "import urllib.request, urllib.error, json; '
        "req = urllib.request.Request('http://127.0.0.1:8265/api/jobs/', method='POST', "
        "data=json.dumps({'entrypoint': 'touch /tmp/unauthenticated-job-ran'}).encode(), "
        "headers={'Content-Type': 'application/json'})\n"
        "try:\n    print('STATUS', urllib.request.urlopen(req, timeout=30).status)\n"
        "except urllib.error.HTTPError as e:\n    print('STATUS', e.code)\""
    )
    run = launcher(launched["work"], "exec", str(launched["config"]), probe, timeout=120)
    statuses = re.findall(r"STATUS (\d+)", run.stdout + run.stderr)
    assert statuses == ["401"], run.stdout[-3000:] + run.stderr[-3000:]
