import pytest

from steer.engine.hf_batch import Bound


@pytest.fixture(scope="module")
def batched(hf_engine):
    """The suite's shared engine with a bound that batches (restored after)."""
    was = hf_engine.bound
    hf_engine.bound = Bound(rows=8, tokens=4096)
    yield hf_engine
    hf_engine.bound = was
