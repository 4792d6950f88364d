"""The vLLM engine against vLLM eager and the HF engine, on the tiny model's safetensors weights (float32).

Tolerance: greedy tokens must be identical; first-step log-probs within 2e-3 (absolute) of the HF engine's
(vLLM's fp32 kernels and HF's differ in summation order only)."""

import os

import pytest
import torch

from gpu_common import GEN, LOGPROB_ATOL, PROMPTS, edits, vllm_engine
from helpers import plan
from interleaver.vllm_internals import eager_breaks, graphs_captured
from interleaver.tap_worker import folds
from steer.edits.edit import compile_edit
from steer.engine.vllm import set_environment
from steer.config.schema import EditKind, TapConf, VllmConf
from steer.edits.tap import resolve

pytestmark = pytest.mark.gpu

# Graphs are captured for steps of up to this many tokens; a longer step (a long prompt's prefill) runs eagerly.
MAX_GRAPH = 128


@pytest.fixture(scope="module")
def graph(tiny_spec, taps):
    return vllm_engine(tiny_spec, taps, max_cudagraph_capture_size=MAX_GRAPH)


@pytest.fixture(scope="module")
def eager(tiny_spec, taps):
    return vllm_engine(tiny_spec, taps, enforce_eager=True)


@pytest.mark.parametrize("name", ["add", "ablate", "clamp", "set", "rescale", "add_generated"])
def test_edit_graph_equals_eager_and_hf(graph, eager, hf, tiny_spec, direction, name):
    p = plan(tiny_spec, 1, edits(direction)[name])
    ids = [hf.encode(x) for x in PROMPTS]
    jobs = [(i, p, 0) for i in ids]
    g, e = graph.generate_many(jobs, GEN), eager.generate_many(jobs, GEN)
    h = hf.generate_many(jobs, GEN)
    assert g == e, f"{name}: graph replay differs from vLLM eager"
    assert g == h, f"{name}: vLLM differs from the HF engine"
    unsteered = graph.generate_many([(i, None, 0) for i in ids], GEN)
    assert unsteered != g, f"{name}: the edit changed nothing (a test that cannot fail)"
    first_v = graph.score(ids[0], [], p).logprobs[-1]
    first_h = hf.score(ids[0], [], p).logprobs[-1]
    assert (first_v - first_h).abs().max() < LOGPROB_ATOL


def test_mixed_batch_equals_solo_runs(graph, tiny_spec, direction, hf):
    e = edits(direction)
    plans = [plan(tiny_spec, 1, e["add"]), plan(tiny_spec, 2, e["ablate"]), plan(tiny_spec, 1, e["clamp"]), None]
    ids = [hf.encode(x) for x in PROMPTS + ["The music in the hall was"]]
    jobs = [(i, p, 0) for i, p in zip(ids, plans)]
    together = graph.generate_many(jobs, GEN)
    solo = [graph.generate_many([j], GEN)[0] for j in jobs]
    assert together == solo
    assert together[3] == hf.generate(ids[3], None, GEN, 0)  # the unsteered request stayed untouched


def test_scales_share_one_stage_and_differ(graph, tiny_spec, direction, hf):
    ids = hf.encode(PROMPTS[0])
    plans = [plan(tiny_spec, 1, compile_edit(EditKind.add, s, direction)) for s in (0.0, 2.0, 8.0)]
    out = graph.generate_many([(ids, p, 0) for p in plans], GEN)
    assert out[0] == graph.generate(ids, None, GEN, 0)
    assert out[2] == hf.generate(ids, plans[2], GEN, 0) and out[1] != out[2]


def test_long_prompt_eager_step_matches(graph, eager, hf, tiny_spec, direction):
    text = "The weather today is wonderful and bright, and we smiled. " * 60
    ids = hf.encode(text)[:400]
    assert len(ids) > MAX_GRAPH  # longer than the largest captured graph: this prefill runs eagerly
    p = plan(tiny_spec, 1, edits(direction)["ablate"])
    g = graph.generate(ids, p, GEN, 0)
    assert g == eager.generate(ids, p, GEN, 0) == hf.generate(ids, p, GEN, 0)


def test_capture_matches_hf_tap_value(graph, hf, tiny_spec, direction):
    ids, cont = hf.encode(PROMPTS[1]), hf.encode(" sad and tired")[1:]
    p = plan(tiny_spec, 1, edits(direction)["ablate"])
    v_cap = graph.score(ids, cont, p, ("model.layers.1",)).captured
    h_cap = hf.score(ids, cont, p, ("model.layers.1",)).captured
    v, h = v_cap["model.layers.1"], h_cap["model.layers.1"]
    assert v.shape == h.shape
    # The residual stream's rows have norms near 60; fp32 kernels that sum in another order differ by ~1e-4 of that.
    assert float(((v - h).norm(dim=-1) / h.norm(dim=-1)).max()) < 1e-3
    assert (v_cap["model.layers.1"] @ p.edits["model.layers.1"][0].basis[0]).abs().max() < 1e-3


