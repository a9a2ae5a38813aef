"""A real Ray head started by `ray start`, used as on a cluster: `ray job submit` runs the
main job, and Ray's state API (through the head's dashboard) lists its stage actors by name."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from raypipe.devices import LABEL_KIND, detect

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")
RUN = "ray-job-test"


def free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """`ray start --head --block` on free ports, auth mode set for server and clients alike;
    stopped by its own process group at the end."""
    gcs, dashboard, client, agent, agent_grpc, env_agent, metrics = free_ports(7)
    temp = tempfile.mkdtemp(prefix="rp-", dir="/tmp")  # short: Ray's socket paths must stay short
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(RAY_AUTH_MODE="disabled", RAYPIPE_CACHE_DIR=str(tmp_path_factory.mktemp("cache")),
               PYTHONUNBUFFERED="1")
    log = open(tmp_path_factory.mktemp("head") / "ray-start.log", "w")
    proc = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--num-cpus=2", "--disable-usage-stats", f"--temp-dir={temp}",
         f"--port={gcs}", "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
         f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
         f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={env_agent}",
         f"--metrics-export-port={metrics}", *detect().ray_start_args()],  # what `raypipe node-resources` prints
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"ray start exited with {proc.returncode}: {Path(log.name).read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"{url}/api/version", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the dashboard at {url} did not answer within 120 s")
                time.sleep(1)
        yield {"url": url, "env": env}
    finally:
        proc.terminate()  # `ray start --block` stops the processes it started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything of that group still running
        except ProcessLookupError:
            pass
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def submitted(head, tmp_path_factory):
    """Runs `ray job submit` (waiting for the end) with a working directory holding the job."""
    work = tmp_path_factory.mktemp("job")
    shutil.copy(ROOT / "examples" / "train.py", work / "train.py")
    shutil.copy(ROOT / "examples" / "configs" / "tiny.yaml", work / "job.yaml")
    result = subprocess.run(
        [RAY, "job", "submit", "--address", head["url"], "--working-dir", str(work), "--",
         sys.executable, "train.py", "--config", "job.yaml", "--set", f"name={RUN}", "--set", "job.steps=20",
         "--set", "job.sample_tokens=0"],
        env=head["env"], capture_output=True, text=True, timeout=300,
    )
    return result


def test_ray_job_submit_trains_and_succeeds(head, submitted):
    assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]
    out = submitted.stdout
    job_id = re.search(r"Job '(raysubmit_\w+)' submitted successfully", out).group(1)
    script = ("from ray.job_submission import JobSubmissionClient; "
              f"print(JobSubmissionClient('{head['url']}').get_job_status('{job_id}'))")
    status = subprocess.run([sys.executable, "-c", script], env=head["env"], capture_output=True, text=True, timeout=60)
    assert status.stdout.strip().endswith("SUCCEEDED"), status.stdout + status.stderr
    losses = [float(v) for v in re.findall(r"\| loss (\d+\.\d+)", out)]
    assert len(losses) >= 4 and losses[-1] < losses[0] - 0.5, losses
    assert "step/s" not in out and "s/step" not in out  # no progress bar in a job's log: plain lines


def test_state_api_lists_every_stage_by_name_and_repr(head, submitted):
    script = (
        "import json; from ray.util.state import list_actors;"
        f"print(json.dumps([a.__dict__ if hasattr(a, '__dict__') else dict(a) for a in "
        f"list_actors(address='{head['url']}', filters=[('ray_namespace', '=', 'raypipe-{RUN}')], detail=True)], default=str))"
    )
    result = subprocess.run([sys.executable, "-c", script], env=head["env"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    actors = {a["name"]: a for a in json.loads(result.stdout.strip().splitlines()[-1])}
    assert {"stage0-dp0-tp0", "stage1-dp0-tp0"} <= set(actors), sorted(actors)
    assert actors["stage1-dp0-tp0"]["class_name"] == "StageActor"
    assert actors["stage1-dp0-tp0"]["repr_name"] == "StageActor(stage1-dp0-tp0, layers [2, 4))"


def test_head_advertises_what_node_resources_printed(head):
    script = ("import json; from ray.util.state import list_nodes;"
              f"print(json.dumps([n.labels for n in list_nodes(address='{head['url']}', detail=True)]))")
    result = subprocess.run([sys.executable, "-c", script], env=head["env"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    (labels,) = json.loads(result.stdout.strip().splitlines()[-1])
    assert {k: v for k, v in labels.items() if k.startswith("raypipe.io/")} == detect().ray_labels()
    assert labels[LABEL_KIND] == "cpu"
