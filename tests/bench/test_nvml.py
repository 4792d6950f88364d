"""The GPU's clock and power through a timed pass: the sampler and NVML's reader with stand-ins, on CPU."""

import threading
import time
from types import SimpleNamespace

import pytest

from bench_common import bench_conf, first_cell, stand_in_runner
from steer.bench import nvml


def counting_reader(readings):
    """A reader handing out (MHz, W) pairs 1000 + i, 100 + i, each remembered in `readings`."""
    def read():
        i = len(readings)
        readings.append((1000.0 + i, 100.0 + i))
        return readings[-1]

    return read


def test_the_sampler_reads_through_its_block_and_stops_after_it():
    seen = []
    with nvml.Sampler(counting_reader(seen), period_s=0.002) as s:
        time.sleep(0.1)
    n = len(seen)
    time.sleep(0.02)
    assert len(seen) == n and not s._thread.is_alive()  # nothing read once the block is left
    assert n >= 5 and s.summary() == {"sm_mhz": pytest.approx(1000 + (n - 1) / 2),
                                      "power_w": pytest.approx(100 + (n - 1) / 2), "samples": n}


def test_a_pass_shorter_than_the_period_still_has_its_first_reading():
    seen = []
    with nvml.Sampler(counting_reader(seen), period_s=10.0) as s:
        pass
    assert s.summary()["samples"] == 1 and s.summary()["sm_mhz"] == 1000.0


def test_a_failing_reading_ends_the_sampling_not_the_pass():
    calls = []

    def read():
        calls.append(threading.current_thread().name)
        if len(calls) > 2:
            raise OSError("NVML gone")
        return 1500.0, 300.0

    with nvml.Sampler(read, period_s=0.001) as s:
        deadline = time.monotonic() + 10
        while s.error is None and time.monotonic() < deadline:  # the pass goes on past the failure
            time.sleep(0.005)
    assert len(calls) == 3 and set(calls) == {"nvml-sampler"}
    assert s.error == "OSError: NVML gone" and s.summary() == {"sm_mhz": 1500.0, "power_w": 300.0, "samples": 2}
    with nvml.Sampler(lambda: 1 / 0) as never:
        pass
    assert never.summary() == {} and never.error.startswith("ZeroDivisionError")


class FakeNvml:
    """What the reader calls of a pynvml module: two GPUs, 0 and 3, with their own clock and power (in mW)."""

    NVML_CLOCK_SM = 1

    def __init__(self, init_error=None):
        self.init_error = init_error
        self.gpus = {0: (1980, 500_000), 3: (1755, 612_500)}

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return {b"GPU-3f2a": 3}[uuid]

    def nvmlDeviceGetClockInfo(self, handle, kind):
        assert kind == self.NVML_CLOCK_SM
        return self.gpus[handle][0]

    def nvmlDeviceGetPowerUsage(self, handle):
        return self.gpus[handle][1]


@pytest.mark.parametrize("visible, expected", [(None, (1980.0, 500.0)), ("3,0", (1755.0, 612.5)),
                                               ("GPU-3f2a", (1755.0, 612.5)), ("", (1980.0, 500.0))])
def test_the_reader_reads_the_first_gpu_this_process_sees(monkeypatch, visible, expected):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    read, why = nvml.reader(FakeNvml())
    assert why == "" and read() == expected


def test_without_nvml_the_reader_says_why(monkeypatch):
    monkeypatch.setattr(nvml, "_module", lambda: None)
    assert nvml.reader() == (None, "neither pynvml (nvidia-ml-py) nor vLLM's copy of it imports")
    read, why = nvml.reader(FakeNvml(init_error=RuntimeError("Driver Not Loaded")))
    assert read is None and why == "NVML does not answer: RuntimeError: Driver Not Loaded"


@pytest.mark.parametrize("readable,period", [(True, 60), (False, 60), (True, 0)])
def test_a_cell_records_the_clock_and_power_of_its_passes(engine_c, monkeypatch, tmp_path, bench_model, readable,
                                                          period):
    # one reading a pass, the period being long; gpu_sample_s=0 reads none, NVML or not
    cfg = bench_conf("batches=[[4,6]]", "repeats=3", "min_timed_s=0", f"gpu_sample_s={period}")
    engine_c(lambda cfg, m, where, group: stand_in_runner())
    passes = iter([(1900.0, 400.0), (1800.0, 420.0), (1700.0, 480.0)])
    monkeypatch.setattr(nvml, "reader", lambda: (lambda: next(passes), "") if readable else (None, "no NVML"))
    [rec] = first_cell(cfg, bench_model, tmp_path / "out.json")
    assert rec["status"] == "ok" and len(rec["walls_s"]) == 3
    if readable and period:
        assert rec["sm_mhz_passes"] == [1900.0, 1800.0, 1700.0] and rec["power_w_passes"] == [400.0, 420.0, 480.0]
        assert (rec["sm_mhz"], rec["power_w"]) == (1800.0, 420.0)  # the medians of the passes' means
    else:
        assert not {"sm_mhz", "power_w", "sm_mhz_passes"} & set(rec)


def test_the_bench_says_once_that_there_is_no_nvml(monkeypatch, tmp_path, console):
    import steer.engine.vllm
    from steer.bench import __main__ as bench_main

    monkeypatch.setattr(steer.engine.vllm, "available", lambda: True)
    monkeypatch.setattr(nvml, "reader", lambda: (None, "no driver here"))
    monkeypatch.setattr(bench_main, "_lane", lambda *a: None)
    monkeypatch.setattr(bench_main._Book, "report", lambda self: "")
    cfg = bench_conf("run=[tiny]", "configs=[b]", "scenarios=[add]", "batches=[[4,6]]")
    monkeypatch.setattr("steer.bench.workload.model_dir", lambda m, cache: SimpleNamespace())
    monkeypatch.setattr("steer.bench.workload.spec", lambda m, name, where: SimpleNamespace(layers=4))
    bench_main.run(cfg, tmp_path, console, "python -m steer.bench")
    said = [line for line in console.file.getvalue().splitlines() if "clock" in line]
    assert said == ["[bench] warning: no GPU clock or power readings (no driver here); the report's sm_mhz and "
                    "power_w stay empty"]
