"""The GPU's SM clock and power draw through a timed pass, read from NVML in a background thread.

A GPU's clock follows its power and temperature, and on random weights an edit changes the values every GEMM
multiplies, and with them the power drawn: two cells can differ in speed because the GPU ran them at different
clocks. So each timed pass is sampled, every `PERIOD_S`, and the report puts the mean clock and power beside each
cell's figure. NVML comes from `pynvml` (nvidia-ml-py, what `torch.cuda.clock_rate` uses) or, where only vLLM
brings it (the GPU machine's bundle), from vLLM's own copy. Without either, or without a driver, `reader` says
why and the cells go without.
"""

import os
import threading
from statistics import fmean
from typing import Callable, Dict, List, Optional, Tuple

PERIOD_S = 0.02  # NVML's clock reading is instantaneous; 20 ms gives a 0.3 s pass (the tiny model's) 15 samples

Reading = Tuple[float, float]  # (SM clock in MHz, power in W)


def _module():
    """NVML's Python binding: pynvml (nvidia-ml-py), else the copy vLLM ships; None if neither imports."""
    try:
        import pynvml

        return pynvml
    except ImportError:
        pass
    try:
        from vllm.third_party import pynvml

        return pynvml
    except ImportError:
        return None


def reader(nvml=None) -> Tuple[Optional[Callable[[], Reading]], str]:
    """(a function reading the first visible GPU's SM clock and power, or None; why not, when None). `nvml`: the
    binding (None: found as `_module` finds it)."""
    nvml = nvml if nvml is not None else _module()
    if nvml is None:
        return None, "neither pynvml (nvidia-ml-py) nor vLLM's copy of it imports"
    try:
        nvml.nvmlInit()
        handle = _handle(nvml)
        read = lambda: (float(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),  # noqa: E731
                        nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)  # mW
        read()
    except Exception as e:  # no driver, no such device: NVML's own errors, whatever the binding calls them
        return None, f"NVML does not answer: {type(e).__name__}: {e}"
    return read, ""


def _handle(nvml):
    """The first GPU this process sees: CUDA numbers the visible devices from 0, NVML counts all of them."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if not first or first.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(first or 0))
    return nvml.nvmlDeviceGetHandleByUUID(first.encode())  # a GPU-... or MIG-... UUID


class Sampler:
    """Within its `with` block, `read()` every `period_s` (None: `PERIOD_S`) in a background thread, the first
    reading at once; `summary()` then gives the means. A reading that fails ends the sampling: the pass goes on."""

    def __init__(self, read: Callable[[], Reading], period_s: Optional[float] = None):
        self.read, self.period_s = read, PERIOD_S if period_s is None else period_s
        self.readings: List[Reading] = []
        self.error: Optional[str] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="nvml-sampler", daemon=True)

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            try:
                self.readings.append(self.read())
            except Exception as e:
                self.error = f"{type(e).__name__}: {e}"
                return
            if self._stop.wait(self.period_s):
                return

    def summary(self) -> Dict[str, float]:
        """{"sm_mhz", "power_w": the means of the readings, "samples": how many}; {} if none was read."""
        if not self.readings:
            return {}
        return {"sm_mhz": fmean(r[0] for r in self.readings), "power_w": fmean(r[1] for r in self.readings),
                "samples": len(self.readings)}
