import os

import pytest

from jaxloop.launch import process_env


@pytest.fixture(scope="session")
def env():
    """The environment for trainer subprocesses. It carries the session's persistent compilation
    cache (tests/conftest.py: one directory for both xdist workers and every subprocess), caching
    every program, so a run of shapes that any earlier test or worker compiled does not recompile
    (results are the same executables)."""
    e = dict(os.environ)
    assert e.get("JAX_COMPILATION_CACHE_DIR"), "tests/conftest.py sets the session's cache"
    e["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return e


@pytest.fixture(scope="session")
def one_device_env(env):
    """`env` with one CPU device, as `python -m jaxloop.train` sees a CPU machine (the default
    job, scripts/learning_check.py) instead of the session's 8 fake devices."""
    return process_env(1, env)
