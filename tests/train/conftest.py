import os

import pytest


@pytest.fixture(scope="session")
def env(tmp_path_factory):
    """The environment for trainer subprocesses, with a persistent compilation cache shared by
    every test of the session, so repeated runs of the same shapes do not recompile (results are
    unaffected)."""
    e = dict(os.environ)
    e["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax_cache"))
    e["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return e
