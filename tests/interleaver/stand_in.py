"""A stand-in for vLLM's GPU model runner (just what the tap worker reads of it) and tap workers loaded on it, on
CPU: a two-layer model whose layers return (hidden, residual) pairs, and one scheduled step at a time."""

from types import SimpleNamespace

import numpy as np
from torch import nn

from interleaver.tap_worker import TAPS_KEY, _TapWorkerMixin

H = 4


class PairLayer(nn.Module):
    def forward(self, x):
        return x * 0.5, x * 0.5  # (hidden, residual): the stream is their sum, x


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([PairLayer(), PairLayer()])

    def forward(self, x):
        h, r = self.layers[0](x)
        h, r = self.layers[1](h + r)
        return h + r


class Runner:
    """Just what the worker reads of vLLM's GPUModelRunner."""

    def __init__(self):
        self.model, self.device, self.requests, self.max_num_tokens = Model(), "cpu", {}, 8
        self.query_start_loc = SimpleNamespace(np=np.zeros(8, dtype=np.int32))
        self.input_batch = SimpleNamespace(num_reqs=0, req_ids=[], num_computed_tokens_cpu=np.zeros(8, dtype=np.int64))
        self.x = None

    def get_model(self):
        return self.model

    def _prepare_inputs(self, scheduler_output, num_scheduled):
        return None

    def execute_model(self, scheduler_output):
        self._prepare_inputs(scheduler_output, None)
        return self.model(self.x)


class Base:
    def load_model(self):
        pass


Worker = type("Worker", (_TapWorkerMixin, Base), {})


def tap_worker(config=None, taps=(("layers.0", True),)):
    """A tap worker on a fresh stand-in runner, loaded as vLLM loads it: `taps` installed, and `config` (more of
    vLLM's additional_config) read."""
    w = Worker()
    w.vllm_config = SimpleNamespace(additional_config={TAPS_KEY: [list(t) for t in taps], **(config or {})})
    w.model_runner = Runner()
    w.load_model()
    return w


def step(runner, reqs, x, finished=(), new=()):
    """Schedule reqs = [(req_id, rows, computed, prompt_len, extra_args)] and run one step (`finished`: the
    requests vLLM reports finished since the last step; `new`: those it schedules as new, its
    `scheduled_new_reqs`)."""
    runner.input_batch.num_reqs = len(reqs)
    runner.input_batch.req_ids[:] = [r[0] for r in reqs]  # in place, as vLLM keeps its list
    counts = [r[1] for r in reqs]
    runner.query_start_loc.np[: len(reqs) + 1] = np.concatenate([[0], np.cumsum(counts)])
    runner.input_batch.num_computed_tokens_cpu[: len(reqs)] = [r[2] for r in reqs]
    for rid, _, _, plen, extra in reqs:
        runner.requests[rid] = SimpleNamespace(num_prompt_tokens=plen,
                                               sampling_params=SimpleNamespace(extra_args=extra))
    runner.x = x
    return runner.execute_model(SimpleNamespace(total_num_scheduled_tokens=sum(counts), finished_req_ids=set(finished),
                                                scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new]))