def test_no_taps_records_no_extra_breaks(graph, tiny_spec, taps):
    from vllm import LLM

    plain = LLM(model=tiny_spec.source, dtype="float32", gpu_memory_utilization=0.12, enable_prefix_caching=False,
                compilation_config={"max_cudagraph_capture_size": MAX_GRAPH})
    notaps = vllm_engine(tiny_spec, [], max_cudagraph_capture_size=MAX_GRAPH)
    base = plain.collective_rpc(eager_breaks)[0]
    none = notaps.llm.collective_rpc(eager_breaks)[0]
    tapped = graph.llm.collective_rpc(eager_breaks)[0]
    assert none == base
    assert tapped["graphs"] == base["graphs"] > 0
    assert tapped["eager_breaks"] == base["eager_breaks"] + len(taps) * base["graphs"]


def mixed_batch(tiny_spec, direction, hf):
    """A mixed batch: the edits, six requests' plans (every kind, an unsteered request, a two-tap one) and their
    (prompt ids, plan, seed) jobs."""
    e = edits(direction)
    two = plan(tiny_spec, 1, e["add"])
    two.add(resolve(TapConf(layer=2), tiny_spec), e["clamp"])
    plans = [plan(tiny_spec, 1, e["add"]), plan(tiny_spec, 2, e["ablate"]), None, two,
             plan(tiny_spec, 1, e["add_generated"]), plan(tiny_spec, 1, e["rescale"])]
    prompts = PROMPTS + ["The music in the hall was", "She opened the door and", "We walked along the street"]
    return e, plans, [(hf.encode(x), p, 0) for x, p in zip(prompts, plans)]


def test_edits_in_graph_equal_replay_mode(graph, tiny_spec, taps, direction, hf):
    """The stretch mode: edits captured into the graphs (no eager break) give the replay engine's tokens, for a
    mixed batch with an unsteered request, a two-tap request and a prompt longer than any graph."""
    e, plans, jobs = mixed_batch(tiny_spec, direction, hf)
    in_graph = vllm_engine(tiny_spec, taps, [p for p in plans if p], max_cudagraph_capture_size=MAX_GRAPH,
                           edits_in_graph=True)
    replayed, captured = (engine.llm.collective_rpc(eager_breaks)[0] for engine in (graph, in_graph))
    assert captured["graphs"] == replayed["graphs"] > 0
    assert captured["eager_breaks"] == replayed["eager_breaks"] - len(taps) * replayed["graphs"]  # none at taps
    assert in_graph.generate_many(jobs, GEN) == graph.generate_many(jobs, GEN)
    long = hf.encode("The weather today is wonderful and bright, and we smiled. " * 60)[:400]
    assert in_graph.generate(long, plans[1], GEN, 0) == graph.generate(long, plans[1], GEN, 0)
    lp_graph = graph.score(jobs[0][0], [], plans[0]).logprobs
    lp_in = in_graph.score(jobs[0][0], [], plans[0]).logprobs
    torch.testing.assert_close(lp_in[-1], lp_graph[-1], atol=LOGPROB_ATOL, rtol=0)
    with pytest.raises(ValueError, match="was not declared"):
        in_graph.generate(jobs[0][0], plan(tiny_spec, 2, e["add"]), GEN, 0)
    assert in_graph.generate(*jobs[0][:2], GEN, 0) == graph.generate(*jobs[0][:2], GEN, 0)  # still serves


def _equals_replay(engine, graph, hf, plans, jobs) -> None:
    """`engine` gives the replay engine's tokens for the mixed batch and a prompt longer than any graph, and its
    log-probs for a steered and an unsteered request."""
    got, want = engine.generate_many(jobs, GEN), graph.generate_many(jobs, GEN)
    if got != want:  # where they part: each such job here, in the replay engine, alone here, on the HF engine,
        # unsteered here, and here in the whole batch again: which side, and whether only a first batch parts
        again = engine.generate_many(jobs, GEN)
        assert got == want, [(k, g, w, engine.generate(*jobs[k][:2], GEN, 0), hf.generate(*jobs[k][:2], GEN, 0),
                              engine.generate(jobs[k][0], None, GEN, 0), again[k])
                             for k, (g, w) in enumerate(zip(got, want)) if g != w]
    long = hf.encode("The weather today is wonderful and bright, and we smiled. " * 60)[:400]
    assert engine.generate(long, plans[1], GEN, 0) == graph.generate(long, plans[1], GEN, 0)
    for p in (plans[0], None):
        lp_graph = graph.score(jobs[0][0], [], p).logprobs
        torch.testing.assert_close(engine.score(jobs[0][0], [], p).logprobs[-1], lp_graph[-1],
                                   atol=LOGPROB_ATOL, rtol=0)


