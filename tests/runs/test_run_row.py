"""A steer run's per-prompt metrics, checked against a direct recomputation.

The run (engine=hf on the tiny model, `add` of a vector whose norm is not 1) writes results.jsonl and metrics.json;
here plain transformers in float64, with the edit applied by a forward hook of this file's own, generates both
continuations again and recomputes each metric as docs/metrics.md defines it: KL(steered || unsteered) over the rows
that
predict the steered continuation, each continuation's perplexity under the unsteered model, the concept (signed
projection on the unit direction) of the continuation's rows as the unsteered model reads them, and the projections
|h . d| on every row of prompt + steered continuation, unsteered and steered.
"""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from helpers import TWO_PROMPTS, compose
from steer.runs import run
from steer.tasks import registry

SCALE, NORM, NEW = 4.0, 15.0, 8  # norm 15: a projection on the raw vector, not the unit one, reads 15x


@pytest.fixture(scope="module")
def reference(tiny_spec):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_spec.source, dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def vector(reference, hf_engine):
    """A random direction of norm NORM that, pushed at SCALE, changes the reference's greedy text of some prompt:
    the first of a few seeds that does (the tiny model is trained where the tests run, and which direction moves
    its text at this push differs between CPUs)."""
    prompts = [hf_engine.encode(p) for p in compose(TWO_PROMPTS).prompts.steer]
    stop = stops(reference)
    for seed in range(1, 33):
        v = torch.randn(256, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        v = (v * (NORM / v.norm())).float()
        if any(greedy(reference, ids, stop) != greedy(reference, ids, stop, SCALE * v.double()) for ids in prompts):
            return v
    raise AssertionError(f"no direction of norm {NORM} at scale {SCALE} moves the text of {TWO_PROMPTS}")


def stops(model):
    return {model.config.eos_token_id, model.generation_config.eos_token_id}


def forward(model, ids, push=None):
    """Log-probs [T, vocab] and layer 1's output [T, hidden] for `ids`, with `push` added to that output."""
    seen = []

    def hook(module, args, out):
        h = out[0] if isinstance(out, tuple) else out
        if push is not None:
            h = h + push
        seen.append(h[0].detach())
        return (h, *out[1:]) if isinstance(out, tuple) else h

    handle = model.model.layers[1].register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
    finally:
        handle.remove()
    return torch.log_softmax(logits, -1), seen[0]


def greedy(model, ids, stop, push=None):
    out = []
    for _ in range(NEW):
        tok = int(forward(model, ids + out, push)[0][-1].argmax())
        if tok in stop:
            break
        out.append(tok)
    return out


def close(got, want, what):
    # float32 engine against float64 here: agreement to ~1e-5; the slips this guards against move values by >1%
    assert got == pytest.approx(want, rel=2e-4, abs=1e-6), f"{what}: the run wrote {got}, direct float64 gives {want}"


def test_every_metric_of_a_steered_run_matches_a_direct_recomputation(tmp_path, tiny_spec, vector, reference,
                                                                      console):
    path = tmp_path / "v.safetensors"
    save_file({"direction": vector}, str(path))
    out = tmp_path / "run"
    out.mkdir()
    cfg = compose("engine=hf", "edit=add", f"edit.scale={SCALE}", f"edit.vector.path={path}", "metrics.sentiment=false",
                  f"gen.max_new_tokens={NEW}", TWO_PROMPTS, "progress=false")
    [agg] = run.execute([registry.prepare(cfg, out)], console)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and agg == json.loads((out / "metrics.json").read_text())

    v = vector.double()
    d = v / v.norm()
    push = SCALE * v
    stop = stops(reference)
    mine = {k: [] for k in ("kl", "ppl_baseline", "ppl_steered", "concept_baseline", "concept_steered",
                            "proj_baseline", "proj_steered")}
    changed = []
    for i, r in enumerate(rows):
        p, n = r["prompt_ids"], len(r["prompt_ids"])
        b, s = greedy(reference, p, stop), greedy(reference, p, stop, push)
        assert (r["baseline_ids"], r["steered_ids"]) == (b, s), f"prompt {i}: continuations differ from direct"
        assert s, f"prompt {i}: an empty steered continuation leaves its metrics None"
        changed.append(b != s)

        lb, hb = forward(reference, p + s)  # the unsteered model reads the steered text
        ls, hs = forward(reference, p + s, push)  # the steered model reads it
        lr, hr = forward(reference, p + b)  # the unsteered model re-reads its own text
        # Row t predicts token t + 1: rows n-1 .. n+len(s)-2 predict the steered continuation, the last row nothing.
        rows_s, rows_b = torch.arange(n - 1, n - 1 + len(s)), torch.arange(n - 1, n - 1 + len(b))
        want = {
            "kl": float((ls[rows_s].exp() * (ls[rows_s] - lb[rows_s])).sum(-1).mean()),
            "ppl_baseline": math.exp(-float(lr[rows_b, torch.tensor(b)].mean())),
            "ppl_steered": math.exp(-float(lb[rows_s, torch.tensor(s)].mean())),  # unsteered model: damage shows
            # The continuation's own rows (n ..), not the last prompt token's, which is the same for both texts.
            "concept_baseline": float((hr[n:] @ d).mean()),
            "concept_steered": float((hb[n:] @ d).mean()),
            # On the unit direction: a metric in the stream's units, whatever the vector's norm.
            "proj_baseline": float((hb @ d).abs().mean()),
            "proj_steered": float((hs @ d).abs().mean()),
        }
        for k, x in want.items():
            close(r[k], x, f"prompt {i} {k}")
            mine[k].append(x)
        assert r["tokens_changed"] == sum(x != y for x, y in zip(b, s)) + abs(len(b) - len(s))

    assert any(changed)  # a concept gain to get wrong, not two readings of one text
    for k, xs in mine.items():
        close(agg["kl_mean" if k == "kl" else k], sum(xs) / len(xs), f"metrics.json {k}")
