"""One local Ray for the whole test session (starting one costs about 5 s)."""

import os
import signal
import sys
import warnings
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)  # the driver shares 2 cores with the stage actors
SUPPORT = Path(__file__).resolve().parents[1] / "support"  # modules the tests share with the benchmarks
sys.path.insert(0, str(SUPPORT))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


METRICS_PORT = _free_port()


@pytest.fixture(scope="session")
def fork_executable(tmp_path_factory):
    """The stand-in interpreter whose Ray workers are forks of a process that imported torch and
    transformers once (`fork_server`), or None where RAYPIPE_TEST_FORKS=0 asks for ordinary ones.
    Stopped at the session's end, after every Ray that used it."""
    import fork_server

    if os.environ.get("RAYPIPE_TEST_FORKS", "1") == "0":
        yield None
        return
    server, executable = fork_server.start(tmp_path_factory.mktemp("forks"))
    try:
        yield executable
    finally:
        fork_server.stop(server)


@pytest.fixture(scope="session")
def fork_env(fork_executable):
    """What a subprocess's environment adds so that the Rays it starts (an embedded one, a job's
    head, a fake cluster) fork their workers too: Ray's `RAY_RUNTIME_ENV_HOOK` naming
    `fork_server.runtime_env_hook`, with this folder on PYTHONPATH to find it. Empty without forks."""
    import fork_server

    if fork_executable is None:
        return {}
    tests = str(Path(fork_server.__file__).parent)
    return {
        "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), tests) if p),
        "RAY_RUNTIME_ENV_HOOK": "fork_server.runtime_env_hook",
        fork_server.EXECUTABLE_VARIABLE: fork_executable,
    }


@pytest.fixture(scope="session")
def ray_session(fork_executable):
    """The local Ray every in-process test shares; its node serves Prometheus text on METRICS_PORT.
    Its workers are forks (`fork_executable`)."""
    import contextlib

    import fork_server
    import ray

    from raypipe.driver.cluster.connect import system_config

    os.environ["RAY_metrics_report_interval_ms"] = "1000"  # metrics reach the endpoint within ~1 s
    try:
        with fork_server.started_with(fork_executable) if fork_executable else contextlib.nullcontext():
            ray.init(
                address="local",
                num_cpus=2,
                include_dashboard=False,
                logging_level="ERROR",
                log_to_driver=False,
                _metrics_export_port=METRICS_PORT,
                _system_config=system_config(),  # as raypipe's own local Ray (RAYPIPE_PRELOAD)
            )
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(autouse=True)
def ctrl_c_stays_pythons(request):
    """Ctrl-C's handler is process state: a test that leaves another one behind (a library's, as
    Ray Tune's once did, or one a block failed to put back) makes every later `interrupt_main` a
    no-op, and the interrupt tests that follow it fail far from the cause (three did in one full
    run, passing alone). It is put back after each test, and the test that changed it is named in a
    warning."""
    yield
    handler = signal.getsignal(signal.SIGINT)
    if handler is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        warnings.warn(f"{request.node.nodeid} left SIGINT's handler as {handler!r}: put back", stacklevel=1)


@pytest.fixture(scope="session")
def metrics_port(ray_session):
    return METRICS_PORT


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small stdlib token file, built once into a temporary cache."""
    from raypipe.data import stdlib_corpus

    return stdlib_corpus(max_bytes=300_000, cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture
def clean_env(tmp_path, fork_env):
    """Environment for a subprocess that starts its own embedded Ray (whose workers fork too)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env["RAYPIPE_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONUNBUFFERED"] = "1"
    return {**env, **fork_env}


@pytest.fixture(scope="session")
def dot():
    """Graphviz's `dot`, which the README's set-up installs. Missing locally: the rendering tests
    skip with the install line. Missing in CI (`CI` set): they fail, so a cached environment
    without it cannot pass by skipping them silently."""
    import shutil

    path = shutil.which("dot")
    if path is None:
        message = "Graphviz's dot is not installed: apt-get install graphviz (or brew install graphviz)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must run the rendering tests, not skip them")
        pytest.skip(message)
    return path


_NETNS: dict = {}  # the namespace cluster while its tests run (`netns_cluster`)


@pytest.fixture(scope="session")
def netns_cluster(tmp_path_factory):
    """A real four-node Ray cluster in network namespaces (`support/netns_cluster.py`): head, cpu,
    mps-a, mps-b (the last two advertise mps through the fake-accelerator override), shared by the
    tests of test_netns_cluster and test_elastic, which run one after the other and each leave it
    whole (`revive` restarts what a test killed). Closed after its last user
    (`pytest_runtest_teardown`), not at the session's end: four idle raylets would load the
    2-core machine through every later test."""
    from netns_cluster import MPS, NetnsCluster

    made = NetnsCluster(tmp_path_factory.mktemp("netns"))
    _NETNS["cluster"] = made
    try:
        for name, kind in [("head", None), ("cpu", None), ("mps-a", MPS), ("mps-b", MPS)]:
            made.start_node(name, num_cpus=1, fake_accelerator=kind)
            made.wait_nodes()  # one at a time: four raylets registering at once overload 2 cores
    except BaseException:
        _close_netns()
        raise
    yield made
    _close_netns()


@pytest.fixture
def cluster(netns_cluster):
    """The namespace cluster, whole: nodes an earlier test killed are restarted first."""
    netns_cluster.revive()
    return netns_cluster


def _close_netns() -> None:
    made = _NETNS.pop("cluster", None)
    if made is not None:
        made.close()
        assert made.leftovers() == [], made.leftovers()


def pytest_collection_modifyitems(config, items):
    """Marks the fast tier (`tests/fast_tier.py`, `make test-fast`), refusing a listed case that no
    longer exists; and runs the namespace cluster's users one after another (test_elastic's after
    test_netns_cluster's), so that it is up only while they run."""
    import fast_tier

    unmatched = fast_tier.mark(items, pytest.mark.fast)
    if unmatched and config.getoption("markexpr") == "fast":
        raise pytest.UsageError(f"tests/fast_tier.py lists cases that are not collected: {unmatched}")
    users = [i for i in items if "netns_cluster" in getattr(i, "fixturenames", ())]
    if users:
        at = items.index(users[0])
        rest = [i for i in items if i not in set(users)]
        items[:] = rest[:at] + users + rest[at:]


def pytest_runtest_teardown(item, nextitem):
    if "netns_cluster" in getattr(item, "fixturenames", ()) and (
        nextitem is None or "netns_cluster" not in getattr(nextitem, "fixturenames", ())
    ):
        _close_netns()