def test_edits_folded_into_the_next_norm_equal_replay_mode(graph, tiny_spec, taps, direction, hf):
    """vllm.fold_norm: each tap's edits run inside the next layer's residual add and RMSNorm (one kernel, captured)
    and give the replay engine's tokens and log-probs for the mixed batch and a prompt longer than any graph (an
    eager step, unfolded)."""
    _, plans, jobs = mixed_batch(tiny_spec, direction, hf)
    folded = vllm_engine(tiny_spec, taps, [p for p in plans if p], max_cudagraph_capture_size=MAX_GRAPH,
                         edits_in_graph=True, fold_norm=True)
    try:
        got = folded.llm.collective_rpc(folds)[0]
        assert sorted(got) == sorted(f"model.{t.path}.output" for t in taps)  # Llama layers: every tap folds
        assert all(n.endswith("input_layernorm") or n.endswith(".norm") for n in got.values())
        _equals_replay(folded, graph, hf, plans, jobs)
    finally:
        folded.close()


def test_compiled_edits_equal_replay_mode(graph, tiny_spec, taps, direction, hf):
    """vllm.compiled_edits: vLLM's own torch.compile and CUDA graphs, each tap one custom op inside them, give the
    replay engine's tokens for the mixed batch and a prompt longer than any graph (a compiled step without one),
    and an unsteered request the replay engine's log-probs."""
    from vllm.config import CompilationMode

    e, plans, jobs = mixed_batch(tiny_spec, direction, hf)
    compiled = vllm_engine(tiny_spec, taps, [p for p in plans if p], max_cudagraph_capture_size=MAX_GRAPH,
                           compiled_edits=True)
    try:
        assert compiled.llm.llm_engine.vllm_config.compilation_config.mode == CompilationMode.VLLM_COMPILE
        assert compiled.llm.collective_rpc(graphs_captured)[0] > 0
        _equals_replay(compiled, graph, hf, plans, jobs)
        with pytest.raises(ValueError, match="was not declared"):
            compiled.generate(jobs[0][0], plan(tiny_spec, 2, e["add"]), GEN, 0)
    finally:
        compiled.close()
        os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1"  # this module's plain LLM relies on the engines' setting


def test_tap_graphs_equal_replay_mode(graph, tiny_spec, taps, direction, hf):
    """vllm.tap_graphs: each tap's program replayed as a graph of its own at the break gives the eager programs'
    tokens (a mixed batch, a long prompt's eager prefill), keeps every break, serves captures eagerly, and takes
    edits registered after its graphs were made."""
    _, plans, jobs = mixed_batch(tiny_spec, direction, hf)
    graphed = vllm_engine(tiny_spec, taps, max_cudagraph_capture_size=MAX_GRAPH, tap_graphs=True)
    replayed, with_graphs = (engine.llm.collective_rpc(eager_breaks)[0] for engine in (graph, graphed))
    assert with_graphs == replayed
    assert graphed.generate_many(jobs, GEN) == graph.generate_many(jobs, GEN)
    assert graphed.generate_many(jobs, GEN) == graph.generate_many(jobs, GEN)  # now from replayed tap graphs
    long = hf.encode("The weather today is wonderful and bright, and we smiled. " * 60)[:400]
    assert graphed.generate(long, plans[1], GEN, 0) == graph.generate(long, plans[1], GEN, 0)
    cont = hf.encode(" and the sky was clear")
    tap = taps[0].path
    lp_graph, kept_graph = graph.score(jobs[0][0], cont, plans[0], capture=(tap,))
    lp_tg, kept_tg = graphed.score(jobs[0][0], cont, plans[0], capture=(tap,))
    torch.testing.assert_close(lp_tg, lp_graph, atol=LOGPROB_ATOL, rtol=0)
    torch.testing.assert_close(kept_tg[tap], kept_graph[tap], atol=1e-2, rtol=1e-2)
    late = plan(tiny_spec, 2, compile_edit(EditKind.add, 5.0, direction))  # new stages: the graphs are remade
    assert graphed.generate(jobs[1][0], late, GEN, 0) == graph.generate(jobs[1][0], late, GEN, 0)
    assert graphed.generate_many(jobs, GEN) == graph.generate_many(jobs, GEN)


@pytest.mark.parametrize("in_graph", [False, True], ids=["replay", "in_graph"])
def test_an_engine_core_in_this_process_equals_one_in_its_own(graph, tiny_spec, taps, direction, hf, monkeypatch,
                                                              in_graph):
    """VLLM_ENABLE_V1_MULTIPROCESSING=0 (the bench's models.<name>.env can set it): vLLM's engine core, and with
    it the tap worker, runs in this process, and steers as the engine core of its own process does."""
    _, plans, jobs = mixed_batch(tiny_spec, direction, hf)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    inline = vllm_engine(tiny_spec, taps, [p for p in plans if p], max_cudagraph_capture_size=MAX_GRAPH,
                         edits_in_graph=in_graph)
    try:
        assert type(inline.llm.llm_engine.engine_core).__name__ == "InprocClient"
        _equals_replay(inline, graph, hf, plans, jobs)
        # While it runs, that engine core holds vLLM's environment cached in this process; an engine started
        # meanwhile (or after this one is dropped without shutdown, which alone clears it) reads it afresh
        import vllm.envs

        assert vllm.envs._is_envs_cache_enabled()
        monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
        set_environment(VllmConf())
        assert vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING is True
    finally:
        inline.close()
