"""Conditional steering checked against IBM's activation-steering library (CAST's reference implementation), on
SmolLM2 on the CPU: with the same condition vector, layer, threshold, comparator and reduction, a steer run decides
each prompt as the library does, and with the same behaviour vector at the same place generates the same text.

The library wraps each decoder layer and reads and edits that layer's *input*: its layer k is steer's layer k-1
(the residual stream after decoder layer k-1). It runs one prompt at a time; steer runs the prompts batched. Its
comparator names are the other way round from steer's: "smaller" (the threshold is smaller than the similarity)
is steer's `compare: above`, "larger" is `below`.

The library is not on PyPI: the test skips where it is not importable. It runs with it installed from a checkout
of its repository (`pip install --no-deps <checkout>`, with scikit-learn, which it imports).
"""

import json
from collections import defaultdict

import pytest
import torch

FOOD = ["Give me a recipe for a tomato soup", "What should I cook for dinner tonight with rice and beans",
        "How do I bake a chocolate cake", "Which cheese goes best with pasta",
        "Tell me about the spices used in Indian curry", "What is a good breakfast with eggs and bread",
        "How long should I roast a chicken"]
OTHER = ["How do I change a flat tyre on my bike", "Explain how a rainbow forms",
         "What is the capital of Australia", "Write a short note to my landlord about the heating",
         "How many planets are in the solar system", "Give me tips for a job interview",
         "How do I set up a new email account"]
# Held apart from the prompts above: the condition direction is extracted from these
COND_POS = ["I love eating fresh bread and butter", "The soup needs more salt and pepper",
            "We grilled fish and vegetables for lunch", "Dessert was a warm apple pie with cream",
            "She chopped onions and garlic for the sauce", "A bowl of noodles with spicy broth"]
COND_NEG = ["The train leaves the station at noon", "He fixed the broken fence in the garden",
            "The meeting was moved to Thursday", "Stars are very far away from the earth",
            "She painted the walls of her room blue", "The football match ended in a draw"]
JOY_POS = ["I am so happy and grateful, this is a wonderful day", "What a joy, everything is bright and lovely",
           "We laughed and smiled, the party was great fun"]
JOY_NEG = ["I am so sad and tired, this is a terrible day", "What a misery, everything is dark and awful",
           "We cried and sighed, the evening was grim and cold"]
CONDITION_LAYER, BEHAVIOUR_LAYER = 5, 12  # steer's layers: the library's 6 and 13
NEW = 12


@pytest.fixture(scope="module")
def library():
    return pytest.importorskip("activation_steering", reason="IBM's activation-steering is not installed (it is not "
                                                              "on PyPI: pip install --no-deps a checkout of "
                                                              "IBM/activation-steering, and scikit-learn)")


@pytest.fixture(scope="module")
def vectors(smollm2_spec, tmp_path_factory):
    """A food-or-not condition direction at CONDITION_LAYER and a joy behaviour vector at BEHAVIOUR_LAYER, both
    extracted by steer and written to files; the prompts' cosine scores under the condition."""
    from steer.config.schema import TapConf
    from steer.edits import vector
    from steer.edits.tap import resolve
    from steer.engine.hf import HFEngine
    from steer.runs.extract import Recipe, direction

    engine = HFEngine(smollm2_spec)
    cond_tap = resolve(TapConf(layer=CONDITION_LAYER), smollm2_spec)
    joy_tap = resolve(TapConf(layer=BEHAVIOUR_LAYER), smollm2_spec)
    recipe = Recipe(position="mean", span="all", chat="auto")
    cond = direction(engine, cond_tap, COND_POS, COND_NEG, recipe).reshape(-1)
    joy = 4.0 * direction(engine, joy_tap, JOY_POS, JOY_NEG, recipe).reshape(-1)
    d = tmp_path_factory.mktemp("cast")
    vector.save(d / "cond.safetensors", {"direction": cond}, model="smollm2", tap=cond_tap.name, method="diffmean")
    vector.save(d / "joy.safetensors", {"direction": joy}, model="smollm2", tap=joy_tap.name, method="diffmean")
    engine.close()
    return d, cond, joy


