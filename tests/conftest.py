import io
import os

import pytest


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One steer cache for the whole session: the tiny model is built once and shared by every test."""
    d = tmp_path_factory.mktemp("steer-cache")
    os.environ["STEER_CACHE"] = str(d)
    return d


@pytest.fixture(scope="session")
def tiny_spec(cache_dir):
    from steer import tiny
    from steer.model import spec
    from steer.schema import ModelConf

    conf = ModelConf(name="tiny")
    tiny.ensure_tiny(str(cache_dir), conf.tiny)
    return spec(conf, str(cache_dir))


@pytest.fixture(scope="session")
def hf_engine(tiny_spec):
    from steer.engine.hf import HFEngine

    return HFEngine(tiny_spec)


@pytest.fixture
def console():
    """A rich Console that prints into memory (`console.file.getvalue()`), wide enough that no line wraps."""
    from rich.console import Console

    return Console(file=io.StringIO(), width=300)


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly where there is no CUDA or no vLLM (CI, laptops)."""
    if not any("gpu" in item.keywords for item in items):
        return
    try:
        from steer.engine.vllm import available

        ok = available()
    except ImportError:
        ok = False
    if ok:
        return
    skip = pytest.mark.skip(reason="needs CUDA and vLLM (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
