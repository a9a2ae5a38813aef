"""A real Ray cluster on this machine: each node a `ray start` in a network namespace of its own,
joined to the others by a veth pair on a bridge the cluster makes, with a /dev/shm of its own
(so no two nodes share an object store or a shared-memory link), started exactly as
cluster.yaml's start commands start a host (`$(raypipe node-resources)` included).

Traffic goes only between the namespaces' addresses and the bridge's (.254, which the host uses
to reach them, e.g. for `ray up` over ssh); nothing is forwarded beyond it. `close()` kills every
process in each namespace it made, then deletes the namespaces (which removes their veth ends)
and the bridge, by name, even after a failure. Needs root and `ip netns`; `available()` says why
not otherwise.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from raypipe.driver.cluster.connect import system_config

from ray_head import RAY, head_env

MPS = "mps:1:Apple M3 Max"  # a node advertising one Apple GPU (the fake-accelerator override)
PORT = 6379  # each namespace has its own ports: the head takes Ray's default, as on a real host


def available() -> str | None:
    """None when namespaces can be made here; otherwise why not (the tests' skip reason)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"rpprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass
class Node:
    name: str  # also its namespace's name
    ip: str
    proc: subprocess.Popen
    log: Path
    command: list[str]  # what started it: `restart_node` runs it again
    env: dict[str, str]


class NetnsCluster:
    """Ray nodes in namespaces `rp<tag>n<i>` on bridge `rp<tag>b`, addresses 10.<x>.<y>.<i>/24."""

    def __init__(self, workdir: Path, env: dict[str, str] | None = None) -> None:
        self.tag = uuid.uuid4().hex[:5]  # interface names must stay within 15 characters
        self.bridge = f"rp{self.tag}b"
        x, y = (int(self.tag[:2], 16) % 50) + 200, int(self.tag[2:4], 16)
        self.subnet = f"10.{x}.{y}"
        self.workdir = Path(workdir)
        self.env = env or head_env()
        self.temp = tempfile.mkdtemp(prefix="rpn-", dir="/tmp")  # short: Ray's socket paths must stay short
        self.nodes: dict[str, Node] = {}
        self.namespaces: list[str] = []
        self.veths: dict[str, tuple[str, str]] = {}  # namespace -> (its veth's bridge end, its own end)
        # a resolver that answers at once, and nothing: the hosts have no DNS (their default route
        # leads nowhere, so the machine's nameserver would make every reverse lookup wait ~10 s)
        self.resolv = Path(self.temp) / "resolv.conf"
        self.resolv.write_text("nameserver 127.0.0.1\n")
        self._sh(
            f"ip link add {self.bridge} type bridge && ip addr add {self.subnet}.254/24 dev {self.bridge} && "
            f"ip link set {self.bridge} up"
        )

    @property
    def address(self) -> str:
        return f"{self.subnet}.1:{PORT}"

    def add_host(self, name: str) -> tuple[str, str]:
        """Makes host `name`'s network namespace, linked to the bridge; returns (namespace, address).
        Its default route is the bridge's address, as a host's is its gateway (Ray finds a node's
        own address by routing towards the internet; nothing is forwarded beyond the bridge)."""
        index = len(self.namespaces) + 1
        ns, ip = f"rp{self.tag}n{index}", f"{self.subnet}.{index}"
        self.namespaces.append(ns)
        outer, inner = f"rp{self.tag}v{index}", f"rp{self.tag}w{index}"
        self.veths[ns] = outer, inner
        self._sh(
            f"ip netns add {ns} && ip link add {outer} type veth peer name {inner} && "
            f"ip link set {inner} netns {ns} && ip link set {outer} master {self.bridge} up && "
            f"ip -n {ns} addr add {ip}/24 dev {inner} && ip -n {ns} link set {inner} up && "
            f"ip -n {ns} link set lo up && ip -n {ns} route add default via {self.subnet}.254"
        )
        return ns, ip

    def limit_link(self, ns: str, mbit: float | None) -> None:
        """Limits the link of host namespace `ns` to `mbit` megabits per second in each direction, as
        a home Ethernet or Wi-Fi link: a `tc tbf` qdisc on both ends of its veth (what the bridge
        sends it, what it sends). None lifts the limit. Called from the machine's own namespace, where
        the bridge's end lives; the qdiscs go with the veth at `close()`."""
        outer, inner = self.veths[ns]
        ends = [["tc"], ["ip", "netns", "exec", ns, "tc"]]
        if mbit is None:
            for tc, dev in zip(ends, (outer, inner)):  # absent when never limited: errors ignored
                subprocess.run([*tc, "qdisc", "del", "dev", dev, "root"], capture_output=True)
            return
        burst = max(32_000, int(mbit * 1e6 / 8 / 100))  # 10 ms at the rate, and at least a few packets
        tbf = ["tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "100ms"]
        for tc, dev in zip(ends, (outer, inner)):
            done = subprocess.run([*tc, "qdisc", "replace", "dev", dev, "root", *tbf], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"limiting {ns}'s link failed: {done.stderr.strip()}")

    def start_node(
        self, name: str, num_cpus: int, fake_accelerator: str | None = None, env: dict[str, str] | None = None
    ) -> Node:
        """Makes host `name` (the first one made is the head) and starts Ray on it; returns at once."""
        head = not self.namespaces
        ns, ip = self.add_host(name)
        # the head's settings reach every node (RAYPIPE_PRELOAD: idle workers import torch ahead)
        settings = f" --system-config='{json.dumps(system_config())}'" if system_config() else ""
        role = (
            f"--head --port={PORT} --include-dashboard=false --temp-dir={self.temp}{settings}"
            if head
            else f"--address={self.address}"
        )
        # `ip netns exec` gives the command a mount namespace of its own: the tmpfs stays this node's
        command = (
            f"mount --bind {self.resolv} /etc/resolv.conf && "
            f"mount -t tmpfs -o size=1g tmpfs /dev/shm && exec {RAY} start {role} --block "
            f"--node-ip-address={ip} --num-cpus={num_cpus} --object-store-memory=200000000 "
            f"--disable-usage-stats $(raypipe node-resources)"
        )
        node_env = {**self.env, **(env or {})}
        if fake_accelerator:
            node_env["RAYPIPE_FAKE_ACCELERATOR"] = fake_accelerator
        return self._launch(name, ns, ip, ["ip", "netns", "exec", ns, "bash", "-c", command], node_env)

    def start_ssh_host(self, name: str, sshd_config: Path, profile: str = "") -> Node:
        """Makes host `name` and runs sshd on it (`sshd_config`: the test's, with its host key and
        authorized key), in a pid namespace of its own (so `ray stop` there stops only this host's
        Ray) with its own /dev/shm, /run, and a /root and /tmp whose writes stay on this host
        (overlays on the machine's: the same Python and venv, a home of its own). `profile`:
        lines appended to this host's ~/.bashrc, which Ray's ssh commands source."""
        ns, ip = self.add_host(name)
        setup = " && ".join(
            [
                f"mount --bind {self.resolv} /etc/resolv.conf",
                "mount -t tmpfs tmpfs /dev/shm",
                "mount -t tmpfs tmpfs /run",
                "mkdir -p /run/sshd",
                "mount -t tmpfs tmpfs /mnt",
                "mkdir -p /mnt/hu /mnt/hw /mnt/tu /mnt/tw",
                "mount -t overlay overlay -o lowerdir=/root,upperdir=/mnt/hu,workdir=/mnt/hw /root",
                "mount -t overlay overlay -o lowerdir=/tmp,upperdir=/mnt/tu,workdir=/mnt/tw /tmp",
                f"printf '%s\\n' {shlex.quote(profile)} >> /root/.bashrc",
                f"exec /usr/sbin/sshd -D -e -f {sshd_config} -o ListenAddress={ip}",
            ]
        )
        command = [
            "ip",
            "netns",
            "exec",
            ns,
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            "--propagation",
            "private",
            "bash",
            "-c",
            setup,
        ]
        return self._launch(name, ns, ip, command, self.env)

    def _launch(self, name: str, ns: str, ip: str, command: list[str], env: dict[str, str]) -> Node:
        log = self.workdir / f"{name}.log"
        with open(log, "a") as out:
            proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.nodes[name] = Node(ns, ip, proc, log, command, env)
        return self.nodes[name]

    def restart_node(self, name: str) -> Node:
        """Starts node `name`'s Ray again on its host (after a driver killed every process of its namespace):
        the machine coming back; it joins as a new Ray node. Returns at once."""
        node = self.nodes[name]
        self._kill_namespace(node.name)  # what is left of the old one
        return self._launch(name, node.name, node.ip, node.command, node.env)

    def wait_nodes(self, timeout: float = 180) -> None:
        """Waits until every node started (and not dropped from `nodes`) is alive in the cluster;
        fails at once when a node's Ray exited."""
        probe = (
            f"import ray; ray.init(address='{self.address}', logging_level='ERROR'); "
            f"print(' '.join(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']))"
        )
        deadline = time.monotonic() + timeout
        while True:
            for name, node in self.nodes.items():
                if node.proc.poll() is not None:
                    raise RuntimeError(f"node {name}'s ray start exited: {node.log.read_text()[-3000:]}")
            run = self.run_python(probe, timeout=max(5.0, deadline - time.monotonic()))
            lines = run.stdout.strip().splitlines()
            if lines and {n.ip for n in self.nodes.values()} <= set(lines[-1].split()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"nodes {sorted(self.nodes)} did not all join within {timeout} s: {run.stderr[-2000:]}"
                )
            time.sleep(1)

    def run_python(
        self, code: str, timeout: float = 300, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        """Runs `code` as a Ray driver on the head's host (its network namespace)."""
        head = next(iter(self.nodes.values()))
        return subprocess.run(
            ["ip", "netns", "exec", head.name, sys.executable, "-c", code],
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def revive(self, timeout: float = 180) -> list[str]:
        """Restarts every node whose Ray was killed and waits until each has joined again as a new
        Ray node (its old one may still count as alive until Ray's health checks fail); returns
        their names."""
        dead = [name for name, node in self.nodes.items() if node.proc.poll() is not None]
        if not dead:
            return []
        before = self.node_ids()
        deadline = time.monotonic() + timeout
        for name in dead:  # one at a time: raylets registering at once overload 2 cores
            self.restart_node(name)
            ip = self.nodes[name].ip
            while not self.node_ids().get(ip, set()) - before.get(ip, set()):
                if self.nodes[name].proc.poll() is not None:
                    raise RuntimeError(f"node {name}'s ray start exited: {self.nodes[name].log.read_text()[-3000:]}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"node {name} did not join again within {timeout} s")
                time.sleep(1)
        return dead

    def node_ids(self) -> dict[str, set[str]]:
        """The cluster's alive Ray nodes: address -> node ids."""
        probe = (
            f"import ray; ray.init(address='{self.address}', logging_level='ERROR'); "
            f"print(' '.join(n['NodeManagerAddress'] + '=' + n['NodeID'] for n in ray.nodes() if n['Alive']))"
        )
        out: dict[str, set[str]] = {}
        lines = self.run_python(probe, timeout=60).stdout.strip().splitlines()
        for pair in (lines[-1] if lines else "").split():
            ip, node = pair.split("=")
            out.setdefault(ip, set()).add(node)
        return out

    def run_python_live(
        self, code: str, on_line: Callable[[str], None], timeout: float = 300, env: dict[str, str] | None = None
    ) -> tuple[str, str]:
        """Runs `code` as `run_python` does, calling `on_line` with each line of its stdout as it
        comes (to act on the cluster mid-run); killed after `timeout` s. Returns (stdout, stderr)."""
        head = next(iter(self.nodes.values()))
        errors = tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen(
            ["ip", "netns", "exec", head.name, sys.executable, "-c", code],
            env={**self.env, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
        )
        watchdog = threading.Timer(timeout, proc.kill)
        watchdog.start()
        lines = []
        try:
            for line in proc.stdout:
                lines.append(line)
                on_line(line.rstrip("\n"))
            proc.wait(timeout=30)
        finally:
            watchdog.cancel()
            proc.kill()
            proc.wait(timeout=30)
        with errors:
            errors.seek(0)
            return "".join(lines), errors.read()

    def close(self) -> None:
        """Kills every process in the namespaces made, deletes them and the bridge; removes the temp dir."""
        for ns in self.namespaces:
            self._kill_namespace(ns)
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        deadline = time.monotonic() + 10  # the kernel removes a namespace's veth pairs a moment later
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.2)
        for node in self.nodes.values():
            try:
                node.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if not os.environ.get("RAYPIPE_KEEP_NETNS_LOGS"):
            shutil.rmtree(self.temp, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """Namespaces and links of this cluster still present (none after `close()`)."""
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        return sorted({w.split("@")[0].rstrip(":") for w in (names + links).split() if f"rp{self.tag}" in w})

    def _kill_namespace(self, ns: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            pids = [int(p) for p in out.stdout.split()]
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        raise RuntimeError(f"processes of namespace {ns} outlived SIGKILL for {timeout} s")

    @staticmethod
    def _sh(command: str) -> None:
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{command!r} failed: {done.stderr.strip()}")
