"""The tap worker without vLLM: the host work of a replayed step on a stand-in runner (steer.bench.host times it)."""

from types import SimpleNamespace
from typing import Any, Iterable, Optional, Tuple

from interleaver.tap_worker import TAPS_KEY, _TapWorkerMixin


class _NoWorker:
    def load_model(self) -> None:
        pass


class HostWorker(_TapWorkerMixin, _NoWorker):
    """The tap worker without vLLM, on a stand-in runner: the host work a replayed step does, run alone (the row
    mapping and the tap programs; steer.bench.host times it). The runner offers what the worker reads of vLLM's
    GPUModelRunner: `device`, `max_num_tokens`, `requests` (id -> `num_prompt_tokens`, `sampling_params.extra_args`),
    `get_model()`, `query_start_loc.np`, `input_batch` (`num_reqs`, `req_ids`, `num_computed_tokens_cpu`),
    `_prepare_inputs` and `execute_model`."""

    def __init__(self, runner: Any, taps: Iterable[Tuple[str, bool]], config: Optional[dict] = None) -> None:
        """Load the worker on `runner` as vLLM loads it: `taps` ((module path, residual?)) installed, and `config`
        (more of vLLM's additional_config) read."""
        self.vllm_config = SimpleNamespace(additional_config={TAPS_KEY: [[p, bool(r)] for p, r in taps],
                                                              **(config or {})})
        self.model_runner = runner
        self.load_model()

    @property
    def interleaver(self):
        """The worker's VLLMInterleaver: its programs, and `replay(location, live)` as a recorded tap runs it."""
        return self.steer_il

    def fill_step(self, num_tokens: int, finished: Iterable[str] = ()) -> str:
        """Map the step's `num_tokens` rows to the runner's requests, as after vLLM prepares a step's inputs
        (`finished`: the requests vLLM reports finished since the last step); says which way it went ("steady",
        "rows" or "batch", as the host profile's `fill_step:<way>`)."""
        if finished:  # as the runner's wrapper does: vLLM reports finished requests on few steps
            self._steer_finished(finished)
        return self._steer_fill_step(SimpleNamespace(total_num_scheduled_tokens=num_tokens))
