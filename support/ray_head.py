"""A real Ray head started the way a cluster host starts one: `ray start --head --block ...`
through a real shell, so `$(raypipe node-resources)` in its arguments is expanded by bash
exactly as in cluster.yaml's start commands. The head runs in its own process group and
is stopped by it: nothing else on the machine (the suite's shared local Ray) is touched."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

BIN = Path(sys.executable).parent  # ray and raypipe as installed beside this python
RAY = str(BIN / "ray")


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def head_env(**extra: str) -> dict[str, str]:
    """This process's environment without an earlier test's Ray address or auth mode, auth off
    for the head and its clients alike, and the venv's commands first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS") and k != "RAY_AUTH_MODE"}
    env.update(RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    env.update(extra)
    return env


STOP_GRACE_S = 8.0  # how long a stopped head may take to stop its processes before they are killed


class RayHead:
    """`ray start --head --block <shell_args>` on free ports; `stop()` ends its process group."""

    def __init__(
        self, shell_args: str, env: dict[str, str], log: Path, dashboard: bool = False, num_cpus: int = 2
    ) -> None:
        gcs, dashboard_port, client, agent, agent_grpc, env_agent, metrics = free_ports(7)
        self.temp = tempfile.mkdtemp(prefix="rp-", dir="/tmp")  # short: Ray's socket paths must stay short
        self.env, self.address = env, f"127.0.0.1:{gcs}"
        self.url = f"http://127.0.0.1:{dashboard_port}" if dashboard else None
        ports = (
            f"--port={gcs} --ray-client-server-port={client} --dashboard-agent-listen-port={agent} "
            f"--dashboard-agent-grpc-port={agent_grpc} --runtime-env-agent-port={env_agent} "
            f"--metrics-export-port={metrics}"
        )
        ui = (
            f"--include-dashboard=true --dashboard-host=127.0.0.1 --dashboard-port={dashboard_port}"
            if dashboard
            else "--include-dashboard=false"
        )
        self.command = (
            f"exec {shlex.quote(RAY)} start --head --block --num-cpus={num_cpus} --disable-usage-stats "
            f"--temp-dir={self.temp} {ports} {ui} {shell_args}"
        )
        self.log_path = log
        self._log = open(log, "w")
        self.proc = subprocess.Popen(
            ["bash", "-c", self.command], env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text()[-chars:]

    def run_python(self, code: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """Runs `code` in a new Python process with this head's environment."""
        return subprocess.run(
            [sys.executable, "-c", code], env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def wait_gcs(self, timeout: float = 120) -> None:
        """Waits until the head's GCS port accepts connections."""
        host, port = self.address.split(":")

        def answers() -> bool:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                return True
            except OSError:
                return False

        self._wait(answers, f"the head's GCS at {self.address} did not answer", timeout, pause=0.5)

    def wait_started(self, timeout: float = 120) -> None:
        """Waits until `ray start` says the node is up (its GCS, raylet and agents registered):
        heads started one after another this way never compete in Ray's own startup timeout."""
        started = lambda: "Ray runtime started." in self.log_path.read_text()  # noqa: E731
        self._wait(started, f"the head at {self.address} did not start", timeout, pause=0.5)

    def wait_dashboard(self, timeout: float = 120) -> None:
        def answers() -> bool:
            try:
                urllib.request.urlopen(f"{self.url}/api/version", timeout=2).read()
                return True
            except urllib.error.HTTPError as error:
                return error.code in (401, 403)  # it answers, with token authentication only to the token
            except OSError:
                return False

        self._wait(answers, f"the dashboard at {self.url} did not answer", timeout, pause=1)

    def _wait(self, ready: Callable[[], bool], failed: str, timeout: float, pause: float) -> None:
        """Polls `ready` every `pause` s; fails at once, with `ray start`'s own output, when the
        command exited instead (a bad argument, say), and with `failed` and that output after `timeout` s."""
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {self.proc.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{failed} within {timeout} s: {self.log_tail()}")
            time.sleep(pause)

    def stop(self) -> None:
        self.proc.terminate()  # bash exec'd `ray start --block`, which stops the processes it started
        try:  # idle it takes ~3 s; after a job, it waited ~30 s on processes a SIGKILL ends as well
            self.proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything of that group still running
        except ProcessLookupError:
            pass
        self._log.close()
        shutil.rmtree(self.temp, ignore_errors=True)
