"""The vLLM engine: compiled edits replayed inside vLLM's breakable CUDA graphs, at graph speed.

Taps are fixed when the engine starts (vLLM records its graphs then); edits (the interleaver's own
record, interleaver/edit.py) are registered as stages of an EditBank and shipped to the worker once, and each
request carries only its (stage, strength, tokens) entries in SamplingParams.extra_args. Baseline and steered
requests share batches: a request with no entries is untouched.
Prefix caching is switched off (a prefix cached without an edit must not serve a steered request); chunked
prefill stays on and is correct, since a row's edit depends only on its position and its request.
Only public vLLM API is used here; the internals live in interleaver/vllm_internals.py.
"""

import gc
import os
import sys
import time
from dataclasses import replace
from typing import List, Optional, Sequence, Tuple

import torch

from interleaver.bank import EditBank, RequestEdits
from interleaver.clock import Clock
from interleaver.vllm_internals import shutdown, tap_location
from interleaver.tap_worker import (COMPILED_KEY, COMPILED_VERSION, CONDITIONS_KEY, FOLD_KEY, IN_GRAPH_KEY,
                                    TAP_GRAPHS_KEY, TAPS_KEY, worker_cls)
from steer.engine.base import Engine, GenJob, ScoreJob, Scores, stop_ids
from steer.models.spec import ModelSpec
from steer.edits.plan import Plan
from steer.config.schema import GenConf, VllmConf
from steer.edits.tap import Tap


def available() -> bool:
    """Whether this machine can run the vLLM engine (CUDA and an importable vLLM)."""
    if not torch.cuda.is_available():
        return False
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


