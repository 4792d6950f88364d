"""The vLLM engine's host-side helpers, on CPU (the engine itself runs in tests/gpu)."""

import json
import os
import sys
from types import SimpleNamespace

import torch

from interleaver.clock import Clock
from steer.engine import vllm as vllm_engine
from steer.engine.vllm import _dense, rank_zero, set_environment
from steer.config.schema import VllmConf


def bare_engine(monkeypatch, taps, rpc, **llm):
    """A VLLMEngine with nothing of vLLM behind it: SamplingParams a dict of its fields, every collective_rpc handed
    to `rpc(name, args)`, `llm` more of the LLM's attributes, and `taps` its taps."""
    from interleaver.bank import EditBank
    from steer.engine.vllm import VLLMEngine

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: kw))
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.bank, engine.taps, engine.in_graph, engine.stop_ids = EditBank(), {t.path: t for t in taps}, False, {0}
    engine._pushed = engine._pushed_conditions = engine._keys = 0
    engine._clock = Clock()
    engine.llm = SimpleNamespace(collective_rpc=rpc, **llm)
    return engine


def test_flat_logprobs_become_dense_rows():
    # vLLM's FlatLogprobs: position 0 of a prompt has none; a position lists the scored token first, then every
    # token by rank (so the scored one twice).
    flat = SimpleNamespace(start_indices=[0, 0, 4], end_indices=[0, 4, 8],
                           token_ids=[2, 0, 1, 2, 1, 0, 1, 2],
                           logprobs=[-0.5, -1.5, -2.0, -0.5, -0.1, -3.0, -0.1, -4.0])
    out = _dense(flat, 1, 4)
    inf = float("-inf")
    torch.testing.assert_close(out, torch.tensor([[-1.5, -2.0, -0.5, inf], [-3.0, -0.1, -4.0, inf]]))
    assert _dense(flat, 3, 4).shape == (0, 4)


def test_rank_zeros_captures_stand_for_all():
    ranks = [{"model.layers.1.output": {"k": [[[float(r), 2.0]]]}} for r in range(3)]
    assert rank_zero(ranks) == ranks[0] and rank_zero(ranks[::-1]) == ranks[2] and rank_zero([]) == {}


def test_requests_sharing_a_plan_share_its_entries(monkeypatch):
    """sampling_params registers a plan once however many requests carry it (registering hashes every edit's
    vectors: per request it was the bench's host cost before each batch), and every request gets the entries it
    would get alone."""
    from steer.bench import workload
    from steer.engine.vllm import VLLMEngine
    from steer.edits.plan import Plan
    from steer.edits.tap import Tap

    ablate, add = (workload.scenario(name, 16, 4, 1, 0).edits[0] for name in ("ablate_all", "add"))
    taps = [Tap(f"layer{i}", f"model.layers.{i}", True) for i in range(4)]
    every, one, again = Plan(), Plan(), Plan()
    for t in taps:
        every.add(t, ablate)
    one.add(taps[2], add)
    again.add(taps[2], add)
    pushed = []
    engine = bare_engine(monkeypatch, taps, lambda name, args: pushed.append(args[0]))
    registered = []
    monkeypatch.setattr(engine, "_edits", lambda plan, f=engine._edits: registered.append(plan) or f(plan))

    plans = [every, None, one, every, again, every]
    params = engine.sampling_params(plans, max_tokens=4)

    assert [id(p) for p in registered] == [id(every), id(one), id(again)]
    alone = VLLMEngine.__new__(VLLMEngine)
    alone.bank, alone.taps = engine.bank, engine.taps
    for plan, p in zip(plans, params):
        assert p["extra_args"] == (None if plan is None else {"steer": alone._edits(plan).to_args()})
    assert len(json.loads(params[0]["extra_args"]["steer"])["entries"]) == 4
    assert params[2]["extra_args"] == params[4]["extra_args"]
    # one string per plan, not one per request: vLLM deep-copies each request's params, and a string copies free
    assert params[0]["extra_args"]["steer"] is params[3]["extra_args"]["steer"] is params[5]["extra_args"]["steer"]
    taken = engine._clock.take()
    assert list(taken) == ["params"] and taken["params"]["calls"] == 1 and taken["params"]["seconds"] > 0
    assert len(pushed) == 1 and len(pushed[0]) == 5  # four ablate stages and one add, shipped once
    # requests of one plan and seed share one SamplingParams (vLLM clones each request's), others have their own
    assert params[0] is params[3] is params[5] and params[2] is not params[4] and params[1] is not params[0]
    seeded = engine.sampling_params([every, every, None, None], [1, 2, 1, 1], max_tokens=4)
    assert seeded[0] is not seeded[1] and seeded[2] is seeded[3]
    assert (seeded[0]["seed"], seeded[1]["seed"], seeded[2]["extra_args"]) == (1, 2, None)


