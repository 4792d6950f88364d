"""What a traced pass's decode steps spent, read from the torch profiler's Chrome trace (vLLM writes one beside its
kernel table).

vLLM's table sums each kernel's device time; it cannot say whether a step's GPU time is kernels or the gaps
between them (graph segments launched one after another, a host that falls behind). The trace can: vLLM marks
each step on the GPU stream (`execute_context_<n>(<tokens>)_generation_<n>(<tokens>)`), so for every decode step
this gives the marked span (first kernel to last), how much of it some kernel was running, the gaps, the time
from one step's last kernel to the next step's first, the device ops inside the step by name (the table beside it
counts the prefill too), and the host calls inside the step's host span (inclusive times, by name).
"""

import bisect
import gzip
import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Tuple

_STEP = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
_DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")
_HOST = ("cpu_op", "cuda_runtime", "cuda_driver")


def load(path: Path) -> List[dict]:
    """The complete events ("ph": "X") of a Chrome trace file, gzipped or not."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def decode_steps(events: List[dict], cat: str) -> Dict[int, List[Tuple[float, float]]]:
    """Spans (start, end in us) of the steps that only decode, by their request count, from vLLM's step marks of
    category `cat` (gpu_user_annotation: on the GPU stream; user_annotation: on the host)."""
    out: Dict[int, List[Tuple[float, float]]] = defaultdict(list)
    for e in events:
        m = _STEP.fullmatch(e.get("name", "")) if e.get("cat") == cat else None
        if m and int(m.group(1)) == 0 and int(m.group(3)) > 0:
            out[int(m.group(3))].append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    return {n: sorted(s) for n, s in out.items()}


def busy(intervals: List[Tuple[float, float]], lo: float, hi: float) -> Tuple[float, List[float]]:
    """How long within [lo, hi] at least one interval runs, and the idle gaps there (between lo, the merged
    intervals and hi)."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi)
    total, gaps, at = 0.0, [], lo
    for a, b in clipped:
        if a > at:
            gaps.append(a - at)
        if b > at:
            total += b - max(a, at)
            at = b
    if hi > at:
        gaps.append(hi - at)
    return total, gaps


def summary(events: List[dict], top: int = 12) -> str:
    """A text summary of the decode steps of the busiest batch size (see the module docstring)."""
    gpu_steps = decode_steps(events, "gpu_user_annotation")
    cpu_steps = decode_steps(events, "user_annotation")
    if not gpu_steps:
        return "timeline: no decode step marks on the GPU stream in the trace\n"
    n = max(gpu_steps, key=lambda k: (len(gpu_steps[k]), k))
    steps = gpu_steps[n]
    device = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e.get("cat") in _DEVICE]
    spans, busies, gaps_all, launches = [], [], [], []
    for lo, hi in steps:
        b, gaps = busy(device, lo, hi)
        spans.append(hi - lo)
        busies.append(b)
        gaps_all += gaps
        launches.append(sum(1 for a, _ in device if lo <= a < hi))
    k = len(steps)
    span, work = sum(spans) / k, sum(busies) / k
    lines = [f"timeline: {k} decode steps of {n} requests (GPU marks)",
             f"  step span {span / 1e3:.3f} ms, kernels running {work / 1e3:.3f} ms, idle {(span - work) / 1e3:.3f} ms "
             f"({(span - work) / span:.1%}), {sum(launches) / k:.0f} device ops a step",
             f"  idle gaps a step: {len(gaps_all) / k:.0f}; over 5 us: {sum(g > 5 for g in gaps_all) / k:.1f} "
             f"({sum(g for g in gaps_all if g > 5) / k:.0f} us); the largest: "
             + ", ".join(f"{g:.1f}" for g in sorted(gaps_all, reverse=True)[:8]) + " us"]
    between = [b[0] - a[1] for a, b in zip(steps, steps[1:])]
    if between:  # the GPU waiting on the host from one step to the next (a host-bound model's time goes here)
        lines.append(f"  between consecutive steps: {sum(between) / len(between) / 1e3:.3f} ms a step")
    lines += _kernel_lines(events, steps, top)
    lines += _host_lines(events, cpu_steps.get(n, []), top)
    return "\n".join(lines) + "\n"


def _inside(events: List[dict], cats: Tuple[str, ...], spans: List[Tuple[float, float]]):
    """The events of categories `cats` that start inside one of `spans` (sorted, not overlapping)."""
    starts = [a for a, _ in spans]
    for e in events:
        if e.get("cat") in cats:
            t = float(e["ts"])
            i = bisect.bisect_right(starts, t)  # the last span starting at or before t
            if i and t < spans[i - 1][1]:
                yield e


def _by_name(events, per: int, top: int) -> List[str]:
    """Lines of total duration a step and count a step by event name, the largest first."""
    totals: Counter = Counter()
    calls: Counter = Counter()
    for e in events:
        totals[e["name"]] += float(e["dur"])
        calls[e["name"]] += 1
    return [f"    {t / per:10.1f} us ({calls[name] / per:6.1f})  {name[:90]}" for name, t in totals.most_common(top)]


def _kernel_lines(events: List[dict], steps: List[Tuple[float, float]], top: int) -> List[str]:
    # vLLM's table above sums a kernel over the whole trace, prefill included; a decode step's own share is what a
    # steering edit adds to the step (f's tap_edit launches beside b's kernels)
    lines = ["  device ops inside them, us a step (ops a step):"]
    return lines + _by_name(_inside(events, _DEVICE, steps), len(steps), top)


def _host_lines(events: List[dict], host: List[Tuple[float, float]], top: int) -> List[str]:
    if not host:
        return []
    h = len(host)
    lines = [f"  host: {h} decode steps marked, {sum(b - a for a, b in host) / h / 1e3:.3f} ms a step; "
             "calls inside them, inclusive us a step (calls a step):"]
    return lines + _by_name(_inside(events, _HOST, host), h, top)


def latest(directory: Path) -> Optional[Path]:
    """The newest Chrome trace torch's profiler wrote under `directory`, or None."""
    found = sorted(Path(directory).rglob("*.pt.trace.json*"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def report(directory: Path) -> str:
    """The decode steps' GPU busy and idle time and host calls, from the newest Chrome trace in `directory` (the
    profiler's); a line saying why where there is none or it cannot be read."""
    path = latest(directory)
    if path is None:
        return "timeline: no Chrome trace in the profiler's directory\n"
    try:
        return f"{summary(load(path))}(from {path.name})\n"
    except Exception as e:  # the kernel table beside it stands on its own
        return f"timeline: {path.name} unreadable: {type(e).__name__}: {e}\n"
