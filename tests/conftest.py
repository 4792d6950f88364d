import io
import os

import pytest

from helpers import MARK, end_processes_left


def pytest_configure(config):
    os.environ[MARK] = str(os.getpid())  # inherited by every process the tests start: processes_left() finds them
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Workers side by side on a core each: torch's threads spinning on a core the other worker holds slow
        # both several times over. The processes the tests start inherit the setting.
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def no_process_left():
    """The test run leaves no process behind: once every other fixture has ended its servers, any process the tests
    started that is still running (an orphaned server, a CLI's worker) fails the run, named, and is killed."""
    yield
    left = end_processes_left()
    assert not left, "processes the tests started outlived them (killed now):\n" + "\n".join(left)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory, worker_id):
    """One steer cache for the whole test run: the tiny model is built once and shared by every test, and by every
    worker of a parallel run (they share the base temp directory's parent; steer builds a cached model once while
    the others wait on its lock)."""
    if worker_id == "master":
        d = tmp_path_factory.mktemp("steer-cache")
    else:
        d = tmp_path_factory.getbasetemp().parent / "steer-cache"
        d.mkdir(exist_ok=True)
    os.environ["STEER_CACHE"] = str(d)
    return d


@pytest.fixture(scope="session", autouse=True)
def models_built_side_by_side(request, worker_id, cache_dir):
    """In a parallel run of many tests, the first worker builds the tiny model and the second converts SmolLM2
    first thing: otherwise one worker builds while the other, needing the same model, waits on its lock."""
    if worker_id not in ("gw0", "gw1") or len(request.session.items) < 100:
        return
    if worker_id == "gw0":
        request.getfixturevalue("tiny_spec")
    else:
        try:
            request.getfixturevalue("smollm2_spec")
        except pytest.skip.Exception:  # not available here: its tests skip
            pass
    freeze_what_lives()  # and the modules a model's spec imports on first use (transformers' and what they pull in)


@pytest.fixture(scope="session")
def tiny_spec(cache_dir):
    from steer.models import tiny
    from steer.models.spec import spec
    from steer.config.schema import ModelConf

    conf = ModelConf(name="tiny")
    tiny.ensure_tiny(str(cache_dir), conf.tiny)
    return spec(conf, str(cache_dir))


@pytest.fixture(scope="session")
def hf_engine(tiny_spec):
    from steer.engine.hf import HFEngine

    return HFEngine(tiny_spec)


@pytest.fixture(scope="session")
def hf_url(cache_dir, tiny_spec, tmp_path_factory):
    """The HF server on the tiny model (`python -m steer.serve engine=hf` in a subprocess), one for the test run: the
    server tests' and the judge's endpoint (tests/runs/test_judge.py). The tests that take it run on one worker
    (pytest_collection_modifyitems), so a parallel run starts it once."""
    from serve_common import server

    # layers 1 and 2 take requests' own vectors (test_serve_inline.py); on the HF engine an unused one costs nothing
    with server(["engine=hf", "serve.inline_layers=[1,2]"], cache_dir, tmp_path_factory.mktemp("serve-hf")) as url:
        yield url


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_spec):
    """The HF engine on SmolLM2, one for the test run, with one torch thread while it is held: on a small shared CPU,
    two threads contending with other processes ran a forward 8x slower than one."""
    import torch

    from steer.engine.hf import HFEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield HFEngine(smollm2_spec)
    torch.set_num_threads(threads)


@pytest.fixture
def cli(cache_dir, monkeypatch, capsys):
    """`cli(args, cwd)`: `python -m steer` with `args` (on the tiny model, as helpers.run_cli) run in this process
    (helpers.cli_here), for tests whose point is what the command does rather than the process it runs in."""
    from helpers import cli_here

    return lambda args, cwd: cli_here(args, cwd, monkeypatch, capsys)


@pytest.fixture
def console():
    """A rich Console that prints into memory (`console.file.getvalue()`), wide enough that no line wraps."""
    from rich.console import Console

    return Console(file=io.StringIO(), width=300)


def freeze_what_lives():
    """What is alive now stays for the whole run (the modules imported so far, the test modules), yet every full
    garbage collection would walk it again: each engine's close collects (steer/engine/hf.py), up to a quarter of a
    second in a worker. Collected first, so that only live objects are frozen; later collections walk what came
    after."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_collection_finish(session):
    freeze_what_lives()  # torch, transformers and every test module: some 350,000 objects, before any engine exists


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    """The modules with a test on SmolLM2 come first: the run's longest tests, handed out first (`--dist loadgroup`
    hands out the single tests in this order, after the groups), finish side by side rather than leave one worker
    running the last of them alone. The tests that take the run's one HF server (`hf_url`) share one xdist group, so
    they run on one worker and start the server once. GPU tests skip cleanly where there is no CUDA or no vLLM (CI,
    laptops)."""
    smollm2 = {item.path for item in items if "smollm2_spec" in getattr(item, "fixturenames", ())}
    items.sort(key=lambda item: item.path not in smollm2)  # stable: modules stay whole and in order
    for item in items:
        if "hf_url" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("hf_server"))
    if not any("gpu" in item.keywords for item in items):
        return
    try:
        from steer.engine.vllm import available

        ok = available()
    except ImportError:
        ok = False
    if ok:
        return
    skip = pytest.mark.skip(reason="needs CUDA and vLLM (run on a machine with both: pytest -m gpu -n 0)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """With STEER_TEST_FAILURES set (tests/gpu/run.sh sets it), each failure's traceback is appended to that file
    as it happens: a GPU run cut off by its time limit never reaches pytest's summary, where they would be."""
    path = os.environ.get("STEER_TEST_FAILURES")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


@pytest.fixture(scope="session")
def smollm2_spec(cache_dir):
    """SmolLM2's spec (converted once per test run into the run's cache); skipped where it cannot be found."""
    from steer.config.schema import ModelConf
    from steer.errors import ConfigError
    from steer.models.spec import spec

    try:
        return spec(ModelConf(name="smollm2", source="gguf"), str(cache_dir))
    except ConfigError as e:
        if e.field == "model.source":
            pytest.skip(f"SmolLM2 is not available on this machine: {e}")
        raise
