"""Fixtures of the bench tests: the bench's tiny model, engines that stand in for configuration c's, and a bench
run's book of records."""

import pytest

from bench_common import COMMAND, bench_conf
from steer.bench import engines


@pytest.fixture(scope="session")
def bench_model(cache_dir):
    """The bench's tiny model, written once per test run into its cache: the recipe's shape and tokenizer, random
    weights (bench_common.UNTRAINED)."""
    from steer.bench import workload

    return str(workload.model_dir(bench_conf().models["tiny"], str(cache_dir)))


@pytest.fixture
def engine_c(monkeypatch):
    """engine_c(start, machine): configuration c's engines are started by `start(cfg, m, where, group)`, which
    returns the runner a pass calls, on a machine described as `machine`."""

    def install(start, machine=None):
        monkeypatch.setitem(engines.RUNNERS, "c", start)
        monkeypatch.setattr(engines, "machine", lambda: machine or {})

    return install


@pytest.fixture
def new_book(tmp_path, console):
    """new_book(cfg): a bench run's book of records in tmp_path, its log on `console`."""
    from steer.bench.__main__ import Book

    return lambda cfg: Book(cfg, tmp_path, console, COMMAND)
