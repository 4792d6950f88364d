"""One engine interface: both engines are `Engine`s, score into `Scores` (log-probs and tap values), and close."""

import inspect
from types import SimpleNamespace

import pytest
import torch

from interleaver import EditBank, EditKind, Edit, TapProgram
from steer.engine import Engine, Scores
from steer.engine.hf import HFEngine
from steer.config.schema import GenConf

PROMPT = "When I opened the letter, I felt"


def _members():
    """What the protocol names: its methods and properties, and the attributes it annotates."""
    names = {n for n, v in vars(Engine).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return names | set(Engine.__annotations__) | {"__enter__", "__exit__"}


def test_both_engines_offer_every_member_of_the_protocol(hf_engine):
    from steer.engine.vllm import VLLMEngine  # imports without vLLM: the engine starts it, not the module

    assert isinstance(hf_engine, Engine) and Engine in VLLMEngine.__mro__
    assert {"generate", "generate_many", "score", "score_many", "close", "max_len", "vocab_size"} <= _members()
    for name in _members():
        assert hasattr(hf_engine, name), name
        assert hasattr(VLLMEngine, name) or name in ("name", "spec", "tokenizer", "stop_ids"), name
    for name in ("generate", "generate_many", "score", "score_many"):  # the same parameters, in the same order
        assert list(inspect.signature(getattr(VLLMEngine, name)).parameters) == list(
            inspect.signature(getattr(HFEngine, name)).parameters), name


def test_hf_scores_are_the_float32_log_softmax_of_its_logits(hf_engine):
    ids, cont = hf_engine.encode(PROMPT), hf_engine.encode(" sad and tired")[1:]
    got = hf_engine.score(ids, cont, None, ("model.layers.1",))
    assert isinstance(got, Scores) and set(got.captured) == {"model.layers.1"}
    with torch.no_grad():
        logits = hf_engine.model(torch.tensor([ids + cont])).logits[0].float()
    n, vocab = len(ids) + len(cont), hf_engine.vocab_size
    assert got.logprobs.shape == (n, vocab) and got.logprobs.dtype == torch.float32
    assert got.captured["model.layers.1"].shape == (n, hf_engine.spec.hidden)
    # Exactly what a caller computed from the logits the engine used to return.
    assert torch.equal(got.logprobs, torch.log_softmax(logits, -1))
    torch.testing.assert_close(got.logprobs.exp().sum(-1), torch.ones(n))
    lp, captured = got  # a tuple too
    assert lp is got.logprobs and captured is got.captured
    assert [s.logprobs.shape for s in hf_engine.score_many([(ids, cont, None, ()), (ids, [], None, ())])] == [
        (n, vocab), (len(ids), vocab)]


def test_hf_engine_closes_as_a_context_manager(tiny_spec):
    with HFEngine(tiny_spec) as engine:
        assert engine.generate(engine.encode(PROMPT), None, GenConf(max_new_tokens=3), 0)
    assert engine.model is None
    engine.close()  # twice: nothing more to do


def test_vllm_engine_close_shuts_its_engine_core_down_once():
    from steer.engine.vllm import VLLMEngine

    stopped = []
    engine = object.__new__(VLLMEngine)  # no GPU here: an engine around a stand-in LLM
    engine.llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(
        shutdown=lambda: stopped.append(True))))
    with engine:
        pass
    assert stopped == [True] and engine.llm is None
    engine.close()
    assert stopped == [True]


def test_a_program_runs_in_the_form_asked_and_only_in_one_it_has():
    bank = EditBank()
    bank.register("t", [Edit(EditKind.add, torch.ones(1, 4))])
    program = TapProgram("t", bank.at("t"), False)
    assert not program.fused  # no CUDA here: the torch form only
    h = torch.zeros(2, 4)
    with program.form("torch"):
        program.in_graph(h, torch.ones(2, 1))
    assert torch.equal(h, torch.ones(2, 4)) and program.ran == {"fused": 0, "torch": 1}
    for form, why in (("fused", "no fused kernel"), ("direct", "no fused kernel"), ("jit", "no fused kernel"),
                      ("cuda", "expected one of")):
        with pytest.raises(ValueError, match=why):
            with program.form(form):
                pass
