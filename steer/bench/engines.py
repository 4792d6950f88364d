"""How each configuration starts its engine and runs one pass of a cell (GPU only: vLLM, nnsight).

A configuration's runner, `RUNNERS[config](cfg, m, where, group)`, starts the engine and returns
`run(prompts, scenario, tokens)`: one `generate` of the whole batch, every request exactly `tokens` new tokens
(ignore_eos, not detokenized), handing back how many it produced (None where the engine does not say); steer's
runners also have `run.profile()`, the taps' host time since the last call (STEER_PROFILE=1). The engines of a,
b, d, e and i get the settings steer's engine gets in c, f, g and h (`vllm_conf`); beyond steering, a differs
from the others in its model runner (vLLM's default, V2; steer's worker hooks V1), which i does not.
steer/bench/runs.py times the passes.
"""

import os
from dataclasses import replace
from pathlib import Path
from typing import Dict

import torch

from steer.bench import peers, workload
from steer.bench.schema import BenchConf, BenchModelConf


def machine() -> Dict:
    """The GPU and the versions a run measured."""
    import vllm

    import nnsight

    return {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "vllm": vllm.__version__,
            "nnsight": getattr(nnsight, "__version__", "?")}


def llm_kwargs(cfg: BenchConf, m: BenchModelConf, where: Path) -> Dict:
    """vllm.LLM's arguments for configurations a, b, d and e: the settings steer's engine gets in c, f and g."""
    from vllm.config import CompilationConfig

    from steer.engine.vllm import compilation_config

    v = vllm_conf(cfg, m, where)
    return dict(dtype=m.dtype, load_format=v.load_format, gpu_memory_utilization=v.gpu_memory_utilization,
                kv_cache_memory_bytes=v.kv_cache_memory_bytes, max_model_len=v.max_model_len,
                max_num_seqs=v.max_num_seqs, enable_prefix_caching=False, seed=cfg.seed,
                tensor_parallel_size=v.tensor_parallel_size,
                compilation_config=CompilationConfig(**compilation_config(v)))


def vllm_conf(cfg: BenchConf, m: BenchModelConf, where: Path, in_graph: bool = False, tap_graphs: bool = False,
              compiled: bool = False, fold: bool = False):
    """The engine settings every configuration shares (the graph ones too: the same steps get a graph)."""
    from steer.config.schema import VllmConf

    sizes = sorted(set(cfg.capture_sizes or [r for r, _ in cfg.batches]))
    biggest = max(r for r, _ in cfg.batches)
    return VllmConf(gpu_memory_utilization=cfg.gpu_memory_utilization,
                    kv_cache_memory_bytes=workload.kv_cache_bytes(cfg, where, m.dtype),
                    max_model_len=cfg.max_model_len, max_num_seqs=biggest, load_format=m.load_format,
                    max_cudagraph_capture_size=max(sizes), cudagraph_capture_sizes=sizes,
                    tensor_parallel_size=cfg.tensor_parallel_size, edits_in_graph=in_graph, tap_graphs=tap_graphs,
                    compiled_edits=compiled, fold_norm=fold)


def _token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def _count(outs) -> int:
    return sum(len(o.outputs[0].token_ids) for o in outs)


def plain_env(breakable: bool, v1: bool = False) -> None:
    """Set this (engine) process's vLLM pipeline for a plain engine: breakable CUDA graphs (b) or vLLM's default
    (a), on the V1 model runner where `breakable` or `v1` (i)."""
    # Each engine runs in a process of its own: these settings are its alone. Set both ways, so that a variable
    # exported in the shell cannot turn a into b.
    os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1" if breakable else "0"
    if breakable or v1:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # the runner steer's worker hooks: b is c's baseline, i is h's
    else:
        os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)  # vLLM's own choice


def _plain(cfg, m, where, group, breakable: bool, v1: bool = False):
    plain_env(breakable, v1)
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(where), **llm_kwargs(cfg, m, where))

    def run(prompts, scen, tokens):
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        return _count(llm.generate(_token_prompts(prompts), params, use_tqdm=False))

    return run


