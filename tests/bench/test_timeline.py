"""Reading a traced pass's Chrome trace: decode steps' GPU busy and idle time, and host calls inside steps."""

import gzip
import json

import pytest

from steer.bench import timeline


def _x(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def synthetic_trace():
    """Two decode steps of 4 requests and one prefill, as vLLM marks them, with kernels and host calls."""
    step, prefill = "execute_context_0(0)_generation_4(4)", "execute_context_1(32)_generation_0(0)"
    return [
        _x("gpu_user_annotation", prefill, -500.0, 400.0),
        _x("kernel", "prefill_gemm", -450.0, 300.0),
        _x("gpu_user_annotation", step, 0.0, 100.0),
        _x("kernel", "gemm", 0.0, 40.0),
        _x("kernel", "tap_edit", 30.0, 30.0),  # overlaps the gemm: counted once
        _x("gpu_memcpy", "Memcpy HtoD", 70.0, 30.0),  # after a 10 us gap
        _x("gpu_user_annotation", step, 200.0, 100.0),
        _x("kernel", "gemm", 210.0, 80.0),  # 10 us idle either side
        _x("user_annotation", prefill, -600.0, 90.0),
        _x("user_annotation", step, 0.0, 90.0),
        _x("user_annotation", step, 195.0, 85.0),
        _x("cuda_runtime", "cudaGraphLaunch", 5.0, 3.0),
        _x("cuda_runtime", "cudaGraphLaunch", 200.0, 4.0),
        _x("cpu_op", "aten::copy_", 150.0, 20.0),  # between steps: not a step's
        _x("cpu_op", "aten::copy_", -590.0, 20.0),  # in the prefill: not a decode step's
        {"ph": "M", "name": "process_name"},
    ]


def test_busy_merges_overlaps_and_measures_every_gap():
    total, gaps = timeline.busy([(30.0, 60.0), (0.0, 40.0), (70.0, 100.0), (-10.0, 5.0), (120.0, 130.0)], 0.0, 110.0)
    assert total == pytest.approx(90.0) and gaps == pytest.approx([10.0, 10.0])


def test_decode_steps_are_told_from_prefill_by_their_marks():
    steps = timeline.decode_steps(synthetic_trace(), "gpu_user_annotation")
    assert steps == {4: [(0.0, 100.0), (200.0, 300.0)]}


def test_summary_splits_a_step_into_kernels_and_gaps_and_counts_host_calls(tmp_path):
    path = tmp_path / "w.123.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": synthetic_trace()}, f)
    assert timeline.latest(tmp_path) == path
    text = timeline.summary(timeline.load(path))
    assert "2 decode steps of 4 requests" in text
    # step 1: busy 0-60 and 70-100 (90 us); step 2: 210-290 (80 us); both spans 100 us
    assert "step span 0.100 ms, kernels running 0.085 ms, idle 0.015 ms (15.0%), 2 device ops a step" in text
    assert "idle gaps a step: 2" in text and "over 5 us: 1.5 (15 us)" in text
    assert "between consecutive steps: 0.100 ms a step" in text
    assert "3.5 us (   1.0)  cudaGraphLaunch" in text and "aten::copy_" not in text
    # device ops of the decode steps alone, a step: gemm 40 + 80, tap_edit 30 once, the copy 30 once
    assert "      60.0 us (   1.0)  gemm" in text and "      15.0 us (   0.5)  tap_edit" in text
    assert "      15.0 us (   0.5)  Memcpy HtoD" in text and "prefill_gemm" not in text


def test_a_real_profiler_trace_without_gpu_marks_says_so(tmp_path):
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function, tensorboard_trace_handler

    with profile(activities=[ProfilerActivity.CPU], on_trace_ready=tensorboard_trace_handler(str(tmp_path),
                                                                                              use_gzip=True)):
        with record_function("execute_context_0(0)_generation_4(4)"):
            torch.ones(8, 8) @ torch.ones(8, 8)
    path = timeline.latest(tmp_path)
    events = timeline.load(path)
    host = timeline.decode_steps(events, "user_annotation")
    assert list(host) == [4] and len(host[4]) == 1  # the mark is read, on the host alone
    assert timeline.summary(events) == "timeline: no decode step marks on the GPU stream in the trace\n"