class VLLMEngine(Engine):
    name = "vllm"
    _core_here = False  # whether this engine's core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)

    def __init__(self, spec: ModelSpec, conf: VllmConf, taps: Sequence[Tap], declare: Sequence[Plan] = (),
                 profile_dir: Optional[str] = None):
        """Start vLLM with `taps`. With `conf.edits_in_graph`, the edits of `declare` (every plan the engine will
        serve) are captured into the graphs, and the engine serves those alone. With `profile_dir`, vLLM's torch
        profiler is ready for `start_profile()` (see `profiler_config`)."""
        set_environment(conf)
        from transformers import AutoTokenizer
        from vllm import LLM

        compilation = compilation_config(conf)
        self.spec = spec
        self.taps = {t.path: t for t in taps}
        self.bank = EditBank()
        self.in_graph = conf.in_graph_field() is not None
        extra = self._additional_config(conf, taps, declare)
        self._pushed, self._pushed_conditions = len(self.bank.stages), len(self.bank.conditions)
        self.tokenizer = AutoTokenizer.from_pretrained(spec.source, revision=spec.revision)
        self.stop_ids = stop_ids(self.tokenizer, spec.source)
        self._core_here = before_start()
        self.llm = LLM(
            model=spec.source,
            revision=spec.revision,
            dtype=str(spec.dtype).replace("torch.", ""),
            enforce_eager=conf.enforce_eager,
            gpu_memory_utilization=conf.gpu_memory_utilization,
            kv_cache_memory_bytes=conf.kv_cache_memory_bytes,
            max_model_len=conf.max_model_len,
            max_num_seqs=conf.max_num_seqs,
            **({"max_num_batched_tokens": conf.max_num_batched_tokens} if conf.max_num_batched_tokens else {}),
            enable_prefix_caching=False,
            load_format=conf.load_format,
            worker_cls=worker_cls(),
            additional_config=extra,
            max_logprobs=-1,
            seed=0,
            tensor_parallel_size=conf.tensor_parallel_size,
            **({"compilation_config": compilation} if compilation else {}),
            **({"profiler_config": profiler_config(profile_dir)} if profile_dir else {}),
        )
        self._keys = 0
        self._clock = Clock()  # host time building SamplingParams (host_profile's "params")
        # A reading under a condition holds two of the worker's 2 * max_num_seqs condition slots (score_many)
        self._readings_at_once = conf.max_num_seqs

    def _additional_config(self, conf: VllmConf, taps: Sequence[Tap], declare: Sequence[Plan]) -> dict:
        """What the tap worker reads when it loads the model: the taps, and the declared edits of an in-graph
        engine (registered in this engine's bank)."""
        extra = {TAPS_KEY: [[t.path, t.residual] for t in taps]}
        if conf.tap_graphs:
            if self.in_graph:
                raise ValueError("vllm.tap_graphs: an engine with its edits in the graph (vllm.edits_in_graph, "
                                 "vllm.compiled_edits) has no breaks to replay graphs at; set one of the two")
            extra[TAP_GRAPHS_KEY] = True
        if self.in_graph:
            for p in declare:
                self._edits(p)
            if not self.bank.stages:
                raise ValueError(f"vllm.{conf.in_graph_field()}: declare the plans the engine serves when it starts")
            extra[IN_GRAPH_KEY] = self.bank.stage_list()
            extra[CONDITIONS_KEY] = self.bank.condition_list()
        if conf.compiled_edits:
            extra[COMPILED_KEY] = COMPILED_VERSION
        if conf.fold_norm:
            if conf.fold_error():
                raise ValueError(f"vllm.fold_norm: {conf.fold_error()}")
            extra[FOLD_KEY] = True
        return extra

    @property
    def max_len(self) -> int:
        """Positions a request may use, prompt and continuation together."""
        return int(self.llm.llm_engine.model_config.max_model_len)

    @property
    def vocab_size(self) -> int:
        return int(self.llm.llm_engine.model_config.get_vocab_size())

    def close(self) -> None:
        """Shut vLLM's engine core down (the process and workers that hold the weights, the KV cache and the
        graphs) and free what this process cached on the GPU. vLLM frees a worker's memory when its process ends;
        in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0) it frees what it can of its own."""
        llm, self.llm = self.llm, None
        if llm is None:
            return
        shutdown(llm)
        del llm
        gc.collect()
        if torch.cuda.is_initialized():  # not when the engine core had a process of its own and this none
            torch.cuda.empty_cache()
        release_host_cache()
        if self._core_here:
            end_core_here()

    def start_profile(self) -> None:
        """Arm vLLM's torch profiler (an engine started with `profile_dir`)."""
        self.llm.start_profile()

    def stop_profile(self) -> None:
        """Stop it: the kernel table and the Chrome trace are in `profile_dir` when this returns."""
        self.llm.stop_profile()

    def host_profile(self) -> dict:
        """The taps' host seconds and calls per section since the last call, and how many tap program calls took
        the fused kernel and the torch form (STEER_PROFILE=1 in the engine's environment; else {}): rank 0's;
        beside them, where `sampling_params` ran (with or without STEER_PROFILE), "params": this process's time in it
        (plan registration included), which a batch waits for before vLLM sees it."""
        return {**self.llm.collective_rpc("steer_profile")[0], **self._clock.take()}

    def _edits(self, plan: Optional[Plan], **kw) -> RequestEdits:
        """The request's entries, its plan's edits and conditions registered in the bank (nothing registered where
        the plan is refused)."""
        for path in list(plan.edits if plan else []) + [c.path for c in (plan.conditions() if plan else [])]:
            if path not in self.taps:
                raise ValueError(f"edit or condition at {path!r}, which is not a tap of this engine: "
                                 f"{sorted(self.taps)}")
        entries = []
        for path, edits in (plan.edits.items() if plan else []):
            entries += self.bank.register(tap_location(path), edits)
        return RequestEdits(entries, decide=bool(plan and plan.conditions()), **kw)

    def _push(self) -> None:
        """Ship the stage list to the workers when it grew (once per batch, not per request)."""
        if len(self.bank.stages) == self._pushed and len(self.bank.conditions) == self._pushed_conditions:
            return
        if self.in_graph:
            new = self.bank.stages[self._pushed] if len(self.bank.stages) > self._pushed else None
            self.bank.truncate(self._pushed)  # the declared edits (and their conditions) stay servable
            self.bank.drop_conditions(self._pushed_conditions)
            what = f"edit {new.edit.kind.value} at {new.location}" if new is not None else "a condition"
            raise ValueError(f"{what} was not declared when this engine started: its edits are captured into its "
                             "graphs (vllm.edits_in_graph, vllm.compiled_edits)")
        self.llm.collective_rpc("steer_set_stages", args=(self.bank.stage_list(), self.bank.condition_list()))
        self._pushed, self._pushed_conditions = len(self.bank.stages), len(self.bank.conditions)

    def sampling_params(self, plans: Sequence[Optional[Plan]], seeds: Optional[Sequence[int]] = None, **kw) -> list:
        """A vLLM SamplingParams for each plan (None: unsteered), its edits riding in extra_args, one object for
        the requests of one plan and seed; `kw` are SamplingParams fields shared by all."""
        # Requests that share a plan object share its entries: registering a plan hashes each edit's vectors (about
        # 18 us a tap on a CPU), and done per request it would hold a batch that ablates at 32 layers for tens of ms
        # before it starts. They share its extra_args string too, which vLLM's per-request deep copy copies for free
        # (RequestEdits.to_args).
        t0 = time.perf_counter()
        shared = {k: self._wire(e) for k, e in self._register(plans).items()}
        seeds = seeds if seeds is not None else [None] * len(plans)
        # One SamplingParams per (plan, seed), as vLLM's own generate shares one among a batch: its input processor
        # clones each request's, and building one is about 16 us (1-4 ms before a 64-256 request batch started)
        made, out = {}, []
        for plan, seed in zip(plans, seeds):
            key = (id(plan) if plan else None, seed)
            if key not in made:
                made[key] = self._params(shared[id(plan)] if plan else None, seed=seed, **kw)
            out.append(made[key])
        self._clock.add("params", time.perf_counter() - t0)
        return out

    @staticmethod
    def _wire(edits: RequestEdits) -> Optional[str]:
        """The worker's extra_args["steer"] for `edits`, None where they ask for nothing."""
        return edits.to_args() if edits.entries or edits.capture else None

    def _params(self, steer: Optional[str], **kw):
        from vllm import SamplingParams

        extra = {"steer": steer} if steer is not None else None
        if not kw.get("ignore_eos"):  # stop where the HF engine stops (the bench asks for fixed lengths instead)
            kw.setdefault("stop_token_ids", sorted(self.stop_ids))
        return SamplingParams(extra_args=extra, **kw)

    def _generate(self, prompts: Sequence[Sequence[int]], params: list) -> list:
        """vLLM's RequestOutputs for token prompts, one batched call."""
        return self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)

    def generate_many(self, jobs: Sequence[GenJob], gen: GenConf, progress=None) -> List[List[int]]:
        """Continue every (prompt ids, plan or None, seed) job in one batched vLLM call."""
        params = self.sampling_params([plan for _, plan, _ in jobs], [seed for _, _, seed in jobs],
                                      max_tokens=gen.max_new_tokens, temperature=gen.temperature, top_p=gen.top_p)
        outs = self._generate([ids for ids, _, _ in jobs], params)
        if progress:
            progress(len(jobs))
        # vLLM keeps the end-of-sequence token it stopped on; the HF engine stops before it.
        return [list(o.outputs[0].token_ids[:-1] if o.outputs[0].token_ids[-1:] and o.outputs[0].token_ids[-1]
                     in self.stop_ids else o.outputs[0].token_ids) for o in outs]

    def generate(self, prompt_ids: List[int], plan: Optional[Plan], gen: GenConf, seed: int) -> List[int]:
        return self.generate_many([(prompt_ids, plan, seed)], gen)[0]

    def generate_tokens(self, prompts: Sequence[Sequence[int]], plans: Sequence[Optional[Plan]], max_tokens: int,
                        ignore_eos: bool = False, detokenize: bool = True) -> List[Sequence[int]]:
        """Greedy continuations of token prompts under their plans (None: unsteered), in one batched call, as vLLM
        hands them back (a stop token it stopped on included). With `ignore_eos` each runs to exactly
        `max_tokens`; without `detokenize` none is decoded (a dummy-weight model samples ids its tokenizer may
        lack). The bench's timed pass: every configuration does the same work."""
        params = self.sampling_params(plans, max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos,
                                      detokenize=detokenize)
        return [o.outputs[0].token_ids for o in self._generate(prompts, params)]

    def score_many(self, jobs: Sequence[ScoreJob]) -> List[Scores]:
        """Teacher-force each (prompt, continuation, plan, capture paths) job: per-row log-probs `[T, vocab]`
        (row t predicts token t + 1) and each captured tap's `[T, hidden]` value after its edits.

        Under a condition the continuation reads the decision its prompt made, at every tap, as generated tokens
        do; read as one prompt, its tokens would pass the taps up to the condition's before the decision. So each
        conditioned prompt first runs alone for one token and keeps its decisions for its reading
        (RequestEdits.hold and held), in rounds of at most max_num_seqs jobs: a kept decision and its reading hold
        two of the worker's 2 * max_num_seqs condition slots."""
        if any(capture for *_, capture in jobs) and self.in_graph:
            raise ValueError("an engine with its edits in the graph keeps no tap values (no eager break "
                             "to copy them out): score with captures on a replay engine")
        base = self._registered(jobs)
        if not any(e.decide for e in base):
            return self._read(jobs, base, self._new_keys(len(jobs)), [""] * len(jobs))
        out: List[Scores] = []
        for start in range(0, len(jobs), self._readings_at_once):
            end = start + self._readings_at_once
            out += self._read_deciding_first(jobs[start:end], base[start:end])
        return out

    def _register(self, plans: Sequence[Optional[Plan]]) -> dict:
        """id(plan) -> its edits, for each distinct plan (None: unsteered, skipped), registered once and the stage
        list shipped before any request runs: requests of one plan share its entries, and a refusal ships nothing."""
        made = {}
        for plan in plans:
            if plan and id(plan) not in made:
                made[id(plan)] = self._edits(plan)
        self._push()
        return made

    def _registered(self, jobs: Sequence[ScoreJob]) -> List[RequestEdits]:
        """Each job's edits (`_register`'s): shipped before any request runs, so a refusal leaves no decision held."""
        made = self._register([plan for _, _, plan, _ in jobs])
        return [made[id(plan)] if plan else self._edits(None) for _, _, plan, _ in jobs]

    def _new_keys(self, n: int) -> List[str]:
        """Names for `n` scoring requests, unique in this engine (their captures and kept decisions go by them)."""
        self._keys += n
        return [f"score-{k}" for k in range(self._keys - n + 1, self._keys + 1)]

    def _read_deciding_first(self, jobs: Sequence[ScoreJob], base: Sequence[RequestEdits]) -> List[Scores]:
        """`score_many` for jobs some of which carry a condition: their prompts alone first, then every reading."""
        keys = self._new_keys(len(jobs))
        holds = [key if e.decide else "" for e, key in zip(base, keys)]
        first = [(ids, replace(e, hold=h)) for (ids, *_), e, h in zip(jobs, base, holds) if h]
        try:
            self._generate([ids for ids, _ in first], [self._params(self._wire(e), max_tokens=1, temperature=0.0,
                                                                    detokenize=False) for _, e in first])
            return self._read(jobs, base, keys, holds)
        finally:  # the readings have ended (or failed): no decision stays held
            self.llm.collective_rpc("steer_drop_held", args=([h for h in holds if h],))

    def _read(self, jobs: Sequence[ScoreJob], base: Sequence[RequestEdits], keys: Sequence[str],
              held: Sequence[str]) -> List[Scores]:
        """Each job read in one pass under its key (`base`: its registered edits), its rows past the prompt reading
        the decisions kept under `held` (if any)."""
        params = []
        for (prompt_ids, _cont_ids, _plan, capture), e, key, h in zip(jobs, base, keys, held):
            edits = replace(e, prompt_len=len(prompt_ids), capture=[tap_location(p) for p in capture], key=key,
                            held=h)
            # Flat, undecoded log-probs: a full-vocabulary row as Python dicts of decoded tokens costs more than
            # the forward pass.
            params.append(self._params(self._wire(edits), max_tokens=1, temperature=0.0, prompt_logprobs=-1,
                                       logprobs=-1, flat_logprobs=True, detokenize=False))
        outs = self._generate([list(p) + list(c) for p, c, _, _ in jobs], params)
        kept = {loc: {k: [torch.tensor(b) for b in blocks] for k, blocks in by_key.items()}
                for loc, by_key in rank_zero(self.llm.collective_rpc("steer_take_kept")).items()}
        vocab = self.vocab_size
        results = []
        for (_, _, _, capture), key, o in zip(jobs, keys, outs):
            # Row t predicts token t + 1: prompt positions 1.. then the one sampled position.
            logprobs = torch.cat([_dense(o.prompt_logprobs, 1, vocab), _dense(o.outputs[0].logprobs, 0, vocab)])
            caps = {p: torch.cat(kept.get(tap_location(p), {}).get(key, []), 0) for p in capture}
            results.append(Scores(logprobs, caps))
        return results

    def score(self, prompt_ids: List[int], cont_ids: List[int], plan: Optional[Plan],
              capture: Tuple[str, ...] = ()) -> Scores:
        return self.score_many([(prompt_ids, cont_ids, plan, capture)])[0]