def _steer(cfg, m, where, group, in_graph: bool = False, tap_graphs: bool = False, compiled: bool = False,
           fold: bool = False):
    from steer.engine.vllm import VLLMEngine
    from steer.edits.plan import Plan
    from steer.edits.tap import Tap

    spec = workload.spec(m, "bench", where)
    layers = group.layers
    taps = [Tap(f"layer{i}", spec.layer_path(i), True) for i in layers]
    by_layer = {i: t for i, t in zip(layers, taps)}
    plans: Dict[tuple, tuple] = {}  # (id(edit), layers) -> (edit, plan): holding the edit keeps its id unique

    def plan(edit, at, read=None):
        key = (id(edit), tuple(at))
        if key not in plans:
            p = Plan()
            e = edit if edit.when is None else replace(edit, when=replace(edit.when, path=by_layer[read].path))
            for i in at:
                p.add(by_layer[i], e)
            plans[key] = (edit, p)
        return plans[key][1]

    engine = VLLMEngine(spec, vllm_conf(cfg, m, where, in_graph, tap_graphs, compiled, fold), taps,
                        declared(cfg, spec, group, plan) if in_graph or compiled else ())

    def run(prompts, scen, tokens):
        plans_ = [plan(e, scen.layers, scen.read) for e in scen.edits] if scen else [None] * len(prompts)
        return sum(map(len, engine.generate_tokens(prompts, plans_, tokens, ignore_eos=True, detokenize=False)))

    run.profile = engine.host_profile
    return run


def declared(cfg, spec, group, plan) -> list:
    """Every plan the group's cells will send (a scenario's edits do not depend on the batch size beyond which
    request gets which, so the largest batch's requests name them all)."""
    out = []
    for cell in group.cells:
        if cell["scenario"] != "unsteered":
            scen = workload.scenario(cell["scenario"], spec.hidden, spec.layers, cell["requests"], cfg.seed,
                                     cfg.epsilon, cfg.k_kinds)
            out += [plan(e, scen.layers, scen.read) for e in scen.edits]
    return out


def _nnsight(cfg, m, where, group, taps: bool):
    import interleaver  # noqa: F401  (first: it loads anyio's modules before nnsight mounts `.save`)
    from nnsight.modeling.vllm import VLLM

    from steer.bench.trace import generate

    k = llm_kwargs(cfg, m, where)
    if not taps:
        k.pop("compilation_config")
    model = VLLM(str(where), dispatch=True, taps=[f"model.layers.{i}.output" for i in group.layers] if taps else (),
                 **k)

    def run(prompts, scen, tokens):
        generate(model, prompts, scen.edits if scen else [None] * len(prompts), scen.layers if scen else [], tokens,
                 getattr(torch, m.dtype))
        return None  # nnsight hands back no token counts without saving them; ignore_eos fixes the count

    return run


def peer_algorithms(cfg, spec, group) -> list:
    """The EasySteer algorithms the group's cells use, its declaration of its workload: its graph kernel is built with
    the families of these alone, as a user declares what their requests use (an undeclared one would cost every
    step)."""
    return sorted({peers.algorithm(e) for cell in group.cells for e in workload.scenario(
        cell["scenario"], spec.hidden, spec.layers, cell["requests"], cfg.seed, cfg.epsilon, cfg.k_kinds).edits})


def _easysteer(cfg, m, where, group):
    plain_env(breakable=False)  # vLLM's default pipeline, as a (EasySteer's own benchmark runs it so)
    algorithms = peer_algorithms(cfg, workload.spec(m, group.model, where), group)
    return peers.easysteer(cfg, lambda: llm_kwargs(cfg, m, where), str(where), algorithms)


RUNNERS = {
    "a": lambda cfg, m, w, group: _plain(cfg, m, w, group, breakable=False),
    "b": lambda cfg, m, w, group: _plain(cfg, m, w, group, breakable=True),
    "b2": lambda cfg, m, w, group: _plain(cfg, m, w, group, breakable=True),
    "i": lambda cfg, m, w, group: _plain(cfg, m, w, group, breakable=False, v1=True),
    "c": _steer,
    "d": lambda cfg, m, w, group: _nnsight(cfg, m, w, group, taps=True),
    "e": lambda cfg, m, w, group: _nnsight(cfg, m, w, group, taps=False),
    "f": lambda cfg, m, w, group: _steer(cfg, m, w, group, in_graph=True),
    "g": lambda cfg, m, w, group: _steer(cfg, m, w, group, tap_graphs=True),
    "h": lambda cfg, m, w, group: _steer(cfg, m, w, group, compiled=True),
    "j": lambda cfg, m, w, group: _steer(cfg, m, w, group, in_graph=True, fold=True),
    "easysteer": _easysteer,
}
