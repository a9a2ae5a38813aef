"""A real Ray head started by `ray start`, used as on a cluster and set up as docs/clusters.md
says (token authentication included): its `ray job submit` block runs as written, then jobs
with more settings; Ray's state API (through the head's dashboard) lists the stage actors by name.
A relative checkpoint_dir lands outside Ray's copy of the working directory, under the runs
root, so a second submission after a file of the directory changed resumes it; `ray job stop`
ends that one with a line naming its checkpoint and no traceback (issue 60)."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from raypipe.core.devices import LABEL_KIND, detect

from ray_head import RAY, RayHead, head_env

ROOT = Path(__file__).resolve().parents[2]
RUN = "ray-job-test"


def docs_job_block() -> list[str]:
    """The commands of docs/clusters.md's `ray job submit` block, continuation lines joined,
    comments dropped."""
    text = (ROOT / "docs" / "clusters.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "ray start --head --dash" in b)
    return [re.sub(r"\s+#.*", "", line).strip() for line in re.sub(r"\\\n\s*", "", block).splitlines()]


DOCS_HEAD = "ray start --head --dashboard-host=127.0.0.1"


@pytest.fixture(scope="module")
def head(tmp_path_factory, fork_env):
    """Set up as docs/clusters.md's block says: its token made by its own command, its
    `export`s in the environment, then `ray start --head --block $(raypipe node-resources)` through
    bash, as cluster.yaml starts a host, with the block's flags (and free ports); stopped by
    its own process group at the end."""
    # a home of its own: the token and the job's relative outputs (~/raypipe-runs); `ray job stop` leaves a save 30 s
    home = tmp_path_factory.mktemp("home")
    env = head_env(
        RAYPIPE_CACHE_DIR=str(tmp_path_factory.mktemp("cache")),
        HOME=str(home),
        RAY_JOB_STOP_WAIT_TIME_S="30",
        **fork_env,
    )
    block = docs_job_block()
    assert block[0] == "ray get-auth-token --generate" and DOCS_HEAD in block, block
    made = subprocess.run(["bash", "-c", block[0]], env=env, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0 and (home / ".ray" / "auth_token").is_file(), made.stderr[-2000:]
    for line in block:
        if line.startswith("export "):
            name, value = line.removeprefix("export ").split("=", 1)
            env[name] = value
    assert env["RAY_AUTH_MODE"] == "token"
    args = "$(raypipe node-resources)"
    node = RayHead(args, env, tmp_path_factory.mktemp("head") / "ray-start.log", dashboard=True)
    assert all(flag in node.command for flag in DOCS_HEAD.removeprefix("ray start ").split())
    try:
        try:
            node.wait_dashboard(timeout=120)
        except (RuntimeError, TimeoutError) as error:
            pytest.fail(str(error))
        token = (home / ".ray" / "auth_token").read_text().strip()
        yield {
            "url": node.url,
            "env": env,
            "home": home,
            "temp": node.temp,
            "block": block,
            "headers": {"Authorization": f"Bearer {token}"},
        }
    finally:
        node.stop()


def test_the_job_block_of_docs_clusters_md_runs_as_written(head):
    """Issue 60: the block's `ray job submit` line, run by bash in the clone's root with only the
    dashboard's port changed, trains and succeeds; without the token the same head refuses."""
    (submit,) = [line for line in head["block"] if line.startswith("ray job submit")]
    assert "--address http://127.0.0.1:8265 " in submit and submit.endswith("--config examples/configs/tiny.yaml")
    command = submit.replace("http://127.0.0.1:8265", head["url"])
    done = subprocess.run(
        ["bash", "-c", command], cwd=ROOT, env=head["env"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "succeeded" in done.stdout and "step   30 | loss" in done.stdout, done.stdout[-3000:]
    assert "Traceback" not in done.stdout, done.stdout[-3000:]
    refused = subprocess.run(
        [RAY, "job", "list", "--address", head["url"]],
        env={**head["env"], "HOME": str(head["home"] / "elsewhere"), "RAY_AUTH_MODE": "token"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0 and "token" in (refused.stdout + refused.stderr).lower()


@pytest.fixture(scope="module")
def submitted(head, tmp_path_factory):
    """Runs `ray job submit` (waiting for the end) with a working directory holding the job, logging
    to MLflow (a sqlite store outside the working directory, which Ray copies) besides TensorBoard."""
    work = tmp_path_factory.mktemp("job")
    tracking = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'runs.db'}"
    shutil.copy(ROOT / "examples" / "train.py", work / "train.py")
    shutil.copy(ROOT / "examples" / "configs" / "tiny.yaml", work / "job.yaml")
    result = subprocess.run(
        [
            RAY,
            "job",
            "submit",
            "--address",
            head["url"],
            "--working-dir",
            str(work),
            "--",
            sys.executable,
            "train.py",
            "--config",
            "job.yaml",
            "--set",
            f"name={RUN}",
            "--set",
            "job.steps=20",
            "--set",
            "job.sample_tokens=0",
            "--set",
            f"loggers=[tensorboard, {{mlflow: {{tracking_uri: '{tracking}'}}}}]",
            "--set",
            "checkpoint_dir=runs/ck",
            "--set",
            "checkpoint_every=15",
        ],
        env=head["env"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    result.tracking, result.work = tracking, work
    return result


def test_ray_job_submit_trains_and_succeeds(head, submitted):
    assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]
    out = submitted.stdout
    job_id = re.search(r"Job '(raysubmit_\w+)' submitted successfully", out).group(1)
    script = (
        "from ray.job_submission import JobSubmissionClient; "
        f"print(JobSubmissionClient('{head['url']}').get_job_status('{job_id}'))"
    )
    status = subprocess.run([sys.executable, "-c", script], env=head["env"], capture_output=True, text=True, timeout=60)
    assert status.stdout.strip().endswith("SUCCEEDED"), status.stdout + status.stderr
    losses = [float(v) for v in re.findall(r"\| loss (\d+\.\d+)", out)]
    assert len(losses) >= 4 and losses[-1] < losses[0] - 0.5, losses
    assert "step/s" not in out and "s/step" not in out  # no progress bar in a job's log: plain lines
    assert "data: 20 batches through Ray Data" in out  # on a cluster the job reads its data through Ray Data
    # nothing in the log reads as a crash (the reader of Ray Data's batches ends before the driver)
    assert "Traceback" not in out and "Ray is not initialized" not in out, out[out.find("Traceback") - 2000 :][:5000]
    assert "the last step: " in out and " + -" not in out  # a breakdown, and never a negative part
    runs = head["home"] / "raypipe-runs"
    assert f"outputs under {runs} (a ray job's working-dir copy" in out and f"run {RUN} " in out
    assert (runs / "runs" / "ck" / "step-00000020" / "MANIFEST.json").is_file()  # the normal end's last step
    placed = re.search(r"Grafana dashboard 'raypipe' in (\S+) ", out).group(1)  # beside Ray's own, for its Grafana
    assert {"raypipe_grafana_dashboard.json", "train_grafana_dashboard.json"} <= {
        p.name for p in Path(placed).iterdir()
    }


def test_the_jobs_losses_and_validation_reach_mlflow(submitted):
    """The run the job logged to MLflow holds the losses it printed and its validation losses."""
    from mlflow.tracking import MlflowClient

    assert submitted.returncode == 0, submitted.stderr[-3000:]
    client = MlflowClient(submitted.tracking)
    (run,) = client.search_runs([client.get_experiment_by_name("raypipe").experiment_id])
    assert run.info.run_name == RUN and run.info.status == "FINISHED" and run.data.params["job.steps"] == "20"
    logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert sorted(logged) == list(range(1, 21))
    printed = {int(s): float(v) for s, v in re.findall(r"step +(\d+) \| loss (\d+\.\d+)", submitted.stdout)}
    assert len(printed) >= 4 and all(abs(logged[s] - v) < 6e-5 for s, v in printed.items()), (printed, logged)
    validation = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "val/loss")}
    val_printed = {int(s): float(v) for s, v in re.findall(r"step +(\d+) \| val loss (\d+\.\d+)", submitted.stdout)}
    assert set(validation) == set(val_printed) == {0, 20}
    assert all(abs(validation[s] - v) < 6e-5 for s, v in val_printed.items())


def test_state_api_lists_every_stage_by_name_and_repr(head, submitted):
    script = (
        "import json; from ray.util.state import list_actors;"
        f"print(json.dumps([a.__dict__ if hasattr(a, '__dict__') else dict(a) for a in "
        f"list_actors(address='{head['url']}', filters=[('ray_namespace', '=', 'raypipe-{RUN}')], detail=True)], default=str))"  # noqa: E501
    )
    result = subprocess.run(
        [sys.executable, "-c", script], env=head["env"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    actors = {a["name"]: a for a in json.loads(result.stdout.strip().splitlines()[-1])}
    assert {"stage0-dp0-tp0", "stage1-dp0-tp0"} <= set(actors), sorted(actors)
    assert actors["stage1-dp0-tp0"]["class_name"] == "StageActor"
    assert actors["stage1-dp0-tp0"]["repr_name"] == "StageActor(stage1-dp0-tp0, layers [2, 4))"
    helpers = {name.rsplit("-", 1)[0]: a["repr_name"] for name, a in actors.items() if not name.startswith("stage")}
    # the run's helpers: its dataset's reader and its world's rendezvous (an actor-driven run has a
    # `step-board-…` too); their reprs as Ray read them at the start
    assert helpers == {
        "dataset-reader": "DatasetReader(a Dataset, 8 rows a step)",
        "rendezvous": "StoreKeeper(the world's rendezvous keys)",
    }, helpers


def test_head_advertises_what_node_resources_printed(head):
    script = (
        "import json; from ray.util.state import list_nodes;"
        f"print(json.dumps([n.labels for n in list_nodes(address='{head['url']}', detail=True)]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], env=head["env"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (labels,) = json.loads(result.stdout.strip().splitlines()[-1])
    assert {k: v for k, v in labels.items() if k.startswith("raypipe.io/")} == detect().ray_labels()
    assert labels[LABEL_KIND] == "cpu"


def test_a_resubmission_after_the_clone_changed_resumes_and_ray_job_stop_ends_it_cleanly(head, submitted):
    """The working directory changes (Ray unpacks it anew); the job resumes from the first one's
    last checkpoint all the same. `ray job stop` then ends it: a checkpoint and one line, no traceback."""
    import time

    from ray.job_submission import JobStatus, JobSubmissionClient

    assert submitted.returncode == 0, submitted.stderr[-3000:]
    (submitted.work / "notes.txt").write_text("a changed clone\n")
    command = [
        RAY, "job", "submit", "--no-wait", "--address", head["url"], "--working-dir", str(submitted.work), "--",
        sys.executable, "train.py", "--config", "job.yaml", "--resume", "--set", f"name={RUN}",
        "--set", "job.steps=400", "--set", "job.sample_tokens=0", "--set", "checkpoint_dir=runs/ck",
        "--set", "checkpoint_every=1000",
    ]  # fmt: skip
    prometheus = start_prometheus(head, submitted.work.parent)  # scraping the head as Ray's prometheus.yml says
    out = subprocess.run(command, env=head["env"], capture_output=True, text=True, timeout=120).stdout
    job_id = re.search(r"Job '(raysubmit_\w+)' submitted successfully", out).group(1)
    client = JobSubmissionClient(head["url"], headers=head["headers"])
    deadline = time.monotonic() + 180
    while "step   25 |" not in client.get_job_logs(job_id) and time.monotonic() < deadline:
        time.sleep(1)
    assert "resumed from" in client.get_job_logs(job_id) and "step-00000020 at step 20" in client.get_job_logs(job_id)
    if prometheus is not None:  # while the job trains: raypipe's series over Prometheus' HTTP API
        SCRAPED["steps"] = query_prometheus(prometheus, f'ray_raypipe_steps_total{{run="{RUN}"}}', deadline)
        prometheus[0].terminate()
        prometheus[0].wait(timeout=30)
    subprocess.run([RAY, "job", "stop", "--address", head["url"], job_id], env=head["env"], timeout=120)
    while client.get_job_status(job_id) not in (JobStatus.STOPPED, JobStatus.FAILED, JobStatus.SUCCEEDED):
        assert time.monotonic() < deadline + 60
        time.sleep(1)
    logs = client.get_job_logs(job_id)
    assert client.get_job_status(job_id) == JobStatus.STOPPED
    stopped = re.search(r"raypipe: stopped by SIGTERM after step (\d+); saved (\S+)", logs)
    assert stopped and Path(stopped.group(2), "MANIFEST.json").is_file(), logs[-3000:]
    assert "Traceback" not in logs, logs[-3000:]


SCRAPED: dict = {}  # what the resubmitted job's Prometheus returned (`start_prometheus`)


def start_prometheus(head, folder):
    """Debian's prometheus, scraping every 1 s the targets of Ray's own service-discovery file (as
    the prometheus.yml Ray writes for the head says); None where prometheus is not installed."""
    import socket

    binary = shutil.which("prometheus")
    if binary is None:
        return None
    ray_config = next(Path(head["temp"]).glob("session_*/metrics/prometheus/prometheus.yml")).read_text()
    discovery = re.search(r"- '([^']+prom_metrics_service_discovery.json)'", ray_config).group(1)
    config = folder / "prometheus.yml"
    scrape = f"scrape_configs:\n- job_name: ray\n  file_sd_configs:\n  - files: ['{discovery}']\n"
    config.write_text("global: {scrape_interval: 1s}\n" + scrape)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = [
        f"--config.file={config}",
        f"--web.listen-address=127.0.0.1:{port}",
        f"--storage.tsdb.path={folder / 'tsdb'}",
    ]
    return subprocess.Popen([binary, *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), port


def query_prometheus(prometheus, query, deadline):
    """The value of `query` once Prometheus has it (its HTTP API), or None by `deadline`."""
    import json
    import time
    import urllib.parse
    import urllib.request

    url = f"http://127.0.0.1:{prometheus[1]}/api/v1/query?{urllib.parse.urlencode({'query': query})}"
    while time.monotonic() < deadline:
        try:
            result = json.loads(urllib.request.urlopen(url, timeout=5).read())["data"]["result"]
            if result:
                return float(result[0]["value"][1])
        except OSError:
            pass
        time.sleep(1)
    return None


def test_a_real_prometheus_scraping_the_head_reads_raypipes_series():
    """Issue 60: a Prometheus set up from Ray's own files reads the run's step counter."""
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not installed (apt-get install prometheus; `make install` does it as root)")
    assert SCRAPED.get("steps") is not None and SCRAPED["steps"] >= 20, SCRAPED  # resumed at 20, then trained on
