"""The HF engine's hooks against direct computations on the tiny model."""

import torch

from helpers import plan as plan_of
from steer.edits.edit import compile_edit
from steer.config.schema import EditKind, GenConf, Tokens

PROMPT = "When I opened the letter, I felt"


def test_tap_value_is_the_residual_stream(hf_engine, tiny_spec):
    ids = hf_engine.encode(PROMPT)
    cap = hf_engine.score(ids, [], None, capture=("model.layers.1",)).captured
    with torch.no_grad():
        hs = hf_engine.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(cap["model.layers.1"], hs[2][0])  # hidden_states[i + 1]: after layer i


def test_edit_lands_at_the_tap(hf_engine, tiny_spec):
    v = torch.randn(1, tiny_spec.hidden)
    ids = hf_engine.encode(PROMPT)
    cont = hf_engine.encode(" sad and tired")[1:]
    base = hf_engine.score(ids, cont, None, capture=("model.layers.1",)).captured
    for tokens, rows in [(Tokens.both, slice(None)), (Tokens.prompt, slice(0, len(ids))),
                         (Tokens.generated, slice(len(ids), None))]:
        edit = compile_edit(EditKind.add, 3.0, v, tokens=tokens)
        got = hf_engine.score(ids, cont, plan_of(tiny_spec, 1, edit), capture=("model.layers.1",)).captured
        expected = base["model.layers.1"].clone()
        expected[rows] += 3.0 * v[0]
        torch.testing.assert_close(got["model.layers.1"], expected)


def test_ablation_at_the_tap_is_exact_and_downstream_changes(hf_engine, tiny_spec):
    v = torch.randn(1, tiny_spec.hidden)
    edit = compile_edit(EditKind.ablate, 1.0, v)
    ids = hf_engine.encode(PROMPT)
    lp0, base = hf_engine.score(ids, [], None, capture=("model.layers.2", "model.layers.3"))
    lp1, got = hf_engine.score(ids, [], plan_of(tiny_spec, 2, edit), capture=("model.layers.2", "model.layers.3"))
    d = edit.basis[0]
    assert got["model.layers.2"].matmul(d).abs().max() < 1e-4
    h = base["model.layers.2"]
    torch.testing.assert_close(got["model.layers.2"], h - (h @ d)[:, None] * d, atol=1e-4, rtol=1e-5)
    assert not torch.allclose(lp0, lp1)


def test_generation_agrees_with_teacher_forcing(hf_engine, tiny_spec):
    """Greedy tokens under a generated-only edit are the argmax of the scoring pass with the same edit:
    generation (KV cache, one row a step) and scoring (one pass) mark prompt and generated rows alike."""
    edit = compile_edit(EditKind.add, 6.0, torch.randn(1, tiny_spec.hidden), tokens=Tokens.generated)
    plan = plan_of(tiny_spec, 1, edit)
    ids = hf_engine.encode(PROMPT)
    out = hf_engine.generate(ids, plan, GenConf(max_new_tokens=12), seed=0)
    assert len(out) > 0
    lp = hf_engine.score(ids, out, plan).logprobs
    assert lp[len(ids) - 1 : len(ids) - 1 + len(out)].argmax(-1).tolist() == out


def test_sampling_is_seeded(hf_engine):
    ids = hf_engine.encode(PROMPT)
    g = GenConf(max_new_tokens=10, temperature=1.0, top_p=0.9)
    assert hf_engine.generate(ids, None, g, seed=5) == hf_engine.generate(ids, None, g, seed=5)
    # and it does sample: other seeds pick other tokens (an engine that ignored the temperature would not)
    assert len({tuple(hf_engine.generate(ids, None, g, seed=s)) for s in range(5)}) > 1
