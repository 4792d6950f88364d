"""Fixtures of the GPU tests: the taps, the HF engine on CUDA, and a direction extracted from it."""

import pytest

from steer.config.schema import TapConf
from steer.edits.tap import resolve


@pytest.fixture(scope="module")
def taps(tiny_spec):
    return [resolve(TapConf(layer=1), tiny_spec), resolve(TapConf(layer=2), tiny_spec)]


@pytest.fixture(scope="module")
def hf(tiny_spec):
    from steer.engine.hf import HFEngine

    return HFEngine(tiny_spec, "cuda")


@pytest.fixture(scope="module")
def direction(hf, tiny_spec):
    from steer.runs.extract import Recipe, direction

    return direction(hf, resolve(TapConf(layer=1), tiny_spec), ["I am happy and glad today"],
                     ["I am sad and tired today"], Recipe())[None]