def test_each_engine_has_vllm_read_its_environment_afresh(monkeypatch):
    # An engine core that ran in this process leaves vLLM's environment cached (vllm.envs.enable_envs_cache)
    monkeypatch.setattr(os, "environ", dict(os.environ))  # what set_environment sets stays in this test
    monkeypatch.delitem(sys.modules, "vllm.envs", raising=False)
    set_environment(VllmConf())  # vLLM not imported: nothing cached, nothing to do
    calls = []
    monkeypatch.setitem(sys.modules, "vllm.envs", SimpleNamespace(disable_envs_cache=lambda: calls.append(1)))
    set_environment(VllmConf())
    assert calls == [1] and os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] == "1"


def test_closing_an_engine_empties_the_pinned_host_cache_where_cuda_runs(monkeypatch):
    # A second in-process engine's breakable graph capture trips on the first one's cached pinned blocks
    from steer.engine import vllm as engine_module

    calls = []
    monkeypatch.setattr(engine_module, "shutdown", lambda llm: calls.append("shutdown"))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("synchronize"))
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append("host"), raising=False)
    monkeypatch.setattr(engine_module, "_cores_here", 1)
    engine = engine_module.VLLMEngine.__new__(engine_module.VLLMEngine)
    engine.llm, engine._core_here = object(), True
    engine.close()
    assert calls == ["shutdown", "empty_cache", "synchronize", "host"] and engine.llm is None
    assert engine_module._cores_here == 0  # its core, which ran here, is no longer counted
    engine.close()  # closed: nothing more
    assert len(calls) == 4 and engine_module._cores_here == 0
    monkeypatch.delattr(torch._C, "_host_emptyCache")  # a torch without it: nothing to empty, no error
    engine_module.release_host_cache()
    assert calls[4:] == ["synchronize"]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # no CUDA here: nothing at all
    engine_module.release_host_cache()
    assert len(calls) == 5


def test_an_engine_empties_the_host_cache_before_it_starts_only_behind_a_core_that_ran_here(monkeypatch):
    """An engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) leaves pinned blocks that trip the next
    capture here: the next engine empties the cache first while one is still counted (running, dropped without
    close, or failed to start), and leaves it as it is where none ran here."""
    from steer.engine import vllm as engine_module

    calls = []
    envs = SimpleNamespace(VLLM_ENABLE_V1_MULTIPROCESSING=True)
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(envs=envs))
    monkeypatch.setitem(sys.modules, "vllm.envs", envs)
    monkeypatch.setattr(engine_module, "release_host_cache", lambda: calls.append("host"))
    monkeypatch.setattr(engine_module, "_cores_here", 0)
    assert engine_module.before_start() is False and calls == []  # a core of its own; none ran here
    envs.VLLM_ENABLE_V1_MULTIPROCESSING = False
    assert engine_module.before_start() is True and calls == []  # the first core here: nothing to empty
    assert engine_module.before_start() is True and calls == ["host"]  # behind one still running here
    engine_module.end_core_here()
    engine_module.end_core_here()
    envs.VLLM_ENABLE_V1_MULTIPROCESSING = True
    assert engine_module.before_start() is False and calls == ["host"]  # both closed
    engine_module.end_core_here()  # a close too many counts nothing below none
    assert engine_module._cores_here == 0