# Engine cores started in this process and not closed since (one that failed to start is counted for good)
_cores_here = 0


def before_start() -> bool:
    """Before an engine starts vLLM: empty the pinned host cache where an engine core that ran in this process left
    its blocks (still running, dropped without close, or failed to start), and count the new engine's core if it
    runs in this process too; says whether it does. Where none ran here there is nothing of a core's to empty, and
    the cache stays as it is (docs/perf-log.md has what an in-process start behind an emptied cache gave)."""
    global _cores_here
    import vllm.envs

    if _cores_here:
        release_host_cache()
    here = not vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING
    _cores_here += here
    return here


def end_core_here() -> None:
    """An engine whose core ran in this process has closed it (and emptied the cache behind it)."""
    global _cores_here
    _cores_here = max(_cores_here - 1, 0)


def release_host_cache() -> None:
    """Empty torch's cache of pinned host blocks in this process, where CUDA is initialised. Blocks an in-process
    engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0) used stay cached with their use counts, and the next breakable
    graph capture in this process trips an assert on them (vLLM 0.26, torch 2.11: CachingHostAllocator.h:773)."""
    if not torch.cuda.is_initialized():
        return
    torch.cuda.synchronize()
    empty = getattr(torch._C, "_host_emptyCache", None)  # private: a torch may lack it
    if empty is not None:
        empty()


