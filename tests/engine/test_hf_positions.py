"""`edit.positions` on the HF engine, on the tiny model: each selector generates what a plain greedy loop generates
with a forward hook adding the vector at exactly the selected positions (the whole sequence recomputed each step, no
cache), and a mixed batch of prompts of different lengths generates what each does alone."""

import pytest
import torch

from helpers import plan as plan_of
from steer.config.schema import EditKind, GenConf, Tokens
from steer.edits.edit import compile_edit
from interleaver.select import Positions

PROMPTS = ["When I opened the letter, I felt", "The", "Tell me about the weather in the mountains today",
           "My favourite food is"]
NEW = 8
SELECTORS = [Positions("last_prompt", count=1), Positions("last_prompt", count=3),
             Positions("first_generated", count=1), Positions("first_generated", count=4),
             Positions("window", start=2, end=9)]


def reference(engine, ids, v, layer, selected):
    """Greedy tokens with `v` added after decoder `layer` at the positions `selected(pos, plen)` picks."""
    model = engine.model
    seq = list(ids)

    def hook(module, args, out):
        h = out[0] if isinstance(out, tuple) else out
        pos = torch.arange(h.shape[1])
        m = selected(pos, len(ids)).float()[None, :, None]
        h.add_(m * v)

    handle = model.model.layers[layer].register_forward_hook(hook)
    try:
        for _ in range(NEW):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
            tok = int(logits.argmax())
            if tok in engine.stop_ids:
                break
            seq.append(tok)
    finally:
        handle.remove()
    return seq[len(ids):]


@pytest.mark.parametrize("where", SELECTORS, ids=lambda p: f"{p.select}-{p.count}-{p.start}")
def test_each_selector_edits_exactly_its_positions(batched, tiny_spec, where):
    torch.manual_seed(3)
    v = 8.0 * torch.randn(tiny_spec.hidden)
    plan = plan_of(tiny_spec, 1, compile_edit(EditKind.add, 1.0, v[None], positions=where))
    ids = [batched.encode(p) for p in PROMPTS]
    want = [reference(batched, x, v, 1, lambda pos, plen: where.mask(pos, torch.tensor(plen))) for x in ids]
    gen = GenConf(max_new_tokens=NEW)
    assert [batched.generate(x, plan, gen, 0) for x in ids] == want
    mixed = [(x, plan, 0) for x in ids] + [(x, None, 0) for x in ids[:2]]
    assert batched.generate_many(mixed, gen)[: len(ids)] == want
    plain = [batched.generate(x, None, gen, 0) for x in ids]
    assert want != plain  # the selected positions do change the text


def test_positions_and_tokens_select_together(batched, tiny_spec):
    """A window over prompt and generated rows with tokens=generated edits the window's generated rows only."""
    torch.manual_seed(4)
    v = 8.0 * torch.randn(tiny_spec.hidden)
    where = Positions("window", start=3, end=12)
    plan = plan_of(tiny_spec, 2, compile_edit(EditKind.add, 1.0, v[None], positions=where,
                                              tokens=Tokens.generated))
    ids = [batched.encode(p) for p in PROMPTS]
    want = [reference(batched, x, v, 2, lambda pos, plen: where.mask(pos, torch.tensor(plen)) & (pos >= plen))
            for x in ids]
    assert batched.generate_many([(x, plan, 0) for x in ids], GenConf(max_new_tokens=NEW)) == want


def test_scores_under_positions_in_a_batch_equal_each_alone(batched, tiny_spec):
    torch.manual_seed(5)
    v = 8.0 * torch.randn(1, tiny_spec.hidden)
    plans = [plan_of(tiny_spec, 1, compile_edit(EditKind.add, 1.0, v, positions=p)) for p in SELECTORS]
    cont = batched.encode(" and then the rain came down")[1:6]
    ids = [batched.encode(p) for p in PROMPTS]
    jobs = [(ids[i % len(ids)], cont, plan, ("model.layers.1",)) for i, plan in enumerate(plans)]
    for job, s in zip(jobs, batched.score_many(jobs)):
        ref = batched.score(*job)
        torch.testing.assert_close(s.logprobs, ref.logprobs, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(s.captured["model.layers.1"], ref.captured["model.layers.1"], atol=1e-4,
                                   rtol=1e-4)