def test_a_reading_under_a_condition_runs_its_prompt_first_and_keeps_the_decision_for_it(monkeypatch):
    """score_many: each job whose plan carries a condition first runs its prompt alone (one token), keeping its
    decisions under a name its reading reads (the tap worker's side: tests/interleaver/test_conditions.py), in
    rounds of at most max_num_seqs jobs (a kept decision and its reading hold two of the worker's 2 * max_num_seqs
    slots), every plan registered before a decision is kept and every kept one dropped after its round. Jobs
    without a condition are read in one pass, as before."""
    from steer.config.schema import EditKind
    from steer.edits.condition import Condition
    from steer.edits.edit import compile_edit
    from steer.edits.plan import Plan
    from steer.edits.tap import Tap

    taps = [Tap(f"layer{i}", f"model.layers.{i}", True) for i in range(3)]
    v = torch.nn.functional.normalize(torch.ones(1, 8), dim=1)
    cond = Condition(taps[1].path, v[0], "mean", "cast", "above", 0.1)
    gated, plain = Plan(), Plan()
    gated.add(taps[1], compile_edit(EditKind.add, 2.0, v, when=cond))
    plain.add(taps[2], compile_edit(EditKind.add, 2.0, v))
    engine = bare_engine(monkeypatch, taps, lambda name, args=(): rpcs.append((name, *args)) or [{}],
                         llm_engine=SimpleNamespace(model_config=SimpleNamespace(get_vocab_size=lambda: 4)))
    engine._readings_at_once = 3
    monkeypatch.setattr(vllm_engine, "_dense", lambda logprobs, skip, vocab: torch.zeros(1, vocab))
    calls, rpcs = [], []
    reply = SimpleNamespace(prompt_logprobs=None, outputs=[SimpleNamespace(logprobs=None)])

    def generate(prompts, params):
        calls.append((prompts, [json.loads(p["extra_args"]["steer"]) if p.get("extra_args") else None
                                for p in params], [p["max_tokens"] for p in params]))
        rpcs.append(("generate",))
        return [reply] * len(prompts)

    monkeypatch.setattr(engine, "_generate", generate)
    jobs = [([1, 2, 3], [4, 5], gated, ()), ([6, 7], [8], plain, ()), ([9, 10], [11], None, ()),
            ([12], [13, 14], gated, ())]
    assert len(engine.score_many(jobs)) == 4
    (first, asked, one), (reading, read, _), (first2, asked2, _), (reading2, read2, _) = calls
    assert first == [[1, 2, 3]] and one == [1] and asked[0]["hold"] == "score-1" and asked[0]["decide"]
    assert reading == [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11]]  # a round of three, conditioned or not
    assert [r and r.get("held") for r in read] == ["score-1", None, None]
    assert [r and r["prompt_len"] for r in read] == [3, 2, None]
    assert "hold" not in read[0] and read[0]["entries"] == asked[0]["entries"]  # the same stages, registered once
    assert first2 == [[12]] and asked2[0]["hold"] == "score-4" and reading2 == [[12, 13, 14]]
    assert read2[0]["held"] == "score-4" and read2[0]["prompt_len"] == 1
    # every plan shipped before the first decision was kept; each round's kept decisions dropped after its reading
    names = [r[0] for r in rpcs]
    assert names[0] == "steer_set_stages" and names.count("steer_set_stages") == 1
    assert [r for r in rpcs if r[0] == "steer_drop_held"] == [("steer_drop_held", ["score-1"]),
                                                              ("steer_drop_held", ["score-4"])]
    assert names.index("steer_drop_held") > names.index("steer_take_kept")