def set_environment(conf: VllmConf, rpc_tensors: bool = True) -> None:
    """vLLM's settings that it reads from the environment when an engine starts (set before it reads them)."""
    # Breakable graphs are what let a tap run at its point of every replay; they turn vLLM's torch.compile off,
    # which an engine with compiled edits keeps on.
    os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "0" if conf.compiled_edits else "1"
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    # This engine's RPCs carry compiled edits and tensors between its process and its own workers; a server's
    # messages are plain data, and with `rpc_tensors` false nothing else may cross.
    if rpc_tensors:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    else:
        os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
    # The HF engine or a vector extraction may have touched CUDA here already: fork would break it.
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    # The tap worker hooks the V1 GPUModelRunner (interleaver/vllm_internals.py); 0.26 would otherwise pick
    # its V2 runner for Llama-family models.
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    forget_environment()  # an engine core that ran in this process may have cached the last engine's


def forget_environment() -> None:
    """Make vLLM read its environment variables afresh. An engine core caches them once it has started
    (vllm.envs.enable_envs_cache) until its shutdown; where it runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING
    =0) and is still running or was dropped without one, the next engine here would keep its settings."""
    envs = sys.modules.get("vllm.envs")  # not imported yet: nothing cached
    if envs is not None and hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()


def profiler_config(directory: str) -> dict:
    """vLLM's torch profiler, armed by `llm.start_profile()` and stopped by `llm.stop_profile()`: the trace and a
    table of kernels by GPU time (`profiler_out_<rank>.txt`) land in `directory` (an absolute path)."""
    return {"profiler": "torch", "torch_profiler_dir": str(directory), "torch_profiler_with_stack": False}


