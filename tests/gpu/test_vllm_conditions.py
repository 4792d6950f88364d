"""Conditions (edit.when) and position selectors (edit.positions) on the vLLM engine, in every mode (replay,
edits in the graph, compiled), against each request run alone and against the HF engine, on the tiny model
(float32). The condition reads the stream after decoder layer 1; the gated edit adds at layer 2.

The prompts' condition scores are computed here from transformers' own hidden states (an independent reading), and
the threshold put between them so that half the prompts meet it."""

import os

import pytest
import torch

from gpu_common import GEN, LOGPROB_ATOL, PROMPTS, vllm_engine
from helpers import plan
from steer.config.schema import EditKind, TapConf, Tokens
from steer.edits.condition import Condition
from steer.edits.edit import compile_edit
from interleaver.select import Positions
from steer.edits.plan import Plan
from steer.edits.tap import resolve

pytestmark = pytest.mark.gpu

MORE = ["The music in the hall was", "Yesterday the children ran", "In the quiet of the night I"]
ALL = PROMPTS + MORE


def _hidden(hf, ids, layer):
    """The stream after decoder `layer` for prompt `ids`, from transformers' hidden states (float32)."""
    with torch.no_grad():
        out = hf.model(torch.tensor([ids], device="cuda"), output_hidden_states=True)
    return out.hidden_states[layer + 1][0].float()


@pytest.fixture(scope="module")
def conditioned(hf, tiny_spec, direction):
    """(plans, jobs, met): every prompt under one `cast` condition at layer 1 whose threshold half of them meet,
    the add at layer 2, 16 new tokens."""
    from interleaver.select import score

    tap = resolve(TapConf(layer=1), tiny_spec)
    v = direction[0].float()
    ids = [hf.encode(p) for p in ALL]
    scores = [float(score(_hidden(hf, i, 1).mean(0, keepdim=True), v.cuda(), "cast")[0]) for i in ids]
    ranked = sorted(scores)
    threshold = (ranked[2] + ranked[3]) / 2
    assert ranked[3] - ranked[2] > 1e-4, ranked  # no prompt sits on the threshold
    cond = Condition(tap.path, v, reduce="mean", score="cast", compare="above", threshold=threshold)
    p = plan(tiny_spec, 2, compile_edit(EditKind.add, 6.0, direction, when=cond))
    met = [s > threshold for s in scores]
    return p, [(i, p, 0) for i in ids], met


@pytest.fixture(scope="module")
def engines(tiny_spec, taps, conditioned):
    """The three modes' engines, each started once for this module."""
    p = conditioned[0]
    made = {"replay": vllm_engine(tiny_spec, taps),
            "in_graph": vllm_engine(tiny_spec, taps, [p], edits_in_graph=True)}
    yield made
    for e in made.values():
        e.close()


def test_a_mixed_batch_under_a_condition_equals_each_request_alone_and_the_hf_engine(engines, hf, conditioned):
    p, jobs, met = conditioned
    assert sum(met) == 3
    want = [hf.generate(i, p, GEN, 0) for i, _, _ in jobs]
    base = [hf.generate(i, None, GEN, 0) for i, _, _ in jobs]
    assert [w != b for w, b in zip(want, base)] == met  # the condition decides which prompts are steered
    for name, engine in engines.items():
        together = engine.generate_many(jobs, GEN)
        assert together == want, name
        assert [engine.generate_many([j], GEN)[0] for j in jobs] == together, name
        # beside unconditioned and unsteered requests, in one batch
        mixed = [jobs[0], (jobs[1][0], None, 0), jobs[2], jobs[3]]
        assert engine.generate_many(mixed, GEN) == [want[0], base[1], want[2], want[3]], name


def test_a_compiled_engine_decides_as_the_others(tiny_spec, taps, conditioned, hf):
    p, jobs, _ = conditioned
    compiled = vllm_engine(tiny_spec, taps, [p], compiled_edits=True)
    try:
        assert compiled.generate_many(jobs, GEN) == [hf.generate(i, p, GEN, 0) for i, _, _ in jobs]
    finally:
        compiled.close()
        os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1"  # this module's other engines rely on the setting


@pytest.mark.parametrize("threshold,same_as", [(-1.0, "steered"), (1.0, "baseline")])
def test_cosine_thresholds_at_the_ends_are_always_and_never(engines, tiny_spec, direction, hf, threshold, same_as):
    tap = resolve(TapConf(layer=1), tiny_spec)
    cond = Condition(tap.path, direction[0].float(), reduce="mean", score="cosine", compare="above",
                     threshold=threshold)
    gated = plan(tiny_spec, 2, compile_edit(EditKind.add, 6.0, direction, when=cond))
    always = plan(tiny_spec, 2, compile_edit(EditKind.add, 6.0, direction))
    ids = [hf.encode(x) for x in ALL]
    engine = engines["replay"]
    got = engine.generate_many([(i, gated, 0) for i in ids], GEN)
    want = engine.generate_many([(i, always if same_as == "steered" else None, 0) for i in ids], GEN)
    assert got == want


SELECTORS = {"last_prompt": Positions("last_prompt", count=2), "first_generated": Positions("first_generated", count=3),
             "window": Positions("window", start=2, end=9)}


def _placed(tiny_spec, direction, where: Positions, tokens=Tokens.both) -> Plan:
    return plan(tiny_spec, 2, compile_edit(EditKind.add, 8.0, direction, tokens=tokens, positions=where))


