import pytest


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly where there is no CUDA or no vLLM (CI, laptops)."""
    try:
        from steer.engine.vllm import available
        ok = available()
    except Exception:
        ok = False
    if ok:
        return
    skip = pytest.mark.skip(reason="needs CUDA and vLLM (run on the GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