def library_run(library, spec, cond, joy, threshold, comparator, mode, prompts):
    """Each prompt through the library one at a time: (its similarity, its decision, the generated text)."""
    from activation_steering import MalleableModel, SteeringVector
    from activation_steering.leash_layer import LeashLayer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec.source)
    model = AutoModelForCausalLM.from_pretrained(spec.source, dtype=torch.float32).eval()
    mm = MalleableModel(model, tok)
    layer = CONDITION_LAYER + 1
    mm.steer(behavior_vector=SteeringVector("llama", {BEHAVIOUR_LAYER + 1: joy.numpy()}, {}),
             behavior_layer_ids=[BEHAVIOUR_LAYER + 1], behavior_vector_strength=1.0,
             condition_vector=SteeringVector("llama", {layer: cond.numpy()}, {}), condition_layer_ids=[layer],
             condition_vector_threshold=threshold, condition_comparator_threshold_is=comparator,
             condition_threshold_comparison_mode=mode)
    settings = {"pad_token_id": tok.eos_token_id, "do_sample": False, "max_new_tokens": NEW}
    out = []
    for p in prompts:
        text = mm.respond(p, settings=settings, use_chat_template=True, reset_after_response=False)
        out.append((LeashLayer.condition_similarities[0][layer], bool(LeashLayer.condition_met[0]), text))
        # what the library's own find_best_condition_point resets between prompts
        LeashLayer.condition_met = defaultdict(lambda: False)
        LeashLayer.forward_calls = defaultdict(int)
        LeashLayer.condition_similarities = defaultdict(lambda: defaultdict(float))
    return out, tok


def steer_run(cli, tmp_path, d, threshold, compare, reduce, prompts):
    run = tmp_path / f"run-{compare}-{reduce}"
    res = cli(["model=smollm2", f"tap.layer={BEHAVIOUR_LAYER}", "edit=add", "edit.scale=1",
               f"edit.vector.path={d / 'joy.safetensors'}", f"edit.when.vector={d / 'cond.safetensors'}",
               f"edit.when.layer={CONDITION_LAYER}", f"edit.when.threshold={threshold}",
               f"edit.when.compare={compare}", f"edit.when.reduce={reduce}", f"gen.max_new_tokens={NEW}",
               f"prompts.steer=[{','.join(json.dumps(p) for p in prompts)}]", f"hydra.run.dir={run}"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]
    return rows, json.loads((run / "metrics.json").read_text())


def split(scores):
    """A threshold in the widest gap between the middle scores: some prompts on each side, none near it."""
    s = sorted(scores)
    lo = len(s) // 4
    gaps = [(s[i + 1] - s[i], i) for i in range(lo, len(s) - lo - 1)]
    _, i = max(gaps)
    return round((s[i] + s[i + 1]) / 2, 6)


@pytest.mark.parametrize("compare,comparator,reduce", [("above", "smaller", "mean"), ("below", "larger", "last")])
def test_decisions_and_text_equal_the_library(library, smollm2_spec, vectors, cli, tmp_path, compare, comparator,
                                             reduce):
    d, cond, joy = vectors
    prompts = FOOD + OTHER
    # a first pass with a threshold no prompt meets gives the library's similarities, to split them
    probe, _ = library_run(library, smollm2_spec, cond, joy, 2.0, "smaller", reduce, prompts)
    threshold = split([s for s, _, _ in probe])
    theirs, tok = library_run(library, smollm2_spec, cond, joy, threshold, comparator, reduce, prompts)
    rows, metrics = steer_run(cli, tmp_path, d, threshold, compare, reduce, prompts)
    met = [m for _, m, _ in theirs]
    assert 3 <= sum(met) <= len(met) - 3
    assert [r["when_met"] for r in rows] == met
    for r, (s, _, _) in zip(rows, theirs):
        assert r["when_score"] == pytest.approx(s, abs=1e-4)
    assert metrics["when_met"] == sum(met)
    for r, (_, m, text) in zip(rows, theirs):
        # the library decodes what it generated with the special tokens: the stop token steer leaves out
        mine = tok.decode(r["steered_ids"], skip_special_tokens=False)
        assert text.removesuffix(tok.eos_token) == mine, r["prompt"]
        if not m:  # an unmet condition steers nothing
            assert r["steered_ids"] == r["baseline_ids"], r["prompt"]
    assert sum(r["steered_ids"] != r["baseline_ids"] for r in rows if r["when_met"]) >= 2  # the behaviour shows