def test_each_position_selector_equals_the_hf_engine_in_a_mixed_batch_in_every_mode(engines, tiny_spec, taps,
                                                                                    direction, hf):
    ids = [hf.encode(x) for x in ALL]  # prompts of different lengths
    plans = [_placed(tiny_spec, direction, w) for w in SELECTORS.values()]
    jobs = [(i, plans[k % len(plans)], 0) for k, i in enumerate(ids)]
    want = [hf.generate(i, p, GEN, 0) for i, p, _ in jobs]
    assert any(w != hf.generate(i, None, GEN, 0) for w, (i, _, _) in zip(want, jobs))
    assert engines["replay"].generate_many(jobs, GEN) == want
    # engines whose edits are captured into the graphs serve the plans declared at their start
    for kw in ({"edits_in_graph": True}, {"compiled_edits": True}):
        captured = vllm_engine(tiny_spec, taps, plans, **kw)
        try:
            assert captured.generate_many(jobs, GEN) == want, kw
        finally:
            captured.close()
            os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1"  # this module's other engines rely on the setting


def test_positions_and_a_condition_under_chunked_prefill_equal_the_hf_engine(tiny_spec, taps, direction, hf,
                                                                           conditioned):
    """A prompt longer than a step (prefilled in chunks of 32 tokens): a window across its second and third chunks,
    the last prompt rows, and the condition (the mean over every chunk, its decision made when the last chunk has
    run; the edit on generated rows), each as the HF engine, which runs the prompt in one pass."""
    text = "The weather today is wonderful and bright, and we smiled. " * 8
    long = hf.encode(text)[:100]
    cond = conditioned[0].conditions()[0]
    flipped = Condition(cond.path, cond.vector, cond.reduce, cond.score, "below", cond.threshold)
    plans = [_placed(tiny_spec, direction, Positions("window", start=40, end=70)),
             _placed(tiny_spec, direction, Positions("last_prompt", count=5))]
    # the same condition both ways round: the long prompt meets exactly one of them
    plans += [plan(tiny_spec, 2, compile_edit(EditKind.add, 6.0, direction, tokens=Tokens.generated, when=c))
              for c in (cond, flipped)]
    chunked = vllm_engine(tiny_spec, taps, max_num_batched_tokens=32, max_num_seqs=4)
    try:
        got = [chunked.generate(long, p, GEN, 0) for p in plans]
        assert got == [hf.generate(long, p, GEN, 0) for p in plans]
        assert got[2] != got[3]  # one steered, one not
    finally:
        chunked.close()


def test_a_reading_under_a_condition_equals_the_hf_engines(engines, tiny_spec, direction, hf, conditioned):
    """A teacher-forced reading (score_many) reads prompt and continuation as one prompt. With a gated edit at the
    condition's own tap (layer 1) and one after it (layer 2), the continuation's tokens read the prompt's decision
    at both, as generated tokens do: vLLM's log-probs equal the HF engine's (which decides the prompt first) up to
    the two engines' own rounding, for prompts that meet the condition and prompts that do not."""
    p, jobs, met = conditioned
    cond = p.conditions()[0]
    both = plan(tiny_spec, 1, compile_edit(EditKind.add, 6.0, direction, when=cond))
    both.add(resolve(TapConf(layer=2), tiny_spec), compile_edit(EditKind.add, 6.0, direction, when=cond))
    reads = [(i, hf.generate(i, both, GEN, 0), both, ()) for i, _, _ in jobs]
    got, want = engines["replay"].score_many(reads), hf.score_many(reads)
    plain = [(i, c, None, ()) for i, c, _, _ in reads]
    got_plain, want_plain = engines["replay"].score_many(plain), hf.score_many(plain)

    def apart(a, b, n):  # the largest log-prob difference on the prompt's rows and on the continuation's
        d = (a.logprobs.cpu() - b.logprobs.cpu()).abs()
        return round(float(d[:n].max()), 4), round(float(d[n:].max()), 4)

    # Each prompt: met, then (prompt rows, continuation rows) of vLLM against HF, of the two unsteered readings,
    # of vLLM against its unsteered reading and of HF against its own: a failure says which side edits where
    table = [(m, apart(g, w, len(r[0])), apart(gp, wp, len(r[0])), apart(g, gp, len(r[0])), apart(w, wp, len(r[0])))
             for g, w, gp, wp, m, r in zip(got, want, got_plain, want_plain, met, reads)]
    assert all(g.logprobs.shape == w.logprobs.shape for g, w in zip(got, want))
    # Every row is compared over the whole vocabulary, whose log-probs reach -20 on this model, and the engines'
    # float32 kernels round apart in proportion: steered, they part by no more than they do unsteered (doubled),
    # or LOGPROB_ATOL
    assert all(s <= max(LOGPROB_ATOL, 2 * u) for t in table for s, u in zip(t[1], t[2])), table
    # vLLM's own continuation is edited exactly where the prompt met the condition
    assert all((t[3][1] > 0.05) == t[0] for t in table), table
    # the continuation under the condition's own tap is edited where the prompt met it: not as read undecided
    undecided = plan(tiny_spec, 2, compile_edit(EditKind.add, 6.0, direction, when=cond))
    for (ids, cont, _, _), w, m in zip(reads, want, met):
        moved = (w.logprobs - hf.score(ids, cont, undecided).logprobs)[len(ids):].abs().max()
        assert (float(moved) > 0.05) == m, (m, float(moved))
