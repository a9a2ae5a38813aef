"""The suite's Ray worker processes start as forks of one process that has imported torch and
transformers already, instead of each importing them again.

Why: a stage actor is a fresh Python process, and most of its start is imports (torch 2.3 s,
a transformers model family 4 s more, on this machine's cores); the suite starts ~600 of them.
A fork of a process holding those modules skips that and shares their pages.

How: the session's Ray is started while `sys.executable` names a stand-in interpreter
(`interpreter`, `started_with`), so its raylet starts each worker through it. The stand-in
(`stand_in`) sends its command line, environment, directory and standard streams to the server
(`serve`) over a Unix socket; the server forks, and the fork becomes the worker (Ray's
`default_worker.py`, run as `__main__`); the stand-in waits, passes on signals, and exits as the
worker did. Anything else Ray starts with `sys.executable` (its dashboard, agents) the stand-in
runs with the real Python. Ray itself is
not imported before the fork: its core library must start in the worker (a fork of an imported
Ray cannot reach the GCS), so each worker still imports Ray and raypipe (~1 s).

Where the server is missing or refuses, the stand-in runs the worker the ordinary way.
Subprocess tests whose drivers start Rays of their own (the CLI, the GPU check's dry run, fake
clusters) or drive a job on a head reach the same server through Ray's `RAY_RUNTIME_ENV_HOOK`
(`runtime_env_hook`), which conftest's `fork_env` adds to their environment. A worker of a node
in another network or mount namespace (the netns clusters, a node with a private mount) starts
the ordinary way: a fork would live in the server's namespaces, not its node's.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import runpy
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

#: what the server imports before it forks (a family's modeling module costs a stage actor ~4 s)
PRELOAD = (
    "numpy",
    "torch",
    "torch.nn.functional",
    "transformers",
    "peft",
    *(
        f"transformers.models.{family}.modeling_{family}"
        for family in (
            "llama",
            "gpt2",
            "mistral",
            "mixtral",
            "qwen2",
            "qwen3",
            "qwen3_moe",
            "gemma2",
            "gemma3",
            "phi3",
            "olmo2",
            "gpt_neox",
            "granite",
            "deepseek_v3",
        )
    ),
)
#: the variable `runtime_env_hook` reads the stand-in's command line from
EXECUTABLE_VARIABLE = "RAYPIPE_TEST_FORK_EXECUTABLE"
_HEADER = struct.Struct("!I")
_STATUS = struct.Struct("!i")


def start(folder: Path, timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    """Starts the server in its own process; returns it and its `interpreter`. The caller stops it
    with `stop` (after its Ray, whose workers are the server's children)."""
    path = folder / "forks.sock"
    log = open(folder / "fork_server.log", "w")  # noqa: SIM115 - the server's own output, kept for a failure
    server = subprocess.Popen(
        [sys.executable, __file__, "serve", str(path)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    log.close()
    deadline = time.monotonic() + timeout
    while not Path(f"{path}.ready").exists():
        if server.poll() is not None or time.monotonic() > deadline:
            stop(server)
            raise RuntimeError(f"the fork server did not start: {(folder / 'fork_server.log').read_text()[-2000:]}")
        time.sleep(0.05)
    return server, interpreter(folder, f"{sys.executable} {__file__} {path}")


def interpreter(folder: Path, command: str) -> str:
    """An executable file that stands in for Python: a Ray worker it has the server fork, anything
    else it runs with the real Python. A Ray started while `sys.executable` names it starts its
    workers through it directly (`started_with`); a job's runtime env can name it as its
    `py_executable` too, but then each worker first passes through Ray's `setup_worker.py`, a
    Python process importing Ray (~0.7 s of CPU)."""
    path = folder / "python"
    path.write_text(f'#!/bin/sh\nexec {command} "$@"\n')
    path.chmod(0o755)
    return str(path)


@contextlib.contextmanager
def started_with(python: str) -> Iterator[None]:
    """`sys.executable` names `python` while a Ray starts inside: its raylet's command for a
    worker is `sys.executable default_worker.py ...` as Ray's `services.start_raylet` builds it."""
    real = sys.executable
    sys.executable = python
    try:
        yield
    finally:
        sys.executable = real


def runtime_env_hook(runtime_env: dict | None) -> dict:
    """Ray's `RAY_RUNTIME_ENV_HOOK`, which `ray.init` calls before it starts a local Ray: a
    subprocess's own local Ray starts its workers through the interpreter (`sys.executable` is
    left naming it: everything but a worker runs with the real Python). A job submitted to a head
    that `ray start` started (whose raylet runs the real Python) names it as its `py_executable`."""
    runtime_env = dict(runtime_env or {})
    python = use_interpreter()
    if python and "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ and "py_executable" not in runtime_env:
        runtime_env["py_executable"] = python
    return runtime_env


def use_interpreter() -> str | None:
    """`sys.executable` names the interpreter `fork_env` passed down (returned), if it did: for
    a test script that starts Ray nodes itself before its `ray.init` (a `Cluster`'s)."""
    python = os.environ.get(EXECUTABLE_VARIABLE)
    if python:
        sys.executable = python
    return python


def stop(server: subprocess.Popen) -> None:
    """Stops the server and every worker it forked that is still alive (after its Ray: none)."""
    forks = [pid for pid in _processes() if _parent(pid) == server.pid]
    for pid in [*forks, server.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    server.wait(timeout=30)


def _processes() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # ended meanwhile
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def serve(path: str) -> None:
    """Imports `PRELOAD`, then forks a worker for each stand-in that connects, and tells it the
    worker's pid and, when it ends, its wait status. One thread, so that each fork is clean."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - a worker that needs it imports it itself
            print(f"fork server: {name} not preloaded: {error}", flush=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    listener.settimeout(0.05)
    Path(f"{path}.namespaces").write_text(_namespaces())
    Path(f"{path}.ready").touch()
    waiting: dict[int, socket.socket] = {}
    while True:
        _report_ended(waiting)
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        try:
            conn.settimeout(30.0)
            header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
            request = json.loads(_read(conn, _HEADER.unpack(header)[0]))
        except Exception as error:  # noqa: BLE001 - that stand-in falls back to an ordinary start
            print(f"fork server: a bad request: {error!r}", flush=True)
            conn.close()
            continue
        pid = os.fork()
        if pid == 0:
            listener.close()
            conn.close()
            for other in waiting.values():
                other.close()
            _become_worker(request, fds)
        for fd in fds:
            os.close(fd)
        conn.settimeout(None)
        conn.sendall(_STATUS.pack(pid))
        waiting[pid] = conn


def _report_ended(waiting: dict[int, socket.socket]) -> None:
    while waiting:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(_STATUS.pack(status))
            except OSError:
                pass
            conn.close()


def _become_worker(request: dict, fds: list[int]) -> None:
    """In the fork: takes the stand-in's streams, directory, environment and command line, and
    runs the worker's script as `__main__`, as `python script args...` would."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.setsid()  # a group of its own, as Ray's workers have: Ray kills a worker's whole group
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        argv = request["argv"]
        sys.argv = list(argv)
        added = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[0:1] = [os.path.dirname(os.path.abspath(argv[0])), *added]
        runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as ended:
        code = ended.code if isinstance(ended.code, int) else (0 if ended.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed where the worker's own errors go
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def stand_in(path: str, argv: list[str]) -> None:
    """What Ray starts in place of the interpreter: has the server fork the worker, passes it
    the signals this process gets, and exits as it does. Runs the worker itself when the server
    cannot be reached."""
    try:
        if not argv or not argv[0].endswith("default_worker.py"):
            raise OSError("not a Ray worker: the real Python runs it")
        if Path(f"{path}.namespaces").read_text() != _namespaces():
            raise OSError("a node in other namespaces: its workers must live there")
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        body = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
        socket.send_fds(conn, [_HEADER.pack(len(body))], [0, 1, 2])
        conn.sendall(body)
        pid = _STATUS.unpack(_read(conn, _STATUS.size))[0]
    except (OSError, EOFError):
        os.execv(sys.executable, [sys.executable, *argv])

    def pass_on(signum: int, _frame: object) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, pass_on)
    try:
        status = _STATUS.unpack(_read(conn, _STATUS.size))[0]
    except (OSError, EOFError):  # the server is gone: so are its workers
        os._exit(1)
    if os.WIFSIGNALED(status):
        if os.WTERMSIG(status) not in (signal.SIGKILL, signal.SIGSTOP):  # those two take no handler
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))


def _namespaces() -> str:
    return " ".join(os.readlink(f"/proc/self/ns/{kind}") for kind in ("net", "mnt"))


def _read(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise EOFError("the other end closed")
        data += chunk
    return data


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        stand_in(sys.argv[1], sys.argv[2:])
