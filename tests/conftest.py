"""One local Ray for the whole test session (starting one costs about 5 s)."""

import os

import pytest
import torch

torch.set_num_threads(1)  # the driver shares 2 cores with the stage actors


@pytest.fixture(scope="session")
def ray_session():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small stdlib token file, built once into a temporary cache."""
    from raypipe.data import stdlib_corpus

    return stdlib_corpus(max_bytes=300_000, cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture
def clean_env(tmp_path):
    """Environment for a subprocess that starts its own embedded Ray."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env["RAYPIPE_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONUNBUFFERED"] = "1"
    return env