def compilation_config(conf: VllmConf) -> dict:
    """vLLM's compilation settings from ours: which step sizes get a graph."""
    out = {}
    if conf.cudagraph_capture_sizes:
        out["cudagraph_capture_sizes"] = sorted(set(conf.cudagraph_capture_sizes))
    elif conf.max_cudagraph_capture_size:
        out["max_cudagraph_capture_size"] = conf.max_cudagraph_capture_size
    return out


def _dense(flat, first: int, vocab: int) -> torch.Tensor:
    """Positions `first`.. of vLLM's FlatLogprobs as a dense `[positions, vocab]` float32 matrix (a position's
    entries follow the previous position's, so the positions wanted are one slice of the flat lists)."""
    starts, ends = flat.start_indices[first:], flat.end_indices[first:]
    out = torch.full((len(starts), vocab), float("-inf"))
    if not starts:
        return out
    lo, hi = starts[0], ends[-1]
    rows = torch.repeat_interleave(torch.arange(len(starts)), torch.tensor(ends) - torch.tensor(starts))
    out[rows, torch.tensor(flat.token_ids[lo:hi])] = torch.tensor(flat.logprobs[lo:hi], dtype=torch.float32)
    return out


def rank_zero(per_rank: List[dict]) -> dict:
    """What one rank kept. Under tensor parallelism every rank holds the whole residual stream and runs the same
    edits on the same rows, so every rank keeps the same rows: one rank's copy is the answer."""
    return per_rank[0] if per_rank else {}
