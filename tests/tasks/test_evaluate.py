"""task=eval (steer/tasks/evaluate.py): p(matching) checked against a direct transformers computation, the held-out
split, and the run's files."""

import json

import pytest
import torch

from helpers import compose
from steer.tasks import evaluate
from steer.runs.data import ABItem


def _items(n=4):
    qs = ["Is the glass half full?", "Will tomorrow be better?", "Can the team still win?", "Is it worth trying?",
          "Will the garden grow?", "Is the plan good?"]
    return [ABItem(f"{q}\n\nChoices:\n (A) Yes, surely\n (B) No, never", *(("(A)", "(B)") if i % 2 == 0
                                                                              else ("(B)", "(A)")))
            for i, q in enumerate(qs[:n])]


def _direct(spec, items, chat, layer=None, vec=None, scale=0.0):
    """p(matching) from transformers itself: the model loaded on its own, the chat template applied by the
    tokenizer, `scale * vec` added to decoder layer `layer`'s output at every position by a hook of this test."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec.source)
    model = AutoModelForCausalLM.from_pretrained(spec.source, torch_dtype=torch.float32).eval()
    handle = None
    if vec is not None:
        def add(module, args, output):
            h = output[0] if isinstance(output, tuple) else output
            h += scale * vec
        handle = model.model.layers[layer].register_forward_hook(add)
    out = []
    try:
        for x in items:
            if chat and tok.chat_template:
                ids = tok.apply_chat_template([{"role": "user", "content": x.question}], add_generation_prompt=True)
                ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
            else:
                ids = tok(x.question)["input_ids"]
            a = tok(x.matching, add_special_tokens=False)["input_ids"]
            b = tok(x.not_matching, add_special_tokens=False)["input_ids"]
            k = next(i for i, (p, q) in enumerate(zip(a, b)) if p != q)
            with torch.no_grad():
                logits = model(torch.tensor([ids + a[:k]])).logits[0, -1].double()
            probs = torch.softmax(logits, -1)
            out.append(float(probs[a[k]] / (probs[a[k]] + probs[b[k]])))
    finally:
        if handle is not None:
            handle.remove()
    return out


def _check_against_transformers(engine, spec, cfg, layer, chat):
    items = _items()
    torch.manual_seed(0)
    vec = torch.randn(spec.hidden)
    vec = vec / vec.norm() * 4
    got = evaluate.evaluate(engine, items, evaluate.plans(cfg, spec, vec), [2.0, -3.0], chat=chat)
    base = _direct(spec, items, chat)
    assert [r["p_baseline"] for r in got["items"]] == pytest.approx(base, abs=2e-4)
    for s in (2.0, -3.0):
        steered = _direct(spec, items, chat, layer, vec, s)
        assert [r["p_steered"][f"{s:g}"] for r in got["items"]] == pytest.approx(steered, abs=2e-4)
        assert max(abs(a - b) for a, b in zip(steered, base)) > 1e-3  # the edit moved what is compared
    # the mean of the items, each within the items' tolerance of transformers' (float32 sums differ by machine)
    assert got["baseline"]["p_matching"] == pytest.approx(sum(base) / len(base), abs=2e-4)
    shift = got["scales"][0]
    lo, hi = shift["shift_ci95"]
    assert lo <= shift["shift"] <= hi


def test_letter_probability_matches_transformers_on_tiny(hf_engine, tiny_spec):
    cfg = compose("task=eval", "tap.layer=2")
    _check_against_transformers(hf_engine, tiny_spec, cfg, 2, chat=False)


def test_letter_probability_matches_transformers_on_smollm2(smollm2_engine, smollm2_spec):
    cfg = compose("task=eval", "model=smollm2", "tap.layer=12", tiny=False)
    _check_against_transformers(smollm2_engine, smollm2_spec, cfg, 12, chat=True)


def test_split_is_disjoint_and_seeded():
    items = _items(6)
    fit, held = evaluate.split(items, 0.5, seed=3)
    assert len(fit) == len(held) == 3 and not set(fit) & set(held)
    assert evaluate.split(items, 0.5, seed=3) == (fit, held)
    assert set(fit) | set(held) == set(items)


def test_eval_run_writes_its_files_scoring_only_held_out_items(cli, tmp_path):
    res = cli(["task=eval", "eval.split=0.5", "eval.scales=[-4,4]", "hydra.run.dir=out"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads((tmp_path / "out" / "eval.json").read_text())
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert (tmp_path / "out" / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from steer.runs.data import dataset_path, load_ab

    items = load_ab(dataset_path("optimism"))
    fit, held = evaluate.split(items, 0.5, 0)
    assert [r["question"] for r in out["items"]] == [x.question for x in held]
    assert out["fit_items"] == len(fit) == 30 and out["n"] == 30
    assert metrics["p_matching_baseline"] == pytest.approx(sum(r["p_baseline"] for r in out["items"]) / 30)
    for s in out["scales"]:
        key = f"{s['scale']:g}"
        per_item = [r["p_steered"][key] - r["p_baseline"] for r in out["items"]]
        assert metrics[f"shift_scale{key}"] == pytest.approx(sum(per_item) / 30)
        assert s["shift_ci95"][0] <= s["shift"] <= s["shift_ci95"][1]
    assert "p(matching) on 30 items" in res.stdout + res.stderr and "items scored" not in res.stderr
    said = res.stdout + res.stderr
    assert f"letter mass {out['baseline']['letter_mass']:.3f}" in said, said[-2000:]


def test_an_eval_over_few_items_says_its_intervals_mean_little(cli, tmp_path):
    items = [{"question": f"Is {x} good?\n\nChoices:\n (A) Yes\n (B) No", "answer_matching_behavior": "(A)",
              "answer_not_matching_behavior": "(B)"} for x in ("rain", "sun", "snow", "wind")]
    (tmp_path / "ab.json").write_text(json.dumps(items))
    res = cli(["task=eval", "eval.dataset=ab.json", "eval.scales=[4]", "hydra.run.dir=out"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "warning only 2 items scored: a bootstrap over fewer than 10 gives intervals" in res.stderr
